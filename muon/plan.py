"""How each Muon matrix is orthogonalized across ranks: plain data, no collectives.

Resolved once at optimizer construction, identical on every rank:

- `MeshCommPlan`, per (device_mesh, placements) group: which mesh dim is FSDP (its process group
  is the comm group), which is EP, and the non-FSDP shard factor that turns a global dim into the
  FSDP-visible (EP-local) one.
- `BatchPlan`, per batch of same-shape, same-dtype parameters: its path, its FSDP-visible rows,
  the per-rank shard sizes (DTensor's ceil chunking: trailing ranks may be short or empty) and,
  for exchanges, which FSDP rank assembles (owns) each unit. Owners are filled in afterwards by
  `muon.owners.assign_owners`, which balances Newton-Schulz cost over the whole step.

Paths (each one object in `muon.comm`, owning its exchange and its cost):
  local       whole matrices or whole expert blocks already on the rank: no communication
  subgroup    each expert block spans k consecutive FSDP ranks: the k ranks exchange so that
              every block is assembled on exactly one of them, orthogonalized once, returned
  full        W matrices on a W-rank group: all-to-all, one matrix assembled per rank
  agrs | pad_all2all | ragged_all_to_all   a remainder batch of R < W matrices
  (`remainder_strategy="auto"` picks one of the three per remainder batch, see `choose_remainder`)

Because plans are plain data, they can be printed, fingerprinted across ranks and built for 1024
fake ranks by the dry-run planner with the optimizer's own code.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard, _StridedShard

from muon.cost import DEFAULT_LINKS, LinkModel, block_flops

REMAINDER_STRATEGIES: tuple[str, ...] = ("agrs", "pad_all2all", "ragged_all_to_all")
#: what `remainder_strategy` accepts: a strategy, or "auto" (the cheapest per batch)
REMAINDER_CHOICES: tuple[str, ...] = (*REMAINDER_STRATEGIES, "auto")
PATHS: tuple[str, ...] = ("local", "subgroup", "full", *REMAINDER_STRATEGIES)
#: default bound on one batch's exchange buffers on one rank (sub-group batches are sized by it)
BATCH_BYTES = 256 << 20


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


@dataclass(frozen=True)
class ParamMeta:
    """What planning needs to know of one Muon parameter."""

    index: int
    global_shape: tuple[int, ...]
    num_blocks: int
    #: parameter dtype name ("float32", "bfloat16", ...): batches never mix dtypes
    dtype: str
    itemsize: int
    #: dtype on the wire: the Newton-Schulz dtype when it is narrower, since Newton-Schulz
    #: casts its input first and its output is exact in the wider dtype
    wire_dtype: str
    ns_steps: int = 5
    #: Newton-Schulz settings of the parameter's group; batches never mix different ones
    ns_settings: tuple = ()


@dataclass(frozen=True)
class BatchPlan:
    """One batch of same-shape, same-dtype parameters: how they travel, who orthogonalizes.

    A *unit* is what one owner assembles and orthogonalizes in one go: a whole FSDP-visible
    matrix (`num_blocks` blocks) on the exchange paths, one expert block on the sub-group path.
    `owners` lists the FSDP rank of every unit: matrix j on exchange paths; on the sub-group path
    unit `g * size + j` is parameter j's block held by sub-group g (FSDP ranks g*k .. g*k+k-1).
    """

    path: str
    param_indices: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    wire_dtype: str
    shard_tensor_dim: int
    #: FSDP-visible (EP-local) size of the sharded dim = global size // non-FSDP shard factor
    fsdp_visible_rows: int
    #: rows of the sharded dim held by each FSDP rank (ceil chunking)
    shard_sizes: tuple[int, ...]
    #: independent blocks in one FSDP-visible matrix (fused experts: the EP-local experts)
    num_blocks: int
    ns_steps: int = 5
    owners: tuple[int, ...] = ()
    #: ranks per sub-group (sub-group path)
    subgroup_size: int = 1
    fsdp_size: int = 1
    group_ranks: tuple[int, ...] = field(default=(), compare=False)

    @property
    def size(self) -> int:
        return len(self.param_indices)

    @property
    def wire_itemsize(self) -> int:
        return getattr(torch, self.wire_dtype).itemsize

    @property
    def other_numel(self) -> int:
        """Elements per unit of the sharded dim (the product of the other dims)."""
        return math.prod(self.global_shape) // self.global_shape[self.shard_tensor_dim]

    @property
    def block_rows(self) -> int:
        """Rows of one block: blocks are runs of the parameter's dim 0 (a matrix sharded on
        another dim is orthogonalized in its own `[dim 0, rest]` layout)."""
        rows = self.fsdp_visible_rows if self.shard_tensor_dim == 0 else self.global_shape[0]
        return rows // self.num_blocks

    @property
    def block_cols(self) -> int:
        return self.fsdp_visible_rows * self.other_numel // (self.block_rows * self.num_blocks)

    @property
    def blocks_per_unit(self) -> int:
        return 1 if self.path == "subgroup" else self.num_blocks

    @property
    def units(self) -> int:
        if self.path == "subgroup":
            return self.size * (self.fsdp_size // self.subgroup_size)
        return 0 if self.path == "local" else self.size

    @property
    def matrix_bytes(self) -> int:
        """Wire bytes of one FSDP-visible matrix."""
        return self.fsdp_visible_rows * self.other_numel * self.wire_itemsize

    @property
    def padded_shard_rows(self) -> int:
        return max(self.shard_sizes) if self.shard_sizes else 0

    def shard_bytes(self, fsdp_rank: int) -> int:
        """Wire bytes of one parameter's shard on `fsdp_rank`."""
        return self.shard_sizes[fsdp_rank] * self.other_numel * self.wire_itemsize

    def block_flops(self) -> int:
        """Newton-Schulz FLOPs of one `[block_rows, block_cols]` block (`muon.cost`)."""
        return block_flops(self.block_rows, self.block_cols, steps=self.ns_steps)

    # the path object in `muon.comm` owns every cost; these forward to it
    @property
    def exchange(self):
        from muon.comm import PATHS as _PATHS

        return _PATHS[self.path]

    def matrices_on(self, fsdp_rank: int) -> int:
        """Blocks this rank orthogonalizes for the batch."""
        return self.exchange.blocks_on(self, fsdp_rank)

    def ns_flops_on(self, fsdp_rank: int) -> int:
        return self.matrices_on(fsdp_rank) * self.block_flops()

    def bytes_sent(self, fsdp_rank: int) -> int:
        """Bytes this rank sends for the batch, both directions, counted from the plan."""
        return self.exchange.bytes_sent(self, fsdp_rank)

    def collective_buffer_bytes(self, fsdp_rank: int) -> int:
        """Bytes of the largest receive buffer one collective of this batch allocates here."""
        return self.exchange.collective_buffer_bytes(self, fsdp_rank)

    def exchange_buffer_bytes(self, fsdp_rank: int) -> int:
        """Peak bytes of exchange buffers alive at once on this rank (NS inputs included)."""
        return self.exchange.exchange_buffer_bytes(self, fsdp_rank)

    def ns_workspace_bytes(self, fsdp_rank: int, ns_itemsize: int) -> int:
        """Rough peak Newton-Schulz temporaries for what this rank orthogonalizes at once."""
        return self.exchange.ns_workspace_bytes(self, fsdp_rank, ns_itemsize)

    def peak_bytes(self, fsdp_rank: int, ns_itemsize: int) -> int:
        return self.exchange_buffer_bytes(fsdp_rank) + self.ns_workspace_bytes(
            fsdp_rank, ns_itemsize
        )

    def modelled_s(self, link: LinkModel) -> float:
        """Modelled time of the batch's collectives, from the busiest rank's bytes."""
        ex = self.exchange
        per_collective = max(ex.bytes_sent(self, r) for r in range(self.fsdp_size)) / 2
        return ex.collectives * link.collective_s(int(per_collective))


