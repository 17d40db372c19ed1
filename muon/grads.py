"""The gradient census of a step: finite everywhere, and which parameters have none anywhere.

A step is skipped on every rank when any gradient on any rank holds a NaN or Inf; a parameter
whose `.grad` is None on every rank is left untouched; ranks that disagree about a parameter's
grad raise on every rank, before anything is written. Both checks share one all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon.planner import comm_device


def grad_census(param_groups: list[dict]) -> tuple[bool, set[int]]:
    """(all gradients finite on every rank, ids of parameters without a grad on any rank).

    One all-reduce (SUM) of [non-finite flag, has-grad flag per parameter] as int32: a count
    of 0 or W per parameter is agreement, anything between is an error on every rank.
    """
    params = [p for g in param_groups for p in g["params"]]
    finite = [torch.isfinite(_local(p.grad)).all() for p in params if p.grad is not None]
    ok = torch.stack(finite).all() if finite else torch.tensor(True)
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
    flags = torch.cat([(~ok).to(torch.int32).reshape(1).cpu(), has])
    world = 1
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        world = dist.get_world_size()
        flags = flags.to(comm_device())
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        flags = flags.cpu()
    counts = flags[1:].tolist()
    split = [i for i, c in enumerate(counts) if 0 < c < world]
    if split:
        raise RuntimeError(_disagreement(param_groups, split[0], counts[split[0]], world))
    return not bool(flags[0]), {id(p) for p, c in zip(params, counts, strict=True) if not c}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _disagreement(param_groups: list[dict], index: int, count: int, world: int) -> str:
    for gi, g in enumerate(param_groups):
        if index < len(g["params"]):
            p = g["params"][index]
            names = g.get("param_names")
            name = f"{names[index]!r}, " if names else ""
            return (
                f"Muon: ranks disagree on whether a parameter has a gradient: {name}group "
                f"{gi} param {index}, shape {tuple(p.shape)}, has a .grad on {count} of "
                f"{world} ranks; this "
                f"rank {dist.get_rank()} has {'one' if p.grad is not None else 'none'}. A "
                "grad must be None on every rank or on none (zero it instead of dropping it)."
            )
        index -= len(g["params"])
    raise AssertionError("unreachable")
