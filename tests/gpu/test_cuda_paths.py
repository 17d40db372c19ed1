"""The CUDA paths the CPU suite cannot see: per-shard init on the device, the bf16/fp32 mixed
precision defaults, torch.compile, the MemoryMeter on a real step (one NCCL rank), and the host
syncs of Gram Newton-Schulz's blow-up check (none in the optimizer's form). Skipped where no
CUDA device is present."""

import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from tests.harness import run_world

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*dotlist: str):
    from recipes.config import Config

    base = ["mesh.world_size=1", "mesh.ep=1", "data.seq_len=64", "data.batch_size=4"]
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([*base, *dotlist]))


def _batch(device, seq=64, batch=4):
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=gen, device=device)
    return ids[:, :-1], ids[:, 1:]


def _init_case(device) -> dict:
    """Per-shard init of the sharded model (recipes.build) against a plain model built and
    initialized on the same device, and against the CPU init of the same seed."""
    from models.glm import GLMForCausalLM
    from recipes.build import build_model, model_config

    cfg = _cfg("model.preset=small")
    model = build_model(cfg, model_config(cfg), device)
    placed = {str(t.device) for t in [*model.parameters(), *model.buffers()]}
    placed |= {str(p.to_local().device) for p in model.parameters()}
    with torch.device(device):
        plain = GLMForCausalLM(model_config(cfg))
    plain.init_weights(cfg.train.seed)
    cpu = GLMForCausalLM(model_config(cfg))
    cpu.init_weights(cfg.train.seed)
    sharded = {n: p.full_tensor() for n, p in model.named_parameters()}
    name = "model.embed_tokens.weight"
    return {
        "placed": placed,
        "mismatched": [n for n, p in plain.named_parameters() if not torch.equal(sharded[n], p)],
        "same_as_cpu": torch.equal(sharded[name].cpu(), cpu.get_parameter(name)),
        "std": sharded[name].std().item(),
        "init_std": model.config.initializer_range,
    }


def _mixed_precision_case(device) -> dict:
    """`train.param_dtype/reduce_dtype=auto` on CUDA: what the layers compute in, what the
    masters, gradients and optimizer state are."""
    from recipes.build import build_model, build_optimizer, model_config, train_dtypes

    cfg = _cfg()
    model = build_model(cfg, model_config(cfg), device)
    opt = build_optimizer(cfg.optim, model)
    seen = {}

    def record(key):
        def hook(module, args) -> None:  # returns None: the inputs stay as they are
            seen.setdefault(key, module.weight.dtype)

        return hook

    attn = model.model.layers[0].self_attn
    linear = next(m for m in attn.modules() if isinstance(m, torch.nn.Linear))
    hooks = [
        linear.register_forward_pre_hook(record("linear")),
        model.routers()[0].register_forward_pre_hook(record("router")),
    ]
    loss = model.loss(*_batch(device))
    loss.backward()
    opt.step()
    for h in hooks:
        h.remove()
    state = {
        str(v.dtype)
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    }
    return {
        "dtypes": train_dtypes(cfg, device),
        "linear": seen["linear"],
        "router": seen["router"],
        "params": {str(p.dtype) for p in model.parameters()},
        "grads": {str(p.grad.dtype) for p in model.parameters() if p.grad is not None},
        "state": state,
        "finite": math.isfinite(loss.item()),
    }


def _compile_case(device) -> dict:
    """`train.compile=true` on CUDA: the compiled layers' loss and gradients against eager."""
    from recipes.build import build_model, model_config

    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cfg = _cfg(f"train.compile={str(compiled).lower()}")
        model = build_model(cfg, model_config(cfg), device)
        loss = model.loss(*_batch(device))
        loss.backward()
        grads = torch.cat([p.grad.full_tensor().flatten().float() for p in model.parameters()])
        out[compiled] = (loss.item(), grads.cpu())
        if compiled:
            out["used"] = all(layer.compiled for layer in model.model.layers)
            out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


def _meter_case(device) -> dict:
    from recipes.bench.meter_check import compare

    return compare("small", 256, 8, device)


def _cuda_world() -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    assert dist.get_backend() == "nccl"
    return {
        "init": _init_case(device),
        "mixed": _mixed_precision_case(device),
        "compile": _compile_case(device),
        "meter": _meter_case(device),
    }


@pytest.fixture(scope="module")
def cuda_world() -> dict:
    """One NCCL rank on cuda:0 runs every case (a world costs seconds)."""
    return run_world(_cuda_world, 1, backend="nccl", timeout_s=420)[0]


