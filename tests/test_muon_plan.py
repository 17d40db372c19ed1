"""Muon's plan as plain data: mesh comm plans, batch paths, shard sizes, owners, buffer sizes.

No collectives: these run in-process. GLM-5.2 at 512 ranks, ep 8: an AGRS remainder of 12 down
weights all-gathers the FSDP-visible rows (9 GiB), not the global rows (72 GiB).
"""

import pytest
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from muon.plan import (
    OwnerCursor,
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


def _glm52_batches(expert_aware, strategy="agrs"):
    mp = _glm52_mesh()
    E = 256
    gate_up = [ParamMeta(i, (E * 2 * 2048, 6144), 2 * E, 2) for i in range(76)]
    down = [ParamMeta(76 + i, (E * 6144, 2048), E, 2) for i in range(76)]
    return plan_batches(gate_up + down, mp, strategy, True, expert_aware, OwnerCursor(64))


def test_glm52_expert_aware_paths():
    batches = _glm52_batches(expert_aware=True)
    gate_up = [b for b in batches if b.global_shape == (1048576, 6144)]
    down = [b for b in batches if b.global_shape == (1572864, 2048)]
    assert {b.path for b in gate_up} == {"local"}
    assert sum(b.size for b in gate_up) == 76
    # no parameter-count guard: all 76 down weights take the sub-group path, 2 ranks per block
    assert {b.path for b in down} == {"subgroup"} and sum(b.size for b in down) == 76
    assert {b.subgroup_size for b in down} == {2}
    assert down[0].global_shard_dim_size == 196608 and down[0].shard_sizes[0] == 3072


def test_glm52_without_expert_paths_agrs_buffer_is_ep_local():
    down = [b for b in _glm52_batches(expert_aware=False) if b.global_shape == (1572864, 2048)]
    assert [(b.path, b.size) for b in down] == [("full", 64), ("agrs", 12)]
    rem = down[1]
    assert rem.global_shard_dim_size == 1572864 // 8  # FSDP-visible, not global
    buf = rem.collective_buffer_bytes(0)
    assert buf == 12 * 196608 * 2048 * 2
    assert 8.9 * GiB < buf < 9.1 * GiB  # FSDP-visible rows: 9 GiB, not 72 GiB


def test_each_batch_plans_its_own_shapes():
    from muon.plan import MeshCommPlan

    mp = MeshCommPlan(sharded=True, fsdp_mesh_dim=0, fsdp_size=4, group_ranks=(0, 1, 2, 3))
    metas = [ParamMeta(0, (10, 3), 1, 4), ParamMeta(1, (16, 3), 1, 4), ParamMeta(2, (10, 3), 1, 4)]
    batches = plan_batches(metas, mp, "ragged_all_to_all", True, True, OwnerCursor(4))
    by_shape = {b.global_shape: b for b in batches}
    assert by_shape[(10, 3)].shard_sizes == (3, 3, 3, 1)
    assert by_shape[(16, 3)].shard_sizes == (4, 4, 4, 4)
    assert by_shape[(10, 3)].param_indices == (0, 2)


def test_owner_cursor_balances_remainders_across_batches():
    from muon.plan import MeshCommPlan

    w = 4
    mp = MeshCommPlan(sharded=True, fsdp_mesh_dim=0, fsdp_size=w, group_ranks=(0, 1, 2, 3))
    metas, i = [], 0
    for rows, count in [(8, 3), (12, 1), (16, 2), (20, 3), (24, 5)]:
        metas += [ParamMeta(i + k, (rows, 4), 1, 4) for k in range(count)]
        i += count
    for strategy in ("agrs", "ragged_all_to_all"):
        batches = plan_batches(metas, mp, strategy, True, True, OwnerCursor(w))
        counts = [sum(b.matrices_on(r) for b in batches) for r in range(w)]
        assert max(counts) - min(counts) <= 1, (strategy, counts)
        assert sum(counts) == len(metas)


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
