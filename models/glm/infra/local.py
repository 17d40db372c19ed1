"""This rank's part of a tensor, the one place that asks whether it is a DTensor."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard on this rank; any other tensor is itself."""
    return t.to_local() if isinstance(t, DTensor) else t