def test_per_shard_init_draws_on_the_device(cuda_world):
    r = cuda_world["init"]
    assert r["placed"] == {"cuda:0"}  # parameters, their local shards and buffers
    # The sharded world-1 model equals a plain model initialized on the same device ...
    assert r["mismatched"] == []
    # ... and its values come from the device's generator (Philox), not CPU draws copied over.
    assert not r["same_as_cpu"]
    # N(0, std) over 65536 values: relative standard error 1/sqrt(2n) ~ 0.3%; 5% is > 15 sigma.
    assert math.isclose(r["std"], r["init_std"], rel_tol=0.05)


def test_mixed_precision_defaults_on_cuda(cuda_world):
    r = cuda_world["mixed"]
    assert r["dtypes"] == (torch.bfloat16, torch.float32)  # `auto` on CUDA
    assert r["linear"] == torch.bfloat16  # FSDP2 unshards the layers in bf16
    assert r["router"] == torch.float32  # the router keeps float32 compute (its own unit)
    # float32 masters, gradients (reduced in float32) and optimizer state
    assert r["params"] == r["grads"] == r["state"] == {"torch.float32"}
    assert r["finite"]


def test_compile_on_cuda_matches_eager(cuda_world):
    r = cuda_world["compile"]
    assert r["used"] and r["graphs"] >= 1
    (eager_loss, eager_g), (comp_loss, comp_g) = r[False], r[True]
    # bf16 compute: every op rounds to 2^-8 relative, and inductor fuses ops with float32
    # intermediates, so the two differ by a few bf16 roundings of the logits, averaged over
    # 256 tokens in the loss: far below 1% of a loss near ln(256) = 5.5.
    assert comp_loss == pytest.approx(eager_loss, rel=1e-2)
    # The same rounding on the gradients: the same direction, to well within a degree or so.
    cos = torch.nn.functional.cosine_similarity(eager_g, comp_g, dim=0).item()
    assert cos > 0.99, cos


def test_memory_meter_matches_the_allocator_on_a_step(cuda_world):
    r = cuda_world["meter"]
    assert r["ok"], r["checks"]  # tolerances: scripts/check_memory_meter.py
    assert {"step_peak_mib", "optim_peak_mib", "optim_peak_delta_mib"} <= r["summary"].keys()
    assert r["summary"]["step_peak_delta_mib"] > 0


def test_auto_device_picks_cuda_when_every_local_rank_has_a_gpu():
    from recipes.launch import choose_device

    n = torch.cuda.device_count()
    assert choose_device("auto", n) == "cuda"
    assert choose_device("auto", n + 1) == "cpu"  # not enough GPUs for the local ranks
    assert choose_device("cpu", 1) == "cpu"


def host_syncs(fn) -> int:
    """Host-device synchronizations `fn()` makes (CUDA's sync debug mode, one warning each)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def test_gram_blow_up_check_syncs_once_per_call_not_per_block():
    """The blow-up check decides on the host whether any block needs the standard iteration:
    one sync per call whatever the batch, so Muon's batches in flight keep the device busy."""
    from muon.cost import effective_algorithm
    from muon.newton_schulz import newton_schulz

    assert effective_algorithm(256, 768, 5, "gram") == "gram"
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = {}
    for blocks in (2, 8):
        G = torch.randn(blocks, 256, 768, device="cuda", generator=gen)
        run = lambda G=G: newton_schulz(G, coefficients="polar_express", algorithm="gram")  # noqa: E731
        run()  # warm-up: cuBLAS handles and workspaces
        counts[("finite", blocks)] = host_syncs(run)
        G[0] = float("nan")  # a block the check must send to the standard iteration
        counts[("nan", blocks)] = host_syncs(run)
    assert counts[("finite", 2)] == counts[("finite", 8)] <= 1, counts
    assert counts[("nan", 2)] == counts[("nan", 8)], counts


def test_gram_blow_up_flags_left_on_the_device_sync_never():
    """The optimizer's form of the check (`blowups=`, `muon.blowups`): the flags stay on the
    device and a blown-up block comes back as zeros, without a sync."""
    from muon.newton_schulz import newton_schulz

    G = torch.randn(4, 256, 768, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    G[0] = float("nan")
    flags: list = []
    run = lambda: newton_schulz(G, coefficients="polar_express", algorithm="gram", blowups=flags)  # noqa: E731
    run()  # warm-up: cuBLAS handles, the check's start vector
    assert host_syncs(run) == 0
    assert flags[-1].tolist() == [True, False, False, False]
