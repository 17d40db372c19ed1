"""Muon's plan as plain data: mesh comm plans, batch paths, shard sizes, owners, buffer sizes.

No collectives: these run in-process. GLM-5.2 at 512 ranks, ep 8: an AGRS remainder of 12 down
weights all-gathers the FSDP-visible rows (9 GiB), not the global rows (72 GiB).
"""

from dataclasses import replace

import pytest
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from muon import batch_cost, cost
from muon.cost import block_flops as ns_flops
from muon.owners import assign_owners, balance_figures
from muon.plan import (
    REMAINDER_STRATEGIES,
    MeshCommPlan,
    ParamMeta,
    plan_batches,
    resolve_mesh_comm_plan,
    shard_sizes,
)

GiB = 1024**3


def _grid(shape):
    import torch

    return torch.arange(int(torch.tensor(shape).prod())).reshape(shape).tolist()


def _glm52_mesh():
    shape = (64, 8)
    return resolve_mesh_comm_plan(
        shape, _grid(shape), (_StridedShard(0, split_factor=8), Shard(0)), (0, 0)
    )


def test_shard_sizes_follow_ceil_chunking():
    assert shard_sizes(10, 4) == (3, 3, 3, 1)
    assert shard_sizes(3, 8) == (1, 1, 1, 0, 0, 0, 0, 0)
    assert shard_sizes(8, 4) == (2, 2, 2, 2)


def test_mesh_plan_finds_fsdp_and_ep_by_elimination():
    mp = _glm52_mesh()
    assert (mp.fsdp_mesh_dim, mp.ep_mesh_dim) == (0, 1)
    assert mp.fsdp_size == 64 and mp.non_fsdp_shard_factor == 8
    assert mp.group_ranks == tuple(range(0, 512, 8))  # efsdp group of rank 0: stride 8
    assert len(mp.all_groups) == 8
    # size-1 dims count as replicated; Replicate too
    one = resolve_mesh_comm_plan((1, 4), _grid((1, 4)), (Shard(0), Shard(0)), (0, 2))
    assert one.sharded and one.fsdp_size == 4 and one.non_fsdp_shard_factor == 1
    rep = resolve_mesh_comm_plan((4,), _grid((4,)), (Replicate(),), (1,))
    assert not rep.sharded


def test_unsupported_placements_name_them():
    with pytest.raises(NotImplementedError, match="placements"):
        resolve_mesh_comm_plan((2, 2), _grid((2, 2)), (Shard(0), Shard(1)), (0, 0))
    with pytest.raises(NotImplementedError, match="placements"):
        resolve_mesh_comm_plan(
            (2, 2, 2), _grid((2, 2, 2)), (Shard(0), Shard(0), Shard(0)), (0, 0, 0)
        )


def _meta(i, shape, blocks=1, dtype="bfloat16", itemsize=2):
    return ParamMeta(i, shape, blocks, dtype, itemsize, dtype)


def _plan(metas, mp, strategy="ragged_all_to_all", expert_aware=True, **kw):
    return plan_batches(
        metas,
        mesh_plan=mp,
        remainder_strategy=strategy,
        enable_all2all=True,
        expert_aware=expert_aware,
        **kw,
    )


def _glm52_batches(expert_aware, strategy="agrs"):
    mp = _glm52_mesh()
    E = 256
    gate_up = [_meta(i, (E * 2 * 2048, 6144), 2 * E) for i in range(76)]
    down = [_meta(76 + i, (E * 6144, 2048), E) for i in range(76)]
    return _plan(gate_up + down, mp, strategy, expert_aware)


def test_glm52_expert_aware_paths():
    batches = _glm52_batches(expert_aware=True)
    gate_up = [b for b in batches if b.global_shape == (1048576, 6144)]
    down = [b for b in batches if b.global_shape == (1572864, 2048)]
    assert {b.path for b in gate_up} == {"local"}
    assert sum(b.size for b in gate_up) == 76
    # no parameter-count guard: all 76 down weights take the sub-group path, 2 ranks per block,
    # in batches bounded by memory (not all 64 at once: 2.34 GiB planned peak before)
    assert {b.path for b in down} == {"subgroup"} and sum(b.size for b in down) == 76
    assert {b.subgroup_size for b in down} == {2}
    assert down[0].fsdp_visible_rows == 196608 and down[0].shard_sizes[0] == 3072
    (mp, owned), *_ = assign_owners([(_glm52_mesh(), down)], world_size=512)[0]
    assert max(batch_cost.peak_bytes(b, r, 2) for b in owned for r in range(64)) < 0.5 * GiB


def test_glm52_without_expert_paths_agrs_buffer_is_ep_local():
    down = [b for b in _glm52_batches(expert_aware=False) if b.global_shape == (1572864, 2048)]
    assert [(b.path, b.size) for b in down] == [("full", 64), ("agrs", 12)]
    rem = down[1]
    assert rem.fsdp_visible_rows == 1572864 // 8  # FSDP-visible, not global
    buf = batch_cost.collective_buffer_bytes(rem, 0)
    assert buf == 12 * 196608 * 2048 * 2
    assert 8.9 * GiB < buf < 9.1 * GiB  # FSDP-visible rows: 9 GiB, not 72 GiB


