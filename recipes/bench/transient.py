"""The optimizer step's transient per rank, measured and planned: a warm `Muon.step`'s peak
(`recipes.memory.MemoryMeter`, the momentum state already allocated) next to the plan's
window (`muon.batch_cost.window_peak_bytes`), on FSDP2-sharded matrices, one variant of the
optimizer's options after another in one world (`scripts/measure_transient.py`).
"""

from __future__ import annotations

import torch

from recipes.bench.fixtures import optimizer_step_peak, sharded_matrices
from recipes.dtypes import DTYPES
from recipes.units import MiB

#: 19 matrices, 13.4 M parameters: 3 layers of a d = 640 transformer (q, k, v, o and a 2048
#: MLP) and one 1024 x 640 matrix; stacked full batches and remainders of 3 and 1 at W = 4
MODEL = [(640, 640)] * 12 + [(2048, 640), (640, 2048)] * 3 + [(1024, 640)]


def measure_rank(cfg: dict) -> dict:
    """One rank: every variant of `cfg["variants"]` (name -> Muon keywords) on `MODEL`;
    per variant this rank's measured and planned transient (bytes) and its batches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from muon import Muon
    from recipes.memory import MemoryMeter

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    meter = MemoryMeter("cpu")
    gen = torch.Generator().manual_seed(0)
    params = sharded_matrices([tuple(s) for s in cfg["shapes"]], mesh, generator=gen)
    out = {}
    for name, kw in cfg["variants"].items():
        kw = dict(kw)
        if "ns_dtype" in kw:
            kw["ns_dtype"] = DTYPES[kw["ns_dtype"]]
        opt = Muon(params, **kw)
        opt.step()
        measured = optimizer_step_peak(meter, opt, cfg["repeats"])
        state = sum(opt.state[p]["momentum_buffer"].to_local().nbytes for p in params)
        planned, who = _planned(opt)
        out[name] = dict(
            measured=measured,
            planned=planned,
            at_peak=who,
            state=state,
            batches=[f"{b.path} {b.size}" for _, bs in opt.plans for b in bs],
        )
        del opt
    dist.destroy_process_group()
    return out


# A task's stretches in a world of several ranks, where the ranks agree on the verdicts
# before the apply (`muon.batch_cost.segments` with `agree`)
STRETCHES = ("momentum + launch", "orthogonalize + return", "check + verdicts", "apply")
LOCAL_STRETCHES = ("local: to the verdicts", "local: apply")


def _planned(opt) -> tuple[int | None, list]:
    """The plan's window on this rank and who holds it at the peak (`(batch, what it runs,
    MiB)`); (None, []) for a checkout without that model."""
    try:
        from muon.batch_cost import window_at_peak
    except ImportError:
        return None, []
    g = opt.param_groups[0]
    peak, who = window_at_peak(
        opt.plans,
        max_inflight=opt.max_inflight,
        ns_itemsize=getattr(torch, g["ns_dtype"]).itemsize,
        nesterov=g["nesterov"],
        normuon=g.get("normuon", False),
        gloo=True,
    )
    label = "{} {} x {}".format
    return peak, [
        (label(b.path, b.size, "x".join(map(str, b.global_shape))), _stretch(b, s), held / MiB)
        for b, s, held in who
    ]


def _stretch(b, s: int | None) -> str:
    if s is None:
        return "waiting for its collective"
    return (LOCAL_STRETCHES if b.path == "local" else STRETCHES)[s]


def table(by_rank: list[dict], before: list[dict] | None = None) -> str:
    """Markdown: per variant the batches, the transient of every rank, measured and planned
    (MiB), and their ratio; `before` (another checkout's ranks) adds its measured figures."""
    head = "| variant | batches | measured MiB per rank | planned MiB | planned / measured |"
    lines = [head, "|---|---|---|---|---|"]
    if before:
        lines[0] = head + " before: batches | before: measured MiB |"
        lines[1] += "---|---|"
    for name, row in by_rank[0].items():
        got = [r[name]["measured"] / MiB for r in by_rank]
        plan = [r[name]["planned"] for r in by_rank]
        cells = [name, ", ".join(row["batches"]), " / ".join(f"{g:.2f}" for g in got)]
        if None in plan:
            cells += ["-", "-"]
        else:
            cells.append(" / ".join(f"{p / MiB:.2f}" for p in plan))
            ratios = [p / MiB / g for p, g in zip(plan, got, strict=True)]
            cells.append(f"{min(ratios):.3f} - {max(ratios):.3f}")
        if before:
            old = [r[name]["measured"] / MiB for r in before]
            cells += [", ".join(before[0][name]["batches"]), " / ".join(f"{g:.2f}" for g in old)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "At the planned peak, rank 0: each batch alive, what it runs, what it holds:", ""]
    lines += ["| variant | batch | running | MiB |", "|---|---|---|---|"]
    for name, row in by_rank[0].items():
        for batch, running, mib in row.get("at_peak", []):
            lines.append(f"| {name} | {batch} | {running} | {mib:.2f} |")
    return "\n".join(lines)
