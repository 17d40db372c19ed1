"""The row layout exchanged matrices travel in: the sharded dim first, the rest flattened; and
a DTensor's local tensor, which every step reads."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a DTensor (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


def to_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """`[..., d, ...]` -> `[d, C]`: the sharded dim first, the rest flattened."""
    if dim != 0:
        t = t.movedim(dim, 0)
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).contiguous()


def from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of `to_rows` for a tensor shaped like `like`."""
    if dim == 0:
        return rows.view(like.shape)
    shape = list(like.shape)
    moved = [shape[dim]] + shape[:dim] + shape[dim + 1 :]
    return rows.view(moved).movedim(0, dim)


def moved_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """`shape` with `dim` moved first: the layout `to_rows` exchanges."""
    return (shape[dim], *shape[:dim], *shape[dim + 1 :])
