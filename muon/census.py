"""The gradient census of a step: finite everywhere, and which parameters have none anywhere.

A step is skipped on every rank when any gradient on any rank holds a NaN or Inf; a parameter
whose `.grad` is None on every rank is left untouched; ranks that disagree about a parameter's
grad raise on every rank, before anything is written. Both checks share one all-reduce, and
the census reads the device once: the non-finite flag is found on the device
(`torch._amp_foreach_non_finite_check_and_unscale_` with a scale of 1, one kernel per dtype),
the has-grad flags are a device tensor made once per pattern of present grads, and the
all-reduced flags come back to the host in one read. The optimizer's Gram blow-up counts of
the previous step (`muon.blowups`) travel in the same all-reduce and read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muon.layout import local
from muon.wire import collectives_move_data, comm_device


class GradCensus:
    """Counts one step's gradients (`__call__`); keeps the device tensors it reuses."""

    def __init__(self) -> None:
        #: (device, has-grad pattern) -> the pattern as an int32 device tensor
        self._patterns: dict[tuple, torch.Tensor] = {}
        #: device -> the scale of 1.0 the non-finite check multiplies by
        self._ones: dict[torch.device, torch.Tensor] = {}

    def nonfinite(self, grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """A float32 `[1]` tensor on `device`: 1.0 when some gradient holds a NaN or Inf."""
        found = torch.zeros(1, dtype=torch.float32, device=device)
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in grads:
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (dev, _), members in groups.items():
            one = self._ones.setdefault(dev, torch.ones(1, dtype=torch.float32, device=dev))
            flag = found if dev == device else torch.zeros_like(one)
            # multiplies by exactly 1.0 and sets `flag` where a value is not finite
            torch._amp_foreach_non_finite_check_and_unscale_(members, flag, one)
            if flag is not found:
                found = found.maximum(flag.to(device))
        return found

    def __call__(
        self, param_groups: list[dict], extra: torch.Tensor | None = None
    ) -> tuple[bool, set[int], list[int]]:
        """(all gradients finite on every rank, ids of parameters without a grad on any rank,
        `extra` summed over ranks).

        One all-reduce (SUM) of [non-finite flag, has-grad flag per parameter, `extra`] as
        int32: a count of 0 or W per parameter is agreement, anything between is an error on
        every rank. `extra`, int32 counts on the device (the same length on every rank), rides
        along so that it costs no read of its own; [] without it.
        """
        params = [p for g in param_groups for p in g["params"]]
        grads = [local(p.grad) for p in params if p.grad is not None]
        if not collectives_move_data():
            device = grads[0].device if grads else torch.device("cpu")
            found = self.nonfinite(grads, device)
            gradless = {id(p) for p in params if p.grad is None}
            if extra is None:
                return not bool(found), gradless, []  # the one host read
            counts = torch.cat([found.to(torch.int32), extra.to(device)]).tolist()  # the read
            return not counts[0], gradless, counts[1:]
        device, world = comm_device(), dist.get_world_size()
        pattern = tuple(p.grad is not None for p in params)
        has = self._patterns.get((device, pattern))
        if has is None:  # a new pattern of present grads: one copy, then reused
            has = torch.tensor(pattern, dtype=torch.int32, device=device)
            self._patterns[(device, pattern)] = has
        parts = [self.nonfinite(grads, device).to(torch.int32), has]
        if extra is not None:
            parts.append(extra.to(device))
        flags = torch.cat(parts)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM)
        counts = flags.tolist()  # the one host read
        present = counts[1 : 1 + len(params)]
        split = [i for i, c in enumerate(present) if 0 < c < world]
        if split:
            raise RuntimeError(_disagreement(param_groups, split[0], present[split[0]], world))
        gradless = {id(p) for p, c in zip(params, present, strict=True) if not c}
        return not counts[0], gradless, counts[1 + len(params) :]


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