def test_each_batch_plans_its_own_shapes():
    mp = _flat_mesh(4)
    metas = [_meta(0, (10, 3)), _meta(1, (16, 3)), _meta(2, (10, 3))]
    batches = _plan(metas, mp)
    by_shape = {b.global_shape: b for b in batches}
    assert by_shape[(10, 3)].shard_sizes == (3, 3, 3, 1)
    assert by_shape[(16, 3)].shard_sizes == (4, 4, 4, 4)
    assert by_shape[(10, 3)].param_indices == (0, 2)


def _flat_mesh(w):
    ranks = tuple(range(w))
    return MeshCommPlan(
        sharded=True, fsdp_mesh_dim=0, fsdp_size=w, group_ranks=ranks, all_groups=(ranks,)
    )


def test_lpt_owners_balance_cost_across_shapes_and_batches():
    """Owners by Newton-Schulz cost, largest first: an 8192x6144-like matrix counts for more
    than a small one, and no rank ends more than one unit's cost above the least loaded."""
    w = 4
    metas, i = [], 0
    for shape, count in [((64, 48), 3), ((8, 48), 5), ((32, 16), 6), ((16, 16), 2), ((48, 48), 1)]:
        metas += [_meta(i + k, shape, dtype="float32", itemsize=4) for k in range(count)]
        i += count
    for strategy in REMAINDER_STRATEGIES:
        plans, loads, digest = assign_owners(
            [(_flat_mesh(w), _plan(metas, _flat_mesh(w), strategy))], world_size=w
        )
        batches = plans[0][1]
        per_rank = [sum(cost.ns_flops_on(b, r) for b in batches) for r in range(w)]
        assert per_rank == loads
        biggest = max(ns_flops(*m.global_shape, steps=5) for m in metas)
        assert sum(loads) == sum(ns_flops(*m.global_shape, steps=5) for m in metas)
        assert max(loads) - min(loads) <= biggest, (strategy, loads)
        for b in batches:  # one unit per rank and batch: pad_all2all's slots need it
            assert len(set(b.owners)) == b.size
        # deterministic: the same plan gives the same owners and digest
        again = assign_owners(
            [(_flat_mesh(w), _plan(metas, _flat_mesh(w), strategy))], world_size=w
        )
        assert again[2] == digest and again[0][0][1] == batches


def test_gram_plans_count_gram_flops_and_workspace():
    """With ns_algorithm="gram" the plan counts the iteration `newton_schulz` runs on each
    shape: Gram on a 1:3 block (58 m^3 against 70 m^3 with the default restarts, one more
    m x m temporary: 3 X + 3 m^2 against the standard 3 X + 2 m^2, `muon.cost.ns_block_bytes`),
    the standard iteration on a square one (no fewer FLOPs there)."""
    from dataclasses import replace

    w = 4
    for shape, gram_runs in (((64, 192), True), ((96, 96), False)):
        std = [_meta(k, shape) for k in range(w)]
        # "auto" leaves blocks under GRAM_MIN_ROWS rows to the standard iteration
        (b_auto,) = _plan([replace(m, ns_algorithm="auto") for m in std], _flat_mesh(w), "agrs")
        assert cost.batch_block_flops(b_auto) == cost.batch_block_flops(
            _plan(std, _flat_mesh(w), "agrs")[0]
        )
        gram = [replace(m, ns_algorithm="gram") for m in std]
        (b_std,), (b_gram,) = (
            assign_owners([(_flat_mesh(w), _plan(ms, _flat_mesh(w), "pad_all2all"))], world_size=w)[
                0
            ][0][1]
            for ms in (std, gram)
        )
        m = min(shape)
        assert cost.batch_block_flops(b_std) == (70 * m**3 if gram_runs else 5 * 6 * m**3)
        want = 58 * m**3 if gram_runs else cost.batch_block_flops(b_std)
        assert cost.batch_block_flops(b_gram) == want
        extra = m * m * 2 if gram_runs else 0  # one bf16 m x m matrix
        owner = b_gram.owners[0]
        assert (
            batch_cost.ns_workspace_bytes(b_gram, owner, 2)
            - batch_cost.ns_workspace_bytes(b_std, owner, 2)
            == extra
        )


def test_existing_work_counts_as_load():
    """A rank holding local expert blocks takes fewer exchanged matrices; sub-group blocks go to
    exactly one rank of their sub-group, and a rank owning a big matrix takes fewer of them."""
    w = 4
    flat = _flat_mesh(w)
    # experts: 2 blocks of 32 rows over 4 ranks of 16 rows (k = 2); dense: one big, three small
    experts = [_meta(i, (64, 16), 2, "float32", 4) for i in range(6)]
    dense = [_meta(6, (64, 64), 1, "float32", 4)] + [
        _meta(7 + i, (8, 64), 1, "float32", 4) for i in range(3)
    ]
    plans = [(flat, _plan(experts, flat)), (flat, _plan(dense, flat))]
    assert {b.path for b in plans[0][1]} == {"subgroup"}
    plans, loads, _ = assign_owners(plans, world_size=w)
    sub = plans[0][1]
    for b in sub:
        k = b.subgroup_size
        for u, o in enumerate(b.owners):
            g = u // b.size
            assert g * k <= o < (g + 1) * k  # a rank of the block's own sub-group
    big_owner = plans[1][1][0].owners[0]
    blocks = [sum(batch_cost.blocks_on(b, r) for b in sub) for r in range(w)]
    partner = big_owner ^ 1
    assert blocks[big_owner] < blocks[partner], (big_owner, blocks)
    assert sum(blocks) == 6 * 2  # every block orthogonalized exactly once
    assert blocks[big_owner] == 0 and blocks[partner] == 6


