"""Widened sub-groups on a gloo world of 4 equal a single-process run.

Expert blocks of 8 rows over shards of 4 span pairs of ranks (k = 2). One dense matrix, worth
several blocks of Newton-Schulz work, lands on a rank of one pair: with pairs as sub-groups
that pair stays above the mean, so `muon.owners` widens the sub-groups to all four ranks and
moves blocks to the other pair, whose owner then receives both shards of a block. Parameters,
momentum and NorMuon moments must equal the single-process reference, and the bytes each rank
sends must equal what `muon.paths` counts from the plan.
"""

from __future__ import annotations

from muon.batch_cost import bytes_sent
from muon.plan import REMAINDER_STRATEGIES
from tests.distributed.test_muon_distributed import NORMUON, flat_shard, run_case
from tests.harness import init_mesh, run_world

W = 4
# 12 fused-expert parameters of 2 blocks (8 x 24 each) and one 20 x 20 dense matrix
SPECS = [((16, 24), 2)] * 12 + [((20, 20), 1)]


def _widened(opt) -> list[tuple[int, int]]:
    """(sub-group size, blocks owned outside their own k ranks) of each sub-group batch."""
    out = []
    for _, batches in opt.plans:
        for b in batches:
            if b.path == "subgroup":
                # this rank's sub-group: units u = i * n + j, block i held by ranks i*k..i*k+k-1
                view = b.exchange_view(0)
                foreign = sum(o not in view.holders(u) for u, o in enumerate(view.owners))
                out.append((b.subgroup_size, foreign))
    return out


def _cases():
    mesh = init_mesh((W,), ("fsdp",))
    results = []
    for strategy in REMAINDER_STRATEGIES:
        for ns in (None, NORMUON):
            err, opt = run_case(SPECS, flat_shard(mesh), strategy, True, ns=ns)
            planned = sum(bytes_sent(b, mp.fsdp_rank) for mp, bs in opt.plans for b in bs)
            results.append(
                (
                    f"{strategy} normuon={ns is not None}",
                    err,
                    _widened(opt),
                    opt.step_stats["muon/bytes_sent"],
                    planned,
                )
            )
    return results


def test_widened_subgroups_equal_single_process():
    ranks = run_world(_cases, W, timeout_s=600)
    for rank, results in enumerate(ranks):
        for label, err, widened, sent, planned in results:
            assert widened, f"{label}: no sub-group batch"
            assert all(s == W for s, _ in widened), f"{label}: not widened: {widened}"
            assert sum(f for _, f in widened) > 0, f"{label}: no block left its pair"
            # float32 Newton-Schulz of identical inputs, only batched differently: as in
            # test_muon_distributed (2^-24 rounding amplified <= 490x, updates ~1e-2, 3 steps)
            assert err < 2e-5, f"{label}: max |distributed - reference| = {err:.3g}"
            assert sent == planned, f"{label} rank {rank}: sent {sent} B, plan {planned} B"
