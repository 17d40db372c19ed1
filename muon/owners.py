"""Who orthogonalizes what: owners balanced by Newton-Schulz cost over the whole step.

Every exchanged unit (a matrix of a full or remainder batch, an expert block of a sub-group
batch) gets its owner from one deterministic LPT pass (largest first, to the least-loaded
eligible rank), over every comm group and every FSDP group of the world at once, so a rank that
owns a large dense matrix takes fewer expert blocks. Work a rank already has counts as its
initial load: its local expert blocks, and replicated matrices. Costs are integer
`muon.cost.ns_flops` (`muon.cost.block_flops`) and ties break by rank, so every
rank computes the same assignment; its digest goes into the plan fingerprint.

Constraints: a unit goes to a rank of its exchange group (the FSDP group; the sub-group for
expert blocks that span k ranks). In a full batch of k * W matrices every rank owns k (its
memory bound, `muon.plan`), in a remainder batch at most one unit (`pad_all2all` has one slot
per rank); in a sub-group batch a
rank may own up to the batch size (the batch is already bounded by memory, see `muon.plan`).

Sub-groups can be widened. With the k ranks of a block as its sub-group, the blocks of a
sub-group can only even out the load inside it: when one of its ranks also owns a large dense
matrix (GLM-5's o_proj is a fifth of a rank's share at 512 ranks), the pair stays above the
mean whatever the split. So the assignment is tried with sub-groups of m * k ranks (m = 1, 2,
4, ...: m blocks of each matrix per sub-group, whose ranks may own each other's blocks) and the
narrowest m with the lowest busiest rank is kept. Blocks still go to their own k ranks first;
only the repair pass moves one to another rank of its sub-group, where that rank receives all
k shards of it instead of k - 1 (the bytes `muon.cost` counts).
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, replace

from muon.batch_cost import bytes_sent
from muon.cost import batch_block_flops, batch_blocks_flops, ns_flops_on
from muon.plan import BatchPlan, MeshCommPlan

Plans = list[tuple[MeshCommPlan, list[BatchPlan]]]
#: sub-groups are widened only while the busiest rank is this far above the mean
WIDEN_ABOVE = 1.01


def assign_owners(plans: Plans, *, world_size: int) -> tuple[Plans, list[int], int]:
    """Fill in every batch's owners; return (plans, NS FLOPs per global rank, digest).

    Sub-groups widened m = 1, 2, 4, ... times (`_Trial`) while that lowers the busiest rank
    and it is more than `WIDEN_ABOVE` times the mean; the best trial's owners and sub-group
    sizes go into the plans."""
    best, m = _Trial(plans, world_size, 1), 2
    while _widenable(plans, m) and max(best.loads) * world_size > WIDEN_ABOVE * sum(best.loads):
        trial = _Trial(plans, world_size, m)
        if max(trial.loads) >= max(best.loads):
            break
        best, m = trial, 2 * m
    out: Plans = []
    for mi, (mp, batches) in enumerate(plans):
        mine = mp.all_groups.index(mp.group_ranks) if mp.sharded else 0
        out.append(
            (
                mp,
                [
                    b
                    if b.path == "local"
                    else replace(
                        b,
                        owners=tuple(best.owners[(mi, bi, mine)]),
                        subgroup_size=_subgroup(b, best.m),
                    )
                    for bi, b in enumerate(batches)
                ],
            )
        )
    loads = best.loads
    digest = int.from_bytes(hashlib.sha256(repr(loads).encode()).digest()[:8], "little") >> 1
    return out, loads, digest


def _subgroup(b: BatchPlan, m: int) -> int:
    """Ranks of `b`'s sub-group when widened up to m times: the largest m' <= m (a power of two)
    whose m' * k ranks tile the FSDP group; the batch's own size off the sub-group path."""
    if b.path != "subgroup":
        return b.subgroup_size
    k = b.block_span
    while m > 1 and b.fsdp_size % (m * k):
        m //= 2
    return m * k


def _widenable(plans: Plans, m: int) -> bool:
    return any(
        b.path == "subgroup" and _subgroup(b, m) > _subgroup(b, m // 2)
        for _, batches in plans
        for b in batches
    )


@dataclass
class _Trial:
    """One LPT assignment with sub-groups widened up to m times. Four passes. (1) Fixed work:
    local blocks. (2) Whole matrices (full and remainder batches), largest first, each to the
    eligible rank whose load is expected lowest once the sub-group blocks are shared out: the
    larger of its own load and the mean load of the ranks it shares sub-groups with (sub-group
    blocks can move between those ranks, so two big matrices do not land in one sub-group).
    (3) Sub-group blocks, largest first, to the least loaded of the block's own k ranks, so a
    rank that took a big matrix takes fewer blocks. (4) A greedy repair moves units off the
    busiest rank, anywhere in their exchange group, while that lowers its load (`_refine`)."""

    plans: Plans
    world_size: int
    m: int

    def __post_init__(self) -> None:
        plans, world_size = self.plans, self.world_size
        loads = [0] * world_size
        # (-cost, mesh index, batch index, FSDP group, unit, lo, hi, cap, exchange lo, hi)
        whole, blocks = [], []
        for mi, (mp, batches) in enumerate(plans):
            groups = mp.all_groups if mp.sharded else (tuple(range(world_size)),)
            for bi, b in enumerate(batches):
                if b.path == "local":
                    for ranks in groups:
                        for r, g in enumerate(ranks):
                            loads[g] += ns_flops_on(b, r if mp.sharded else 0)
                    continue
                if b.path != "subgroup":
                    cost = batch_blocks_flops(b)
                    cap = b.size // b.fsdp_size if b.path == "full" else 1  # k per rank, or 1
                    for q in range(len(groups)):
                        whole += [
                            (-cost, mi, bi, q, u, 0, b.fsdp_size, cap) for u in range(b.units)
                        ]
                    continue
                cost, k, s = batch_block_flops(b), b.block_span, _subgroup(b, self.m)
                for q in range(len(groups)):
                    for u in range(b.units):
                        lo = (u // b.size) * k
                        blocks.append((-cost, mi, bi, q, u, lo, lo + k, b.size, lo // s * s, s))
        # ranks joined by sub-groups share their blocks: their loads even out in (3) and (4)
        parent = list(range(world_size))

        def root(g: int) -> int:
            while parent[g] != g:
                parent[g] = parent[parent[g]]
                g = parent[g]
            return g

        pool_total = list(loads)
        for neg_cost, mi, _, q, _, _, _, _, xlo, s in blocks:
            ranks = plans[mi][0].all_groups[q]
            for g in ranks[xlo + 1 : xlo + s]:
                a, c = root(ranks[xlo]), root(g)
                if a != c:
                    parent[c] = a
                    pool_total[a] += pool_total[c]
            pool_total[root(ranks[xlo])] -= neg_cost
        roots = [root(g) for g in range(world_size)]  # the pools are final from here on
        pool_size = [0] * world_size
        for c in roots:
            pool_size[c] += 1

        owners: dict[tuple[int, int, int], list[int]] = {}
        used: dict[tuple[int, int, int], list[int]] = {}

        def place(item, pooled: bool) -> None:
            neg_cost, mi, bi, q, u, lo, hi, cap = item[:8]
            b, ranks = plans[mi][1][bi], plans[mi][0].all_groups[q]
            count = used.setdefault((mi, bi, q), [0] * b.fsdp_size)
            best, best_key = -1, None
            for r in range(lo, hi):
                if count[r] < cap:
                    g = ranks[r]
                    if pooled:  # expected load once the pool's blocks are shared out
                        c = roots[g]
                        key = (max(loads[g], pool_total[c] / pool_size[c]), loads[g])
                    else:
                        key = (loads[g], 0)
                    if best_key is None or key < best_key:  # ties: the lowest rank
                        best, best_key = r, key
            count[best] += 1
            loads[ranks[best]] -= neg_cost
            pool_total[roots[ranks[best]]] -= neg_cost
            owners.setdefault((mi, bi, q), [0] * b.units)[u] = best

        for item in sorted(whole):
            place(item, pooled=True)
        for item in sorted(blocks):
            place(item, pooled=False)
        # the repair may move a unit anywhere in its exchange group
        movable = whole + [(*t[:5], t[8], t[8] + t[9], t[7]) for t in blocks]
        _refine(plans, movable, owners, used, loads)
        self.owners, self.loads = owners, loads


def _refine(plans: Plans, items: list, owners: dict, used: dict, loads: list[int]) -> None:
    """Greedy repair after LPT: move a unit off the busiest rank to the eligible rank (within its
    batch's cap) that leaves the pair's larger load lowest, while that lowers the busiest rank's
    load; stop when no move does (or after a bounded number of moves). Deterministic."""
    unit = {(mi, bi, q, u): (-neg, lo, hi, cap) for neg, mi, bi, q, u, lo, hi, cap in items}
    owned: dict[int, list[tuple]] = {}
    for mi, bi, q, u in unit:
        owned.setdefault(plans[mi][0].all_groups[q][owners[(mi, bi, q)][u]], []).append(
            (mi, bi, q, u)
        )
    heap = [(-load, g) for g, load in enumerate(loads)]  # busiest first, ties: lowest rank
    heapq.heapify(heap)
    for _ in range(4 * len(loads)):
        while -heap[0][0] != loads[heap[0][1]]:  # stale: that rank's load changed
            heapq.heappop(heap)
        top = heap[0][1]
        best = None
        for key in owned.get(top, ()):
            cost, lo, hi, cap = unit[key]
            ranks, count = plans[key[0]][0].all_groups[key[2]], used[key[:3]]
            for r in range(lo, hi):
                g = ranks[r]
                if g == top or count[r] >= cap:
                    continue
                after = loads[g] + cost
                if after < loads[top] and (best is None or (after, g) < best[0]):
                    best = ((after, g), key, r)
        if best is None:
            return
        (_, g), key, r = best
        cost = unit[key][0]
        count = used[key[:3]]
        count[owners[key[:3]][key[3]]] -= 1
        count[r] += 1
        owners[key[:3]][key[3]] = r
        owned[top].remove(key)
        owned.setdefault(g, []).append(key)
        loads[top] -= cost
        loads[g] += cost
        heapq.heappush(heap, (-loads[top], top))
        heapq.heappush(heap, (-loads[g], g))


def useful_ns_flops(plans: Plans) -> int:
    """Newton-Schulz FLOPs of one step with every block orthogonalized exactly once, world-wide
    (replicated plain tensors count once)."""
    total = 0
    for mp, batches in plans:
        groups = len(mp.all_groups) if mp.sharded else 1
        total += sum(b.size * batch_blocks_flops(b) for b in batches) * groups
    return total


def balance_figures(plans: Plans, loads: list[int]) -> dict:
    """The balance of a planned step: busiest and mean rank against the ideal (the useful work
    spread evenly), and for the FSDP group of the rank's most loaded mesh group its ranks' NS
    FLOPs and bytes sent (the whole step's, every mesh group they are part of)."""
    world = len(loads)
    ideal = useful_ns_flops(plans) / world
    sharded = [(mp, bs) for mp, bs in plans if mp.sharded]
    figures = {
        "ns_flops_busiest": max(loads),
        "ns_flops_mean": sum(loads) / world,
        "ns_flops_ideal": ideal,
        "busiest_over_ideal": max(loads) / ideal if ideal else 1.0,
        # how far the owners widened the sub-groups (1: each block's own ranks), and the
        # busiest rank the assignment would have had without
        "subgroup_widening": max(
            (
                b.subgroup_size // b.block_span
                for _, bs in plans
                for b in bs
                if b.path == "subgroup"
            ),
            default=1,
        ),
    }
    if figures["subgroup_widening"] > 1:
        figures["ns_flops_busiest_unwidened"] = max(_Trial(plans, world, 1).loads)
    if not sharded:
        return figures
    # the comm group with the most non-FSDP sharding (experts), else the first
    mi, (group_mp, _) = max(
        enumerate(sharded), key=lambda t: (t[1][0].non_fsdp_shard_factor, -t[0])
    )
    ranks = group_mp.group_ranks
    sent = [
        sum(
            bytes_sent(b, mp.group_ranks.index(g))
            for mp, bs in sharded
            if g in mp.group_ranks
            for b in bs
        )
        for g in ranks
    ]
    figures.update(
        comm_group=list(ranks),
        ns_flops_per_rank=[loads[g] for g in ranks],
        bytes_sent_per_rank=sent,
        bytes_sent_busiest=max(sent),
    )
    return figures
