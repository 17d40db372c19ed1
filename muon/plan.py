"""How each Muon matrix is orthogonalized across ranks: plain data, no collectives.

Two levels, resolved once at optimizer construction and identical on every rank:

- `MeshCommPlan`, per (device_mesh, placements) group: which mesh dim is FSDP (its process group
  is the comm group), which is EP, and the non-FSDP shard factor that turns a global dim into the
  FSDP-visible (EP-local) one.
- `BatchPlan`, per shape-homogeneous batch of parameters: its path, its FSDP-visible dim size,
  the per-rank shard sizes (DTensor's ceil chunking: trailing ranks may be short or empty) and,
  for exchanges, which FSDP rank assembles (owns) each matrix.

Paths:
  local       whole matrices or whole expert blocks already on the rank: no communication
  subgroup    each expert block spans k consecutive FSDP ranks: all-gather within k-rank groups
  full        W matrices on a W-rank group: all-to-all, one matrix assembled per rank
  agrs | pad_all2all | ragged_all_to_all   the remainder batch of R < W matrices

Because plans are plain data, they can be printed, fingerprinted across ranks and built for 512
fake ranks by the dry-run planner with the optimizer's own code.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

REMAINDER_STRATEGIES: tuple[str, ...] = ("agrs", "pad_all2all", "ragged_all_to_all")
PATHS: tuple[str, ...] = ("local", "subgroup", "full", *REMAINDER_STRATEGIES)


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
    import torch

    t = torch.tensor(grid)
    t = t.movedim(dim, -1).reshape(-1, t.shape[dim])
    return tuple(tuple(int(r) for r in row) for row in t.tolist())


@dataclass
class OwnerCursor:
    """Rotating choice of the FSDP rank that assembles each exchanged matrix.

    One cursor per comm group, advanced across all batches of a step in plan order: full batches
    give every rank one matrix, and consecutive remainder batches continue where the previous one
    stopped, so over the whole step the matrix counts per rank differ by at most one instead of
    ranks 0..R-1 doing every remainder.
    """

    world: int
    next_rank: int = 0

    def take(self, n: int) -> tuple[int, ...]:
        owners = tuple((self.next_rank + i) % self.world for i in range(n))
        self.next_rank = (self.next_rank + n) % self.world
        return owners


@dataclass(frozen=True)
class ParamMeta:
    """What planning needs to know of one Muon parameter."""

    index: int
    global_shape: tuple[int, ...]
    num_blocks: int
    itemsize: int
    #: Newton-Schulz settings of the parameter's group; batches never mix different ones
    ns_settings: tuple = ()
    #: the parameter's dtype name: a batch shares one exchange buffer, so it holds one dtype
    #: (float16 and bfloat16 have the same item size but not the same range)
    dtype: str = ""


@dataclass(frozen=True)
class BatchPlan:
    """One shape-homogeneous batch: how its matrices travel and who orthogonalizes them."""

    path: str
    param_indices: tuple[int, ...]
    global_shape: tuple[int, ...]
    itemsize: int
    shard_tensor_dim: int
    #: FSDP-visible (EP-local) size of the sharded dim = global size // non-FSDP shard factor
    global_shard_dim_size: int
    #: rows of the sharded dim held by each FSDP rank (ceil chunking)
    shard_sizes: tuple[int, ...]
    #: independent blocks in one FSDP-visible matrix (fused experts: the EP-local experts)
    blocks_per_matrix: int
    #: FSDP rank that assembles each matrix (exchange paths); pad_all2all lists the W slots
    owners: tuple[int, ...] = ()
    #: ranks per sub-group (subgroup path)
    subgroup_size: int = 1
    fsdp_size: int = 1
    group_ranks: tuple[int, ...] = field(default=(), compare=False)

    @property
    def size(self) -> int:
        return len(self.param_indices)

    @property
    def other_numel(self) -> int:
        """Elements per unit of the sharded dim (the product of the other dims)."""
        return math.prod(self.global_shape) // self.global_shape[self.shard_tensor_dim]

    @property
    def matrix_bytes(self) -> int:
        """Bytes of one FSDP-visible matrix."""
        return self.global_shard_dim_size * self.other_numel * self.itemsize

    @property
    def padded_shard_rows(self) -> int:
        return max(self.shard_sizes) if self.shard_sizes else 0

    def shard_bytes(self, fsdp_rank: int) -> int:
        return self.shard_sizes[fsdp_rank] * self.other_numel * self.itemsize

    def matrices_on(self, fsdp_rank: int) -> int:
        """Matrices (or blocks, for local / subgroup paths) this rank orthogonalizes."""
        if self.path == "local":
            if self.fsdp_size == 1:
                return self.size * self.blocks_per_matrix
            block_rows = self.global_shard_dim_size // self.blocks_per_matrix
            return self.size * (self.shard_sizes[fsdp_rank] // block_rows)
        if self.path == "subgroup":
            return self.size  # each rank's shard lies inside one block, which it orthogonalizes
        return sum(1 for i, o in enumerate(self.owners) if o == fsdp_rank and i < self.size)

    def bytes_sent(self, fsdp_rank: int) -> int:
        """Bytes this rank sends for the batch, both directions, counted from the plan."""
        w, n = self.fsdp_size, self.size
        mine = self.shard_bytes(fsdp_rank)
        padded = self.padded_shard_rows * self.other_numel * self.itemsize
        if self.path == "local":
            return 0
        if self.path == "subgroup":
            return n * padded * (self.subgroup_size - 1)
        if self.path == "agrs":
            # all-gather my padded shard to W-1 peers; reduce-scatter W-1 padded shards back
            return 2 * n * padded * (w - 1)
        if self.path == "pad_all2all":
            # uniform all-to-all of W (real or zero) padded shards, and the same back
            return 2 * padded * (w - 1)
        # full and ragged: my shard of each matrix I do not own; each owned matrix's other shards
        owned = [i for i, o in enumerate(self.owners) if o == fsdp_rank]
        forward = mine * (n - len(owned))
        back = sum(self.matrix_bytes - mine for _ in owned)
        return forward + back

    def collective_buffer_bytes(self, fsdp_rank: int) -> int:
        """Bytes of the largest receive buffer one collective of this batch allocates here.

        For `agrs` this is the all-gather output: all n matrices, sized from the FSDP-visible dim.
        """
        w, n = self.fsdp_size, self.size
        padded = self.padded_shard_rows * self.other_numel * self.itemsize
        if self.path == "local":
            return 0
        if self.path == "subgroup":
            return self.subgroup_size * n * padded
        if self.path == "agrs":
            return w * n * padded
        if self.path == "pad_all2all":
            return w * padded
        owns = any(o == fsdp_rank for o in self.owners)
        return max(self.matrix_bytes if owns else 0, n * self.shard_bytes(fsdp_rank))

    def exchange_buffer_bytes(self, fsdp_rank: int) -> int:
        """Peak bytes of exchange buffers alive at once on this rank, phase by phase, as
        `muon.comm` allocates and frees them (send, receive, assembled, result, return).

        The NS inputs are produced straight into the send buffer, so they are included;
        Newton-Schulz temporaries are not (see `ns_workspace_bytes`).
        """
        w, n = self.fsdp_size, self.size
        padded = self.padded_shard_rows * self.other_numel * self.itemsize
        mine = self.shard_bytes(fsdp_rank)
        full = self.matrix_bytes
        owned = sum(1 for i, o in enumerate(self.owners) if o == fsdp_rank and i < n)
        if self.path == "local":
            return 0
        if self.path == "subgroup":
            # send + gathered + one block's NS output (its rows go back into send)
            return (self.subgroup_size + 1) * n * padded + self.subgroup_size * padded
        if self.path == "agrs":
            # send (later the reduce-scatter output) + gathered (later its input) + owned results
            return n * padded + w * n * padded + owned * full
        if self.path == "pad_all2all":
            # send (later the return) + received slab + the NS output copied back into it
            return 2 * w * padded + full
        # send (later the return) + assembled matrix + its NS output (owners only)
        return n * mine + 2 * (full if owned else 0)

    def ns_workspace_bytes(self, fsdp_rank: int, ns_itemsize: int) -> int:
        """Rough peak Newton-Schulz temporaries for the matrices this rank orthogonalizes."""
        # under pad_all2all every rank orthogonalizes its slot, real or zero
        count = 1 if self.path == "pad_all2all" else self.matrices_on(fsdp_rank)
        if not count:
            return 0
        rows = self.global_shard_dim_size // self.blocks_per_matrix
        cols = self.other_numel
        small = min(rows, cols)
        # the normalized X and the next X, plus the two square Gram products
        per_block = 2 * rows * cols * ns_itemsize + 2 * small * small * ns_itemsize
        # one NS call at a time: a parameter's local blocks, one sub-group block, or one matrix
        if self.path == "local":
            # one parameter's local blocks at a time, plus its NS output until applied
            local_rows = self.shard_sizes[fsdp_rank if self.fsdp_size > 1 else 0]
            return count // self.size * per_block + local_rows * cols * self.itemsize
        if self.path == "subgroup":
            return per_block
        return self.blocks_per_matrix * per_block


def plan_batches(
    params: list[ParamMeta],
    mesh_plan: MeshCommPlan,
    remainder_strategy: str,
    enable_all2all: bool,
    expert_aware: bool,
    cursor: OwnerCursor | None,
) -> list[BatchPlan]:
    """Bucket parameters by (shape, blocks, dtype, NS settings) in first-seen order and cut into
    batches.

    Every batch computes its own FSDP-visible size and shard sizes; nothing is carried over from
    a batch of another shape.
    """
    buckets: dict[tuple, list[ParamMeta]] = {}
    for p in params:
        key = (p.global_shape, p.num_blocks, p.itemsize, p.dtype, p.ns_settings)
        buckets.setdefault(key, []).append(p)
    plans: list[BatchPlan] = []
    for (shape, num_blocks, itemsize, _, _), members in buckets.items():
        plans.extend(
            _plan_bucket(
                members,
                shape,
                num_blocks,
                itemsize,
                mesh_plan,
                remainder_strategy,
                enable_all2all,
                expert_aware,
                cursor,
            )
        )
    return plans


def _plan_bucket(
    members, shape, num_blocks, itemsize, mp: MeshCommPlan, strategy, a2a, expert_aware, cursor
) -> list[BatchPlan]:
    indices = tuple(p.index for p in members)
    d = mp.shard_tensor_dim
    if not mp.sharded:
        return [BatchPlan("local", indices, shape, itemsize, 0, shape[0], (shape[0],), num_blocks)]
    full_dim = shape[d]
    if full_dim % mp.non_fsdp_shard_factor or num_blocks % mp.non_fsdp_shard_factor:
        raise ValueError(
            f"Muon: shape {shape} with {num_blocks} blocks is sharded "
            f"{mp.non_fsdp_shard_factor}-way "
            "outside FSDP (EP); that factor must divide both the sharded dim and the block count"
        )
    visible = full_dim // mp.non_fsdp_shard_factor
    sizes = shard_sizes(visible, mp.fsdp_size)
    blocks = num_blocks // mp.non_fsdp_shard_factor
    common = dict(
        global_shape=shape,
        itemsize=itemsize,
        shard_tensor_dim=d,
        global_shard_dim_size=visible,
        shard_sizes=sizes,
        blocks_per_matrix=blocks,
        fsdp_size=mp.fsdp_size,
        group_ranks=mp.group_ranks,
    )
    if expert_aware and blocks > 1 and d == 0:
        block_rows = visible // blocks
        chunk = sizes[0]
        if chunk % block_rows == 0:
            return [BatchPlan("local", indices, **common)]
        k = block_rows // chunk if block_rows % chunk == 0 else 0
        if k > 1 and chunk * mp.fsdp_size == visible and mp.fsdp_size % k == 0:
            w = mp.fsdp_size
            return [
                BatchPlan("subgroup", indices[i : i + w], subgroup_size=k, **common)
                for i in range(0, len(indices), w)
            ]
    w = mp.fsdp_size
    cursor = cursor or OwnerCursor(w)
    out = []
    for i in range(0, len(indices), w):
        batch = indices[i : i + w]
        if not a2a:
            path = "agrs"
        elif len(batch) == w:
            path = "full"
        else:
            path = strategy
        owners = cursor.take(w if path == "pad_all2all" else len(batch))
        out.append(BatchPlan(path, batch, owners=owners, **common))
    return out


def fingerprint(plans: list[tuple[MeshCommPlan, list[BatchPlan]]], names: list[str]) -> int:
    """A 63-bit hash of the rank-independent parts of a plan, for the cross-rank check.

    `names` are the Muon parameters' names (or shapes) in optimizer order, so two ranks that hold
    same-shaped parameters in a different order disagree too.
    """
    h = hashlib.sha256(repr(names).encode())
    for mp, batches in plans:
        h.update(repr((mp.sharded, mp.fsdp_size, mp.non_fsdp_shard_factor)).encode())
        for b in batches:
            h.update(repr((b.path, b.param_indices, b.global_shape, b.itemsize, b.owners)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1