def plan_batches(
    params: list[ParamMeta],
    *,
    mesh_plan: MeshCommPlan,
    remainder_strategy: str,
    enable_all2all: bool,
    expert_aware: bool,
    batch_bytes: int = BATCH_BYTES,
    link: LinkModel | None = None,
    memory_budget: int | None = None,
) -> list[BatchPlan]:
    """Bucket parameters by (shape, blocks, dtype, NS settings) in first-seen order and cut each
    bucket into batches. Owners are left empty: `muon.owners.assign_owners` fills them.

    Every batch computes its own FSDP-visible size and shard sizes; nothing is carried over from
    a batch of another shape.
    """
    buckets: dict[tuple, list[ParamMeta]] = {}
    for p in params:
        buckets.setdefault((p.global_shape, p.num_blocks, p.dtype, p.ns_settings), []).append(p)
    out: list[BatchPlan] = []
    for members in buckets.values():
        common = _bucket_fields(members, mesh_plan)
        out += _cut_bucket(
            tuple(p.index for p in members),
            common,
            mp=mesh_plan,
            strategy=remainder_strategy,
            a2a=enable_all2all,
            expert_aware=expert_aware,
            batch_bytes=batch_bytes,
            link=link,
            memory_budget=memory_budget,
        )
    return out


def _bucket_fields(members: list[ParamMeta], mp: MeshCommPlan) -> dict:
    p = members[0]
    shape, num_blocks = p.global_shape, p.num_blocks
    d = mp.shard_tensor_dim if mp.sharded else 0
    if shape[d] % mp.non_fsdp_shard_factor or num_blocks % mp.non_fsdp_shard_factor:
        raise ValueError(
            f"Muon: shape {shape} with {num_blocks} blocks is sharded "
            f"{mp.non_fsdp_shard_factor}-way outside FSDP (EP); that factor must divide both "
            "the sharded dim and the block count"
        )
    visible = shape[d] // mp.non_fsdp_shard_factor
    return dict(
        global_shape=shape,
        dtype=p.dtype,
        itemsize=p.itemsize,
        wire_dtype=p.wire_dtype,
        shard_tensor_dim=d,
        fsdp_visible_rows=visible,
        shard_sizes=shard_sizes(visible, mp.fsdp_size) if mp.sharded else (visible,),
        num_blocks=num_blocks // mp.non_fsdp_shard_factor,
        ns_steps=p.ns_steps,
        fsdp_size=mp.fsdp_size,
        group_ranks=mp.group_ranks,
    )


