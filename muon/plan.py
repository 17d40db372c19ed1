"""How each Muon matrix is orthogonalized across ranks: plain data, no collectives.

Resolved once at optimizer construction, identical on every rank:

- `MeshCommPlan` (`muon/mesh.py`), per (device_mesh, placements) group: which mesh dim is FSDP
  (its process group is the comm group), which is EP, and the non-FSDP shard factor that turns a
  global dim into the FSDP-visible (EP-local) one.
- `BatchPlan`, per batch of same-shape, same-dtype parameters: its path, its FSDP-visible rows,
  the per-rank shard sizes (DTensor's ceil chunking: trailing ranks may be short or empty) and,
  for exchanges, which FSDP rank assembles (owns) each unit. Owners are filled in afterwards by
  `muon.owners.assign_owners`, which balances Newton-Schulz cost over the whole step.

Paths (each one object in `muon.paths` holding its name, its exchange and its cost):
  local       whole matrices or whole expert blocks already on the rank: no communication
  subgroup    each expert block spans k consecutive FSDP ranks: the ranks of a sub-group (the k,
              or m * k when `muon.owners` widens it to balance the step) exchange so that every
              block is assembled on exactly one of them, orthogonalized once, returned
  full        k * W matrices on a W-rank group (k as many as fit the batch budget): all-to-all,
              k matrices assembled per rank and orthogonalized in one call
  agrs | pad_all2all | ragged_all_to_all   a remainder batch of R < W matrices
  (`remainder_strategy="auto"` picks one of the three per remainder batch, see `choose_remainder`)

Because plans are plain data, they can be printed, fingerprinted across ranks and built for 1024
fake ranks by the dry-run planner with the optimizer's own code. Planning asks the path objects
what a batch would cost (`choose_remainder`) and never runs an exchange.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace

import torch

from muon.batch_cost import fitting, modelled_s, peak_bytes
from muon.cost import DEFAULT_LINKS, LinkModel
from muon.mesh import LOCAL_MESH_PLAN, MeshCommPlan, resolve_mesh_comm_plan, shard_sizes
from muon.paths import BATCH_BYTES, REMAINDER_CHOICES, REMAINDER_STRATEGIES

__all__ = [  # the mesh plan's names are planning's too
    "BATCH_BYTES",
    "LOCAL_MESH_PLAN",
    "REMAINDER_CHOICES",
    "REMAINDER_STRATEGIES",
    "BatchPlan",
    "ExchangeView",
    "MeshCommPlan",
    "ParamMeta",
    "choose_remainder",
    "fingerprint",
    "plan_batches",
    "resolve_mesh_comm_plan",
    "shard_sizes",
]


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
    #: rows of each block along dim 0 when they are unequal (`num_blocks` of them), else ()
    split_sizes: tuple[int, ...] = ()
    ns_steps: int = 5
    #: "standard" or "gram" (`muon.newton_schulz`): what the cost and workspace models count
    ns_algorithm: str = "standard"
    #: Newton-Schulz settings of the parameter's group; batches never mix different ones
    ns_settings: tuple = ()


@dataclass(frozen=True)
class BatchPlan:
    """One batch of same-shape, same-dtype parameters: how they travel, who orthogonalizes.

    A *unit* is what one owner assembles and orthogonalizes in one go: a whole FSDP-visible
    matrix (`num_blocks` blocks) on the exchange paths, one expert block on the sub-group path.
    `owners` lists the FSDP rank of every unit: matrix j on exchange paths; on the sub-group path
    unit `i * size + j` is parameter j's block i, held by the `block_span` FSDP ranks
    i*k .. i*k+k-1 (k = `block_span`) and owned by a rank of its sub-group: the `subgroup_size`
    consecutive ranks that hold blocks i // m * m .. i // m * m + m - 1 (m = subgroup_size // k,
    1 unless `muon.owners` widened it to balance the step).
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
    ns_algorithm: str = "standard"
    owners: tuple[int, ...] = ()
    #: ranks per sub-group, the exchange group of the sub-group path (a multiple of block_span)
    subgroup_size: int = 1
    #: consecutive FSDP ranks each block spans (sub-group path)
    block_span: int = 1
    fsdp_size: int = 1
    group_ranks: tuple[int, ...] = field(default=(), compare=False)
    #: rows of each block of one matrix when they are unequal (Muon Split), else ()
    split_sizes: tuple[int, ...] = ()
    #: the byte budget one batch is sized to on a rank (`muon.batch_cost.sizing_peak`); the
    #: local path cuts its chunks by it
    batch_bytes: int = BATCH_BYTES

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
        """Rows of one block (the tallest with `split_sizes`): blocks are runs of the parameter's
        dim 0 (a matrix sharded on another dim is orthogonalized in its own `[dim 0, rest]`
        layout)."""
        if self.split_sizes:
            return max(self.split_sizes)
        rows = self.fsdp_visible_rows if self.shard_tensor_dim == 0 else self.global_shape[0]
        return rows // self.num_blocks

    @property
    def block_heights(self) -> tuple[int, ...]:
        """Rows of every block of one FSDP-visible matrix, in dim-0 order."""
        return self.split_sizes or (self.block_rows,) * self.num_blocks

    @property
    def block_cols(self) -> int:
        return math.prod(self.global_shape) // self.global_shape[0]

    @property
    def block_shape(self) -> tuple[int, int]:
        """The `[rows, cols]` matrix one block is orthogonalized as: `block_rows` rows of the
        parameter's dim 0 by the rest; for a parameter of more than two dims, each dim-0 slice
        `[d1, d2 * ...]` (`block_rows` is then 1)."""
        if len(self.global_shape) > 2:
            return self.global_shape[1], math.prod(self.global_shape[2:])
        return self.block_rows, self.block_cols

    @property
    def blocks_per_unit(self) -> int:
        return 1 if self.path == "subgroup" else self.num_blocks

    @property
    def units(self) -> int:
        if self.path == "subgroup":
            return self.size * (self.fsdp_size // self.block_span)
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

    # ------------------------------------------------------------ who holds and owns what
    def exchange_view(self, fsdp_rank: int) -> ExchangeView:
        """`fsdp_rank`'s view of its exchange group: the FSDP group, or on the sub-group path
        the `subgroup_size` ranks of its sub-group (`ExchangeView`)."""
        if self.path != "subgroup":
            return ExchangeView(self.shard_sizes, self.owners, fsdp_rank, self.size, self.fsdp_size)
        s, n = self.subgroup_size, self.size
        g = fsdp_rank // s
        m = s // self.block_span
        owners = tuple(o - g * s for o in self.owners[g * m * n : (g + 1) * m * n])
        sizes = self.shard_sizes[g * s : (g + 1) * s]
        return ExchangeView(sizes, owners, fsdp_rank % s, n, self.block_span, g * m)

    def unit_blocks(self, fsdp_rank: int) -> tuple[int, int]:
        """(first block, block count) of one unit this rank holds: on the local path this rank's
        shard of each parameter, on the sub-group path the block its rows belong to, else a
        whole FSDP-visible matrix."""
        if self.path == "subgroup":
            return fsdp_rank // self.block_span, 1
        if self.path != "local":
            return 0, self.num_blocks
        if self.fsdp_size == 1:
            return 0, self.num_blocks
        start = sum(self.shard_sizes[:fsdp_rank])
        if self.split_sizes:  # the plan made shard edges block edges
            edges = [sum(self.split_sizes[:i]) for i in range(self.num_blocks + 1)]
            first = edges.index(start)
            return first, edges.index(start + self.shard_sizes[fsdp_rank]) - first
        return start // self.block_rows, self.shard_sizes[fsdp_rank] // self.block_rows

    def units_on(self, fsdp_rank: int) -> list[tuple[int, int, int]]:
        """What this rank orthogonalizes, in the order the exchange stacks it: (parameter index j
        in the batch, its first block, its block count) per unit. On the local path every
        parameter's blocks in the rank's shard; on the exchange paths the units the rank owns
        (on the sub-group path ordered by block, then parameter)."""
        if self.path == "local":
            first, count = self.unit_blocks(fsdp_rank)
            return [(j, first, count) for j in range(self.size)] if count else []
        view = self.exchange_view(fsdp_rank)
        if self.path != "subgroup":
            return [(j, 0, self.num_blocks) for j in view.owned()]
        return [(u % view.n, view.first_block + u // view.n, 1) for u in view.owned()]


@dataclass(frozen=True)
class ExchangeView:
    """One rank's view of a batch's exchange group, in the group's coordinates.

    Unit u = i * n + j is parameter j's block i of the group (a whole matrix when the group
    holds one block per matrix): ranks i * span .. i * span + span - 1 hold its rows, `sizes[r]`
    of them on rank r, and `owners[u]` assembles it. Every rank holds rows of n units, those of
    its own block `me // span`.
    """

    sizes: tuple[int, ...]
    owners: tuple[int, ...]
    me: int
    n: int
    span: int
    #: FSDP-visible index of the group's block 0 (sub-group path)
    first_block: int = 0

    def holders(self, u: int) -> range:
        i = u // self.n
        return range(i * self.span, (i + 1) * self.span)

    @property
    def held(self) -> tuple[int, ...]:
        """Owners of the n units this rank holds rows of, by parameter."""
        i = self.me // self.span
        return self.owners[i * self.n : (i + 1) * self.n]

    def owned(self) -> list[int]:
        """The units this rank assembles, ascending (block, then parameter)."""
        return [u for u, o in enumerate(self.owners) if o == self.me]

    def unit_rows(self, u: int) -> int:
        return sum(self.sizes[r] for r in self.holders(u))


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
        key = (p.global_shape, p.num_blocks, p.split_sizes, p.dtype, p.ns_settings)
        buckets.setdefault(key, []).append(p)
    out: list[BatchPlan] = []
    for members in buckets.values():
        common = _bucket_fields(members, mesh_plan) | {"batch_bytes": batch_bytes}
        out += _cut_bucket(
            tuple(p.index for p in members),
            common,
            mp=mesh_plan,
            strategy=remainder_strategy,
            enable_all2all=enable_all2all,
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
    if p.split_sizes and mp.non_fsdp_shard_factor > 1:
        raise ValueError(
            f"Muon: shape {shape} with split_sizes is sharded {mp.non_fsdp_shard_factor}-way "
            "outside FSDP (EP); blocks of unequal heights need the whole dim 0 in one FSDP group"
        )
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
        ns_algorithm=p.ns_algorithm,
        fsdp_size=mp.fsdp_size,
        group_ranks=mp.group_ranks,
        split_sizes=p.split_sizes,
    )


def _cut_bucket(
    indices, common, *, mp, strategy, enable_all2all, expert_aware, batch_bytes, link, memory_budget
) -> list[BatchPlan]:
    if not mp.sharded:
        return [BatchPlan("local", indices, **common)]
    w, sizes, d = mp.fsdp_size, common["shard_sizes"], common["shard_tensor_dim"]
    blocks, visible = common["num_blocks"], common["fsdp_visible_rows"]
    splits = common["split_sizes"]
    if expert_aware and splits and d == 0:
        # every shard a run of whole blocks: each rank orthogonalizes its own, no exchange
        if set(_cumsum(sizes)) <= set(_cumsum(splits)):
            return [BatchPlan("local", indices, **common)]
    elif expert_aware and blocks > 1 and d == 0:
        block_rows, chunk = visible // blocks, sizes[0]
        if chunk % block_rows == 0:
            return [BatchPlan("local", indices, **common)]
        k = block_rows // chunk if block_rows % chunk == 0 else 0
        if k > 1 and chunk * w == visible and w % k == 0:
            # memory bound: a rank may assemble every block of its sub-group's batch
            sub = dict(path="subgroup", subgroup_size=k, block_span=k, **common)
            n = fitting(len(indices), lambda n: BatchPlan(param_indices=indices[:n], **sub))
            return [
                BatchPlan(param_indices=indices[i : i + n], **sub)
                for i in range(0, len(indices), n)
            ]
    out = []
    # a full batch holds k matrices per rank (k * W in all), so that one Newton-Schulz call
    # orthogonalizes an owner's k: as many as keep the batch's planned peak within its budget
    k = fitting(len(indices) // w, lambda k: BatchPlan("full", indices[: k * w], **common))
    cuts, i = [], 0
    while enable_all2all and len(indices) - i >= w:
        n = w * min(k, (len(indices) - i) // w)
        cuts.append(indices[i : i + n])
        i += n
    cuts += [indices[j : j + w] for j in range(i, len(indices), w)]
    for batch in cuts:
        if not enable_all2all:
            path = "agrs"
        elif len(batch) >= w:
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


def _cumsum(sizes) -> list[int]:
    out, total = [], 0
    for n in sizes:
        total += n
        out.append(total)
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
    # owners 0..R-1 and shard sizes that never grow with the rank: the busiest owner is rank 0
    # and the busiest of the others rank R, so those (and the last) stand for all W ranks
    ranks = sorted({0, min(batch.size, batch.fsdp_size - 1), batch.fsdp_size - 1})
    scored = []
    for s in REMAINDER_STRATEGIES:
        cand = replace(batch, path=s)
        peak = max(peak_bytes(cand, r, ns_itemsize) for r in ranks)
        fits = memory_budget is None or peak <= memory_budget
        scored.append((not fits, modelled_s(cand, link, ranks) if fits else peak, s))
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
            h.update(repr((b.subgroup_size, b.block_span)).encode())
            h.update(repr(b.split_sizes).encode())
            # which batches may run Gram Newton-Schulz: the census carries a count for each
            h.update(repr((b.ns_algorithm, b.ns_steps)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1
