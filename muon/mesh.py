"""Which mesh dim of a parameter's DTensor layout is FSDP (the comm group) and which is EP.

`MeshCommPlan` is resolved once per (device_mesh, placements) group at optimizer construction,
identical on every rank: the FSDP mesh dim and its process group's ranks (and those of every
FSDP group of the mesh, for collective sub-group creation), the EP dim, the tensor dim that is
sharded, and the non-FSDP shard factor that turns a global dim into the FSDP-visible (EP-local)
one. Plain data, no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard


def shard_sizes(dim_size: int, world: int) -> tuple[int, ...]:
    """Sizes of `dim_size` chunked over `world` ranks the way DTensor / torch.chunk does it."""
    chunk = math.ceil(dim_size / world) if dim_size else 0
    return tuple(max(0, min(chunk, dim_size - r * chunk)) for r in range(world))


def _shard_dim(p: Placement) -> int | None:
    if isinstance(p, Shard | _StridedShard):
        return p.dim
    if isinstance(p, Replicate):
        return None
    raise NotImplementedError(f"Muon: unsupported placement {p!r} (Partial gradients?)")


@dataclass(frozen=True)
class MeshCommPlan:
    """Sharding topology of one (device_mesh, placements) group."""

    sharded: bool
    fsdp_mesh_dim: int | None = None
    ep_mesh_dim: int | None = None
    shard_tensor_dim: int = 0
    fsdp_size: int = 1
    fsdp_rank: int = 0
    non_fsdp_shard_factor: int = 1
    #: global ranks of this rank's FSDP group, in FSDP-rank order
    group_ranks: tuple[int, ...] = ()
    #: every FSDP group of the mesh (for collective sub-group creation), same order on all ranks
    all_groups: tuple[tuple[int, ...], ...] = ()


LOCAL_MESH_PLAN = MeshCommPlan(sharded=False)


def resolve_mesh_comm_plan(
    mesh_shape: tuple[int, ...],
    mesh_ranks: list,
    placements: tuple[Placement, ...],
    coordinate: tuple[int, ...],
) -> MeshCommPlan:
    """Find the FSDP mesh dim (the comm group) and the EP dim of a DTensor's placements.

    `mesh_ranks` is the mesh's rank grid as nested lists (`mesh.mesh.tolist()`), `coordinate`
    this rank's coordinate in it. Size-1 mesh dims count as replicated. One active shard dim is
    the comm group; two must be exactly FSDP + EP on tensor dim 0. The FSDP dim is the one whose
    ranks together hold one contiguous EP-local slab: the one FSDP2 marks `_StridedShard` (its
    split applies after the EP split), and with two plain `Shard(0)`s the inner (later) mesh dim,
    since DTensor splits along the mesh dims in order. EP is the other, by elimination.
    """
    active = [
        (d, _shard_dim(p))
        for d, p in enumerate(placements)
        if mesh_shape[d] > 1 and _shard_dim(p) is not None
    ]
    if not active:
        return LOCAL_MESH_PLAN
    if len(active) == 1:
        fsdp_dim, tensor_dim = active[0]
        ep_dim, factor = None, 1
    elif len(active) == 2 and active[0][1] == active[1][1] == 0:
        strided = [d for d, _ in active if isinstance(placements[d], _StridedShard)]
        if len(strided) > 1:
            raise NotImplementedError(
                f"Muon: placements {placements} stride both sharded mesh dims; expected FSDP2's "
                "(_StridedShard(0), Shard(0)) or a plain (Shard(0), Shard(0)) expert layout"
            )
        # with plain Shard(0)s the outer mesh dim cuts the contiguous EP slabs and the inner one
        # splits each slab: the inner one is FSDP
        fsdp_dim = strided[0] if strided else active[-1][0]
        (ep_dim,) = (d for d, _ in active if d != fsdp_dim)
        tensor_dim, factor = 0, mesh_shape[ep_dim]
    else:
        raise NotImplementedError(
            f"Muon supports one sharded mesh dim (FSDP) or exactly FSDP + EP on tensor dim 0; "
            f"got placements {placements} on mesh shape {mesh_shape}"
        )
    groups = _mesh_groups(mesh_ranks, len(mesh_shape), fsdp_dim)
    mine = next(g for g in groups if _rank_at(mesh_ranks, coordinate) in g)
    return MeshCommPlan(
        sharded=True,
        fsdp_mesh_dim=fsdp_dim,
        ep_mesh_dim=ep_dim,
        shard_tensor_dim=tensor_dim,
        fsdp_size=mesh_shape[fsdp_dim],
        fsdp_rank=coordinate[fsdp_dim],
        non_fsdp_shard_factor=factor,
        group_ranks=mine,
        all_groups=groups,
    )


def _rank_at(grid, coordinate) -> int:
    for c in coordinate:
        grid = grid[c]
    return int(grid)


def _mesh_groups(grid, ndim: int, dim: int) -> tuple[tuple[int, ...], ...]:
    """All 1-D slices of the rank grid along `dim`, in a fixed order."""
    t = torch.tensor(grid)
    t = t.movedim(dim, -1).reshape(-1, t.shape[dim])
    return tuple(tuple(int(r) for r in row) for row in t.tolist())
