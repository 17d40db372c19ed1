"""The row layout exchanged matrices travel in: the sharded dim first, the rest flattened; and
a DTensor's local tensor, which every step reads."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a DTensor (a plain tensor is its own). Outside autograd it is the
    DTensor's own local tensor, which is what `to_local` returns there too, except that for a
    parameter `to_local` returns a fresh view of it (to mark it a parameter): a dispatched op
    per parameter and step, which the optimizer, writing in place, has no use for."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if torch.is_grad_enabled() else t._local_tensor


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
