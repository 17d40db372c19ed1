"""Per-shard initialization of a parallelized model: each rank fills only its own rows.

`init_weights(model, seed)` runs the model's deterministic init (`GLMForCausalLM.init_weights`,
chunks of `models.glm.model.init`) with `shard_rows`: a DTensor parameter is filled in the global
rows its local shard covers, drawing only the chunks that overlap them, so the values equal a
single-process init whatever the mesh, and a rank's cost is its shard.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.tensor import DTensor

from models.glm.model import init
from models.glm.model.model import GLMForCausalLM


def shard_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(local shard, first global row, row count) of the part of `p` this rank holds (an
    `init.Rows`); a plain tensor holds all its rows. DTensors must be sharded on dim 0 only
    (FSDP2's `Shard(0)` and its strided expert layout `(_StridedShard(0), Shard(0))` are),
    which keeps the local rows contiguous."""
    if not isinstance(p, DTensor):
        return init.whole_rows(p)
    for placement in p.placements:
        if placement.is_shard() and getattr(placement, "dim", 0) != 0:
            raise NotImplementedError(
                f"per-shard init needs row (dim 0) sharding, got placements {p.placements}"
            )
    first, count = _shard_rows(tuple(p.shape), p.device_mesh, tuple(p.placements))
    return p.to_local(), first, count


@functools.lru_cache(maxsize=256)
def _shard_rows(shape: tuple[int, ...], mesh, placements: tuple) -> tuple[int, int]:
    # Cached: the layers of a model repeat a few (shape, placements), and DTensor's strided
    # offset computation costs more than drawing a small shard.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return (offset[0], local_shape[0]) if local_shape[0] else (0, 0)


def init_weights(model: GLMForCausalLM, seed: int) -> int:
    """Initialize `model` (sharded or not) from `seed`, each rank its own rows; returns the
    number of random values this rank drew."""
    return model.init_weights(seed, rows=shard_rows)
