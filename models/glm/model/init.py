"""Per-shard random initialization whose values do not depend on the device mesh.

A parameter of global shape [R, ...] is cut into fixed global row chunks of
`rows_per_chunk(shape)` rows (about `CHUNK_ELEMENTS` values each; the last chunk may be
shorter). Chunk c is drawn from a generator seeded with a hash of (seed, parameter name, c),
so every chunk has the same values whoever draws it. A rank whose shard covers global rows
[a, b) draws only the chunks that overlap [a, b) and copies the overlap into its shard:
time and memory proportional to the shard (plus at most two partly used chunks per
parameter), never to the full tensor.

The generator lives on the parameter's device: on CUDA the values come from Philox on the
device, on CPU from mt19937, so a CUDA run and a CPU run draw different (equally
distributed) numbers; within one device type the values are the same for every mesh.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from models.glm.infra.local import local_tensor

# 16 Ki values (64 KiB in float32) per chunk: small enough that the two partial chunks at a
# shard's edges stay a small fraction of a shard even for the `small` preset at 8 ranks,
# large enough that the per-chunk generator seeding (a few microseconds) is negligible.
CHUNK_ELEMENTS = 1 << 14


def rows_per_chunk(shape: torch.Size | tuple[int, ...]) -> int:
    """Rows of one init chunk of a tensor of global `shape` (a function of the shape only)."""
    row = 1
    for n in shape[1:]:
        row *= n
    # A power of two, so chunk edges fall on the shard edges of power-of-two row counts.
    return 1 << max(0, (CHUNK_ELEMENTS // max(1, row)).bit_length() - 1)


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The generator seed of chunk `chunk` of parameter `name` (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """(first global row, row count) of the part of `p` this rank holds; a plain tensor holds
    all its rows. DTensors must be sharded on dim 0 only (FSDP2's `Shard(0)` and its strided
    expert layout `(_StridedShard(0), Shard(0))` are), which keeps the local rows contiguous."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return 0, p.shape[0] if p.ndim else 1
    for placement in p.placements:
        if placement.is_shard() and getattr(placement, "dim", 0) != 0:
            raise NotImplementedError(
                f"per-shard init needs row (dim 0) sharding, got placements {p.placements}"
            )
    return _shard_rows(tuple(p.shape), p.device_mesh, tuple(p.placements))


@functools.lru_cache(maxsize=256)
def _shard_rows(shape: tuple[int, ...], mesh, placements: tuple) -> tuple[int, int]:
    # Cached: the layers of a model repeat a few (shape, placements), and DTensor's strided
    # offset computation costs more than drawing a small shard.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return (offset[0], local_shape[0]) if local_shape[0] else (0, 0)


@torch.no_grad()
def normal_(
    p: torch.Tensor, *, std: float, seed: int, name: str, generator: torch.Generator
) -> int:
    """Fill this rank's shard of `p` (plain tensor or DTensor) with N(0, std) values drawn by
    global row chunks; `generator` must be on p's device and is reseeded per chunk. Returns
    the number of random values drawn."""
    local = local_tensor(p)
    first, count = local_rows(p)
    if count == 0 or local.numel() == 0:
        return 0
    rows = p.shape[0] if p.ndim else 1
    local_2d = local.view(count, -1)
    per_row = local_2d.shape[1]
    step = rows_per_chunk(p.shape)
    drawn = 0
    for chunk in range(first // step, (first + count - 1) // step + 1):
        lo, hi = chunk * step, min(rows, (chunk + 1) * step)
        generator.manual_seed(chunk_seed(seed, name, chunk))
        values = torch.empty(hi - lo, per_row, dtype=torch.float32, device=local.device)
        values.normal_(0.0, std, generator=generator)
        drawn += values.numel()
        a, b = max(lo, first), min(hi, first + count)
        local_2d[a - first : b - first].copy_(values[a - lo : b - lo])
    return drawn
