"""`muon.Muon` side by side with torch.optim.Muon (one rank) and microsoft/dion's distributed
Muon (W ranks, the same FSDP2-sharded matrices, `scripts/bench_dion.py`): time per step
(slowest rank; the optimizers take turns step by step, `recipes.bench.timing.rotations`) and
peak memory per rank (the momentum state plus a warm step's `MemoryMeter` peak beyond it).

dion is imported from a checkout given on the command line (its `dion/` package on the path
of the world's ranks); it is not a dependency of this project. Its step's `torch.compile`d
helpers run eagerly (`TORCHDYNAMO_DISABLE=1`, as this project's step runs), so the two compare
the same eager work.
"""

from __future__ import annotations

import os
import statistics

import torch

from recipes.bench.fixtures import optimizer_step_peak, sharded_matrices
from recipes.bench.timing import rotations, timed
from recipes.dtypes import DTYPES
from recipes.ranks import local_tensor
from recipes.units import MiB

#: `muon.Muon` with a `memory_budget` below every batch: the smallest batches the plan cuts
ONE_UNIT = "muon.Muon, one unit per batch"


def _state_bytes(opt, params) -> int:
    """Bytes of the optimizer state tensors of `params` (local shards) on this rank."""
    total = 0
    for p in params:
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim():
                total += local_tensor(v).nbytes
    return total


def _build(name: str, params, mesh, cfg: dict):
    ns = DTYPES[cfg["ns_dtype"]]
    if name.startswith("muon.Muon"):
        from muon import Muon

        budget = {"memory_budget": 1} if name == ONE_UNIT else {}  # every batch one unit
        return Muon(params, lr=0.02, remainder_strategy=cfg["strategy"], ns_dtype=ns, **budget)
    if name == "torch.optim.Muon":
        return torch.optim.Muon(params, lr=0.02, adjust_lr_fn="match_rms_adamw")
    from dion import Muon as DionMuon  # the checkout on the ranks' path

    return DionMuon(params, distributed_mesh=mesh, lr=0.02, nesterov=True, adjust_lr="rms_norm")


def bench_rank(cfg: dict) -> dict:
    """One rank: every optimizer of `cfg["optimizers"]` on its own copy of `cfg["shapes"]`
    (the same values), warmed up, timed in turns, then measured; this rank's figures."""
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from recipes.memory import MemoryMeter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    meter = MemoryMeter("cpu")
    opts, params = {}, {}
    for name in cfg["optimizers"]:
        gen = torch.Generator().manual_seed(0)
        shapes = [tuple(s) for s in cfg["shapes"]]
        params[name] = sharded_matrices(shapes, mesh, generator=gen)
        if dist.get_world_size() == 1 and name == "torch.optim.Muon":  # plain tensors
            params[name] = [_plain(p) for p in params[name]]
        opts[name] = _build(name, params[name], mesh, cfg)
    for name in cfg["optimizers"]:
        for _ in range(cfg["warmup"]):
            opts[name].step()
    times = {name: [] for name in cfg["optimizers"]}
    for name in rotations(cfg["optimizers"], cfg["steps"]):
        times[name].append(timed(opts[name].step))
    out = {}
    for name, opt in opts.items():
        out[name] = dict(
            step_s=times[name],
            state=_state_bytes(opt, params[name]),
            transient=optimizer_step_peak(meter, opt, cfg["repeats"]),
        )
    dist.destroy_process_group()
    return out


def _plain(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A 1-rank FSDP2 parameter as a plain tensor (torch.optim.Muon takes no DTensor)."""
    q = torch.nn.Parameter(p.full_tensor().clone())
    q.grad = p.grad.full_tensor().clone()
    return q


def summary(by_rank: list[dict]) -> dict:
    """Per optimizer: ms per step (mean over steps of the slowest rank), peak MiB per rank."""
    out = {}
    for name in by_rank[0]:
        steps = len(by_rank[0][name]["step_s"])
        ms = statistics.mean(max(r[name]["step_s"][i] for r in by_rank) for i in range(steps))
        peak = [(r[name]["state"] + r[name]["transient"]) / MiB for r in by_rank]
        out[name] = dict(
            ms=ms * 1e3,
            peak_mib=peak,
            state_mib=[r[name]["state"] / MiB for r in by_rank],
            transient_mib=[r[name]["transient"] / MiB for r in by_rank],
        )
    return out


def table(rows: dict, reference: str) -> str:
    """Markdown: per optimizer ms/step, peak and transient per rank (MiB), and the ratios of
    time and of the largest peak to `reference`'s."""
    ref = rows.get(reference)
    lines = [
        "| optimizer | ms/step | peak MiB per rank | of it transient | time / ref | peak / ref |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        cells = [name, f"{r['ms']:.1f}", " / ".join(f"{x:.2f}" for x in r["peak_mib"])]
        cells.append(" / ".join(f"{x:.2f}" for x in r["transient_mib"]))
        if ref:
            cells.append(f"{r['ms'] / ref['ms']:.2f}")
            cells.append(f"{max(r['peak_mib']) / max(ref['peak_mib']):.2f}")
        else:
            cells += ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
