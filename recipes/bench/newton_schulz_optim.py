"""The Newton-Schulz variants inside `muon.Muon`: tiny-GLM training and the optimizer step.

`OPT_VARIANTS` are Muon-level (ns_coefficients, ns_algorithm) pairs. `train` runs the tiny GLM
preset in one process per variant, seed and learning rate on this Python's standard library as
bytes, and captures the momentum blocks of the first run (`newton_schulz.momentum_quality`
measures the variants on them); `step_world` steps FSDP2-sharded matrices on a gloo world
(`world.run_world`) per variant, interleaved, and measures the quality of the applied update.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time

import torch

from recipes.bench.newton_schulz import quality
from recipes.world import run_world

# Muon-level variants (ns_coefficients, ns_algorithm) for training and the optimizer step; the
# first is the baseline of the "vs fixed" columns.
OPT_VARIANTS = {
    "fixed standard": ("fixed", "standard"),
    "tuned standard": ("tuned", "standard"),
    "polar_express standard": ("polar_express", "standard"),
    "polar_express gram": ("polar_express", "gram"),
    "polar_express auto": ("polar_express", "auto"),  # muon.Muon's and the recipe's default
}
DEFAULT = "polar_express auto"


def _token_stream(n_bytes: int = 4 << 20) -> torch.Tensor:
    from recipes.data import stdlib_dir, stdlib_files

    data = bytearray()
    for f in stdlib_files(stdlib_dir()):
        data += f.read_bytes()
        if len(data) >= n_bytes:
            break
    return torch.frombuffer(bytearray(data[:n_bytes]), dtype=torch.uint8).long()


def _train_one(tokens, coefs: str, algo: str, steps: int, seed: int, lr: float):
    """One tiny-GLM run: (losses, seconds, optimizer)."""
    from models.glm import GLMForCausalLM, get_preset
    from muon import Muon, param_groups

    seq, batch = 64, 8
    torch.manual_seed(seed)
    model = GLMForCausalLM(get_preset("tiny"))
    model.init_weights(seed)
    opt = Muon(param_groups(model, lr=lr), ns_coefficients=coefs, ns_algorithm=algo)
    gen = torch.Generator().manual_seed(1000 + seed)
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        start = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([tokens[s : s + seq + 1] for s in start.tolist()])
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0, opt


def _momentum_blocks(opt) -> dict[str, torch.Tensor]:
    """The Nesterov inputs of the optimizer's last step, as [blocks, rows, cols] per shape."""
    out = {}
    for g in opt.param_groups:
        if g.get("algorithm") != "muon":
            continue
        for pname, p in zip(g["param_names"], g["params"], strict=True):
            buf = opt.state[p]["momentum_buffer"]
            inp = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
            e = g["num_blocks"]
            key = f"{pname.split('.')[-2]} [{e}x{p.size(0) // e}x{p.size(1)}]"
            out.setdefault(key, inp.reshape(e, p.size(0) // e, -1).float())
    return out


def train(*, steps: int, seeds: int, lrs: list[float]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Tiny GLM, one process, `seeds` seeds (initialization and data order) per optimizer
    variant and learning rate, `steps` steps each: mean loss curves, final losses per seed; the
    momentum of the first run."""
    tokens = _token_stream()
    tail = max(1, steps // 10)
    curves, seconds, finals, momentum = {}, {}, {}, {}
    for lr, (variant, (coefs, algo)) in itertools.product(lrs, OPT_VARIANTS.items()):
        name, runs = f"{variant}, lr {lr:g}", []
        for seed in range(seeds):
            losses, secs, opt = _train_one(tokens, coefs, algo, steps, seed, lr)
            runs.append(losses)
            seconds[name] = seconds.get(name, 0.0) + secs
            if not momentum:
                momentum = _momentum_blocks(opt)
            del opt
        curves[name] = [statistics.mean(step) for step in zip(*runs, strict=True)]
        finals[name] = [statistics.mean(r[-tail:]) for r in runs]
    return dict(
        curves=curves,
        seconds=seconds,
        final_loss={k: statistics.mean(v) for k, v in finals.items()},
        final_loss_per_seed=finals,
        tail_steps=tail,
        seeds=seeds,
        lrs=lrs,
    ), momentum


def _step_worker(cfg: dict) -> dict:
    """One rank of the step world: its step times; rank 0 adds the updates' quality."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from muon import Muon

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    r, c = cfg["shape"]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(r, c, generator=gen) for _ in range(cfg["count"])]
    opts, mods = {}, {}
    for name, (coefs, algo) in OPT_VARIANTS.items():
        holder = nn.Module()
        holder.ps = nn.ParameterList([nn.Parameter(torch.zeros(r, c)) for _ in grads])
        fully_shard(holder, mesh=mesh)
        mods[name] = holder
        opts[name] = Muon(
            list(holder.parameters()),
            lr=1.0,
            momentum=0.0,
            nesterov=False,
            adjust_lr="original",
            ns_coefficients=coefs,
            ns_algorithm=algo,
        )

    def step(name):
        for p, g in zip(mods[name].ps, grads, strict=True):
            rows = p.to_local().size(0)
            lo = rank * math.ceil(r / world)
            p.grad = DTensor.from_local(
                g[lo : lo + rows].clone(),
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
            )
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opts[name].step()
        return time.perf_counter() - t0, time.process_time() - c0

    times = {n: [] for n in OPT_VARIANTS}
    for n in OPT_VARIANTS:  # warm-up, and the update of one step from zero weights
        step(n)
    updates = {n: [-p.full_tensor() for p in mods[n].ps] for n in OPT_VARIANTS}
    for _ in range(cfg["repeats"]):
        for n in OPT_VARIANTS:
            times[n].append(step(n))
    res = {"times": times}
    if rank == 0:
        G = torch.stack(grads)
        res["quality"] = {n: quality(G, torch.stack(u)) for n, u in updates.items()}
    # leave together: a rank tearing gloo down while a peer still talks to it aborts
    dist.barrier()
    return res


def step_world(*, world: int, shape: tuple[int, int], count: int, repeats: int) -> dict:
    """`muon.Muon.step` per variant on a gloo world of `world` ranks, `count` FSDP2-sharded
    matrices of `shape`, `repeats` timed steps each (interleaved): the slowest rank's median
    wall and CPU time, and the quality of the applied update."""
    r, c = shape
    cfg = dict(shape=(r, c), count=count, repeats=repeats)
    results = run_world(_step_worker, world, cfg, timeout_s=3600)
    res = results[0]
    per_rank = [out["times"] for out in results]
    rows = []
    for n in OPT_VARIANTS:
        # slowest rank per step, then the median over steps
        wall = statistics.median(max(t[n][i][0] for t in per_rank) for i in range(cfg["repeats"]))
        cpu = statistics.median(max(t[n][i][1] for t in per_rank) for i in range(cfg["repeats"]))
        rows.append(dict(variant=n, step_ms=wall * 1e3, step_cpu_ms=cpu * 1e3, **res["quality"][n]))
    base = rows[0]
    for row in rows:
        row["cpu_vs_fixed"] = row["step_cpu_ms"] / base["step_cpu_ms"]
        row["wall_vs_fixed"] = row["step_ms"] / base["step_ms"]
    return dict(world=world, shape=[r, c], count=count, rows=rows)