def _cut_bucket(
    indices, common, *, mp, strategy, a2a, expert_aware, batch_bytes, link, memory_budget
) -> list[BatchPlan]:
    if not mp.sharded:
        return [BatchPlan("local", indices, **common)]
    w, sizes, d = mp.fsdp_size, common["shard_sizes"], common["shard_tensor_dim"]
    blocks, visible = common["num_blocks"], common["fsdp_visible_rows"]
    if expert_aware and blocks > 1 and d == 0:
        block_rows, chunk = visible // blocks, sizes[0]
        if chunk % block_rows == 0:
            return [BatchPlan("local", indices, **common)]
        k = block_rows // chunk if block_rows % chunk == 0 else 0
        if k > 1 and chunk * w == visible and w % k == 0:
            # memory bound: a rank may assemble every block of its sub-group's batch
            other = math.prod(common["global_shape"]) // common["global_shape"][0]
            block = block_rows * other * getattr(torch, common["wire_dtype"]).itemsize
            n = max(1, batch_bytes // (3 * block + block // k))
            return [
                BatchPlan("subgroup", indices[i : i + n], subgroup_size=k, **common)
                for i in range(0, len(indices), n)
            ]
    out = []
    for i in range(0, len(indices), w):
        batch = indices[i : i + w]
        if not a2a:
            path = "agrs"
        elif len(batch) == w:
            path = "full"
        elif strategy == "auto":
            path = choose_remainder(
                BatchPlan("ragged_all_to_all", batch, owners=tuple(range(len(batch))), **common),
                link=link,
                memory_budget=memory_budget,
            )
        else:
            path = strategy
        out.append(BatchPlan(path, batch, **common))
    return out


def choose_remainder(batch: BatchPlan, *, link: LinkModel | None, memory_budget: int | None) -> str:
    """`remainder_strategy="auto"`: the remainder strategy with the lowest modelled time whose
    planned per-rank peak fits `memory_budget` (else the one with the smallest peak).

    Newton-Schulz work is the same for the three (padding runs none), so the model compares the
    collectives: latency per collective + the busiest rank's bytes / bandwidth. Owners are a
    placeholder here (ranks 0..R-1); which ranks own changes neither figure.
    """
    link = link or DEFAULT_LINKS["gloo"]
    ns_itemsize = batch.wire_itemsize
    scored = []
    for s in REMAINDER_STRATEGIES:
        cand = replace(batch, path=s)
        peak = max(cand.peak_bytes(r, ns_itemsize) for r in range(cand.fsdp_size))
        fits = memory_budget is None or peak <= memory_budget
        scored.append((not fits, cand.modelled_s(link) if fits else peak, s))
    return min(scored)[2]


def fingerprint(
    plans: list[tuple[MeshCommPlan, list[BatchPlan]]], names: list[str], assignment: int
) -> int:
    """A 63-bit hash of the rank-independent parts of a plan, for the cross-rank check.

    `names` are the Muon parameters' names (or shapes) in optimizer order, so two ranks that hold
    same-shaped parameters in a different order disagree too; `assignment` is the owner
    assignment's own digest (`muon.owners`), computed for every rank on every rank.
    """
    h = hashlib.sha256(repr((names, assignment)).encode())
    for mp, batches in plans:
        h.update(repr((mp.sharded, mp.fsdp_size, mp.non_fsdp_shard_factor)).encode())
        for b in batches:
            h.update(repr((b.path, b.param_indices, b.global_shape, b.dtype)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1