def test_subgroups_widen_only_when_that_lowers_the_busiest_rank():
    """Blocks of 8 rows over shards of 4 span pairs. Alone they balance inside the pairs: the
    sub-groups stay pairs. With a dense matrix worth several blocks on one pair, pairs cannot
    even out, so the sub-groups widen to all 4 ranks and blocks move to the other pair."""
    w = 4
    flat = _flat_mesh(w)
    experts = [_meta(i, (16, 24), 2, "float32", 4) for i in range(12)]
    alone = [(flat, _plan(experts, flat))]
    plans, loads, _ = assign_owners(alone, world_size=w)
    assert {(b.subgroup_size, b.block_span) for b in plans[0][1]} == {(2, 2)}
    assert max(loads) == min(loads)
    with_dense = [*alone, (flat, _plan([_meta(12, (20, 20), 1, "float32", 4)], flat))]
    plans, loads, _ = assign_owners(with_dense, world_size=w)
    sub = plans[0][1]
    assert {(b.subgroup_size, b.block_span) for b in sub} == {(4, 2)}
    figures = balance_figures(plans, loads)
    assert figures["subgroup_widening"] == 2
    assert max(loads) < figures["ns_flops_busiest_unwidened"]
    view = sub[0].exchange_view(0)
    foreign = [u for u, o in enumerate(view.owners) if o not in view.holders(u)]
    assert foreign  # some blocks left their pair: their owner receives both shards
    row = 24 * 4
    for r in range(w):
        v = sub[0].exchange_view(r)
        owned = v.owned()
        mine = 4 * row  # a rank's 4 rows of each of its 12 units
        away = sum(o != v.me for o in v.held)
        recv = sum((8 - 4 * (v.me in v.holders(u))) * row for u in owned)
        assert batch_cost.bytes_sent(sub[0], r) == mine * away + recv
    assert sum(len(b.exchange_view(r).owned()) for b in sub for r in range(w)) == 24


def test_groups_replaced_by_load_state_dict_are_used():
    """Muon looks groups up at step time: an lr set after load_state_dict takes effect."""
    import torch

    from muon import Muon

    p = torch.nn.Parameter(torch.ones(4, 4))
    opt = Muon([p], lr=0.1)
    opt.load_state_dict(opt.state_dict())
    opt.param_groups[0]["lr"] = 1e-30
    p.grad = torch.randn(4, 4)
    opt.step()
    assert torch.allclose(p, torch.ones(4, 4))


def test_auto_picks_the_fastest_remainder_that_fits_the_budget():
    """`remainder_strategy="auto"`: per remainder batch, the lowest modelled time among the
    strategies whose planned peak fits; with no strategy fitting, the smallest peak."""
    from muon.cost import LinkModel
    from muon.plan import choose_remainder

    mp = _flat_mesh(8)
    metas = [_meta(i, (1024, 256), dtype="float32", itemsize=4) for i in range(11)]
    link = LinkModel(latency_s=1e-5, bytes_per_s=1e10, flops_per_s=1e12)
    full, rem = _plan(metas, mp, "auto", link=link)
    assert (full.path, full.size, rem.size) == ("full", 8, 3)
    # the ragged exchange sends the fewest bytes from its busiest rank and holds the least
    assert rem.path == "ragged_all_to_all"
    times = {s: batch_cost.modelled_s(_plan(metas, mp, s)[1], link) for s in REMAINDER_STRATEGIES}
    assert min(times, key=times.get) == "ragged_all_to_all", times
    # a budget only agrs-sized batches would exceed leaves the choice alone; one nothing fits
    # picks the smallest planned peak
    probe = replace(rem, owners=(0, 1, 2))
    peaks = {
        s: max(batch_cost.peak_bytes(replace(probe, path=s), r, 4) for r in range(8))
        for s in REMAINDER_STRATEGIES
    }
    assert choose_remainder(probe, link=link, memory_budget=max(peaks.values())) == rem.path
    smallest = min(peaks, key=peaks.get)
    assert choose_remainder(probe, link=link, memory_budget=1) == smallest
    # without all-to-all, auto means agrs (no warning: nothing the user asked for is dropped)
    import warnings

    import torch

    from muon import Muon

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon(
            [torch.nn.Parameter(torch.ones(4, 4))], remainder_strategy="auto", enable_all2all=False
        )
    assert opt.remainder_strategy == "agrs"
