"""Mixed precision, activation checkpointing and torch.compile, used the way users use them:
through the config glue (recipes.build) in a gloo world, and through `python train.py`."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.config import Config
from tests.harness import run_world
from tests.train_cli import train_py

TINY = ["model.overrides.num_hidden_layers=2", "data.seq_len=32", "data.batch_size=2"]


class _CollectiveBytes(TorchDispatchMode):
    """Bytes each rank puts into c10d all-gathers and reduce-scatters (FSDP2's)."""

    OPS = {
        "_allgather_base_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    }

    def __init__(self) -> None:
        super().__init__()
        self.sent = {"all_gather": 0, "reduce_scatter": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = self.OPS.get(func.__name__.split(".")[0]) if func.namespace == "c10d" else None
        if kind is not None:
            inputs = args[1] if isinstance(args[1], list | tuple) else [args[1]]
            self.sent[kind] += sum(t.numel() * t.element_size() for t in inputs)
        return func(*args, **(kwargs or {}))


CASES = [("float32", "auto"), ("bfloat16", "auto"), ("bfloat16", "bfloat16")]


def _mixed_precision_world():
    from recipes.build import build_model, build_optimizer, model_config, train_dtypes

    out = {}
    for param_dtype, reduce_dtype in CASES:
        dotlist = ["mesh.world_size=2", "mesh.ep=2", *TINY]
        dotlist += [f"train.param_dtype={param_dtype}", f"train.reduce_dtype={reduce_dtype}"]
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
        model = build_model(cfg, model_config(cfg), torch.device("cpu"))
        opt = build_optimizer(cfg.optim, model)
        gen = torch.Generator().manual_seed(dist.get_rank())
        ids = torch.randint(0, 256, (2, 33), generator=gen)
        forward, backward = _CollectiveBytes(), _CollectiveBytes()
        with forward:
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        with backward:
            loss.backward()
        opt.step()
        routers = [r.weight for r in model.routers()]
        out[(param_dtype, reduce_dtype)] = {
            "gathered": forward.sent["all_gather"],
            "reduced": backward.sent["reduce_scatter"],
            # Router weights keep float32 compute and reduction (their own FSDP unit): a
            # float32 shard sent in the all-gather, the float32 full gradient reduce-scattered.
            "router_shard_bytes": sum(w.to_local().numel() * 4 for w in routers),
            "router_full_bytes": sum(w.numel() * 4 for w in routers),
            "dtypes": train_dtypes(cfg, torch.device("cpu")),
            "param_dtypes": {str(p.dtype) for p in model.parameters()},
            "grad_dtypes": {str(p.grad.dtype) for p in model.parameters() if p.grad is not None},
            "state_dtypes": {
                str(v.dtype)
                for state in opt.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            },
        }
    return out


def test_bf16_params_halve_the_all_gather_bytes_over_fp32_masters():
    results = run_world(_mixed_precision_world, 2, timeout_s=240)
    for rank in results:
        fp32, bf16, bf16_reduce = (rank[case] for case in CASES)
        assert fp32["dtypes"] == (torch.float32, torch.float32)  # `auto` on CPU
        assert bf16["dtypes"] == (torch.bfloat16, torch.float32)
        assert bf16_reduce["dtypes"] == (torch.bfloat16, torch.bfloat16)
        # Masters, gradients and optimizer state (Muon momentum, AdamW moments) stay float32.
        for r in (fp32, bf16, bf16_reduce):
            assert r["param_dtypes"] == r["grad_dtypes"] == r["state_dtypes"] == {"torch.float32"}
        # bf16 sends 2 bytes per parameter value where fp32 sends 4, except the float32 routers.
        router = fp32["router_shard_bytes"]
        assert fp32["gathered"] > 0
        assert bf16["gathered"] == (fp32["gathered"] - router) // 2 + router
        # Gradients are reduced in train.reduce_dtype: float32 unless asked for bfloat16.
        router = fp32["router_full_bytes"]
        assert fp32["reduced"] > 0 and bf16["reduced"] == fp32["reduced"]
        assert bf16_reduce["reduced"] == (fp32["reduced"] - router) // 2 + router


def _train_py(args: list[str], root: Path) -> str:
    proc = train_py([*args, "logger=none"], root, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _metrics(root: Path, name: str) -> list[dict]:
    (run_dir,) = (root / name).iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _base(cache: Path) -> list[str]:
    return [
        "mesh.world_size=2",
        "mesh.ep=2",
        "train.warmup_steps=1",
        "optim.ns_dtype=float32",
        "checkpoint.export_hf=false",
        f"data.cache_dir={cache}",
        "+" + TINY[0],  # a new key of the model.overrides dict, on Hydra's command line
        *TINY[1:],
    ]


def test_bf16_run_trains_and_resumes_exactly(tmp_path):
    """bf16 compute with NorMuon on: its moments are state that resumes bit for bit."""
    args = [*_base(tmp_path / "cache"), "train.param_dtype=bfloat16", "train.steps=4"]
    args += ["optim.normuon=true"]
    args += ["checkpoint.every=2", "checkpoint.keep=3", "run.name=bf16"]
    _train_py(args, tmp_path)
    first = _metrics(tmp_path, "bf16")
    assert first[-1]["loss"] < first[0]["loss"]
    # Drop the last checkpoint: the same command resumes at step 2 and must redo steps 3-4
    # exactly (losses and per-algorithm gradient norms bit for bit).
    (run_dir,) = (tmp_path / "bf16").iterdir()
    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    shutil.rmtree(ckpts[-1])
    out = _train_py(args, tmp_path)
    assert "resumed from" in out
    again = _metrics(tmp_path, "bf16")
    keys = ("loss", "grad_norm/adamw", "grad_norm/muon")
    assert [[m[k] for k in keys] for m in again] == [[m[k] for k in keys] for m in first]


def test_activation_checkpointing_and_compile_keep_the_loss_curve(tmp_path):
    base = [*_base(tmp_path / "cache"), "train.steps=3", "metrics.memory_every=1"]
    # no evaluation: the curves are the training losses, and a compiled model's evaluation
    # would compile its no-grad graphs as well (a third of the compiled run's time)
    base += ["eval.every=0"]
    runs = {
        "plain": [],
        "ac": ["train.activation_checkpointing=full"],
        "compiled": ["train.compile=true"],
    }
    curves, peaks = {}, {}
    for name, extra in runs.items():
        _train_py([*base, *extra, f"run.name={name}"], tmp_path)
        lines = _metrics(tmp_path, name)
        curves[name] = [m["loss"] for m in lines]
        peaks[name] = [m["memory/step_peak_mib/max"] for m in lines]
    # Recomputation repeats the same float32 ops in the same order: the same numbers.
    assert curves["ac"] == curves["plain"]
    # ...while keeping only each layer's input for backward: a lower per-rank step peak.
    assert max(peaks["ac"]) < max(peaks["plain"])
    # Compiled kernels fuse and reorder float32 arithmetic (relative rounding ~1e-7 per op);
    # float32 Newton-Schulz keeps three optimizer steps from amplifying it beyond ~1e-5, so
    # 1e-4 relative on the loss leaves margin and still catches a wrong layer (>1e-2).
    np.testing.assert_allclose(curves["compiled"], curves["plain"], rtol=1e-4)
    assert curves["plain"][-1] < curves["plain"][0]


#: the GQA model, and MLA + DSA (32 tokens > index_topk 16, a shared layer, the KL-trained
#: indexer); both with an MTP layer, trained by the objective
_PRESETS = {
    "tiny": dict(num_hidden_layers=2, num_mtp_layers=1),
    "mla_tiny": dict(num_hidden_layers=2, indexer_types=["full", "shared"]),
}


def _loss_grads_loads(preset: str, checkpointing: bool, compiled: bool):
    from models.glm import GLMForCausalLM, get_preset

    model = GLMForCausalLM(get_preset(preset, **_PRESETS[preset]))
    model.init_weights(0)
    for layer in [*model.model.layers, *model.model.mtp_layers]:
        layer.checkpoint_activations = checkpointing
        if compiled:
            layer.compile_block()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    terms = model(ids[:, :-1], ids[:, 1:])
    assert "mtp_loss" in terms and ("indexer_kl" in terms) == (preset == "mla_tiny")
    loss = terms["loss"] + 0.3 * terms["mtp_loss"] + terms.get("indexer_kl", 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, [r.expert_load.clone() for r in model.routers()]


@pytest.mark.parametrize("preset", list(_PRESETS))
@pytest.mark.parametrize("compiled", [False, True])
def test_checkpointed_layers_give_the_same_gradients_and_count_loads_once(compiled, preset):
    loss, grads, loads = _loss_grads_loads(preset, checkpointing=False, compiled=False)
    loss2, grads2, loads2 = _loss_grads_loads(preset, checkpointing=True, compiled=compiled)
    # The recomputation must not count the routed tokens a second time.
    assert all(torch.equal(a, b) for a, b in zip(loads, loads2, strict=True))
    assert grads.keys() == grads2.keys()
    if not compiled:  # the same float32 ops again: the same bits
        assert loss == loss2 and all(torch.equal(grads[n], grads2[n]) for n in grads)
    else:  # fused float32 kernels: rounding-level differences (~1e-7 relative per op, a few
        # dozen ops deep); 1e-5 of each gradient's scale catches a misaligned recomputation
        # (which gave errors of ~50% of the router's gradient).
        assert loss == pytest.approx(loss2, rel=1e-5)
        # The indexer's KL gradient is a difference of two nearly equal distributions at init
        # (attention and index scores both near uniform, KL ~1e-5): the cancellation turns the
        # same rounding into ~100x more of its (tiny) scale, so it gets 1e-3 (measured 2e-5).
        for n in grads:
            scale = grads[n].abs().max().item() * (100 if ".indexer." in n else 1)
            torch.testing.assert_close(grads2[n], grads[n], rtol=0, atol=1e-5 * scale)
