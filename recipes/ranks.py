"""Where this process stands in the run's world, and this rank's part of a tensor: one helper
each for recipes/ and scripts/ (muon/ and models/ keep their own one-liners: they cannot import
recipes/).

`in_process_group` is whether collectives may be called at all: torch's fake group for
planning counts (its collectives return at once), so a fake world of N ranks plans as N.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def in_process_group() -> bool:
    """A process group is initialized (any backend, fake included): collectives may be called."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if in_process_group() else 0


def world_size() -> int:
    """The ranks of the world (1 without a process group)."""
    return dist.get_world_size() if in_process_group() else 1


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (autograd-aware `to_local`); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def gather_peaks(values: Mapping[str, float], group: Any = None) -> list[dict[str, float]]:
    """Every rank's `values`, in rank order (of `group`; default: the default group).

    A collective: all ranks of the group must call it. Returns the list on every rank (rank 0
    logs it); without an initialized process group returns `[dict(values)]`.
    """
    payload = {k: float(v) for k, v in values.items()}
    if not in_process_group():
        return [payload]
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, payload, group=group)
    return gathered


def rank_metrics(peaks: Sequence[Mapping[str, float]], prefix: str = "memory") -> dict[str, float]:
    """Flatten `gather_peaks` output to `{f"{prefix}/rank_{k}/{key}": value}` for a logger."""
    return {
        f"{prefix}/rank_{rank}/{key}": float(value)
        for rank, values in enumerate(peaks)
        for key, value in values.items()
    }
