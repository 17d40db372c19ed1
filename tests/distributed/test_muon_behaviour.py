"""Distributed Muon behaviour beyond parity: memory per strategy, balance, plan safety, shapes.

Memory is measured with the CPU allocator's counter (recipes.memory), never computed.
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import muon.blocks as muon_blocks
import muon.task as muon_task
from muon import Muon, batch_cost
from muon.runtime import AsyncRuntime
from recipes.bench.fixtures import sharded_matrices
from recipes.memory import MemoryMeter
from tests.harness import init_mesh, run_world

W = 4


def _sharded(shapes, mesh, seed=0):
    return sharded_matrices(shapes, mesh, generator=torch.Generator().manual_seed(seed))


def _memory_case(meter, mesh, strategy, count):
    """Peak extra bytes during one optimizer step of `count` [512, 256] fp32 matrices."""
    params = _sharded([(512, 256)] * count, mesh)
    opt = Muon(params, ns_dtype=torch.float32, nesterov=False, remainder_strategy=strategy)
    opt.step()  # warm-up: lazy allocations outside the measured step
    # let gloo's worker threads free the warm-up's buffers first: a late free inside the
    # measured region would lower its peak (idle ranks of pad_all2all run no Newton-Schulz, so
    # their peak is only the exchange buffers)
    dist.barrier()
    gc.collect()
    time.sleep(0.05)
    with meter.measure() as m, m.region("optim"):
        opt.step()
    return m.peak_delta_bytes("optim"), opt.step_stats["muon/matrices"]


def _behaviour_world():
    torch.manual_seed(0)
    rank = dist.get_rank()
    mesh = init_mesh((W,), ("fsdp",))
    meter = MemoryMeter("cpu")
    out: dict[str, object] = {"matrix_bytes": 512 * 256 * 4}
    for strategy, count in [("pad_all2all", 1), ("ragged_all_to_all", 1), ("agrs", 3)]:
        out[strategy] = _memory_case(meter, mesh, strategy, count)

    # balance: several remainder batches of different shapes, owners by Newton-Schulz cost
    shapes = [(8, 4)] * 3 + [(12, 4)] + [(16, 4)] * 2 + [(20, 4)] * 3 + [(24, 4)] * 5
    for strategy in ("agrs", "ragged_all_to_all", "pad_all2all"):
        opt = Muon(_sharded(shapes, mesh), remainder_strategy=strategy)
        opt.step()
        planned = sum(batch_cost.blocks_on(b, mp.fsdp_rank) for mp, bs in opt.plans for b in bs)
        out[f"balance/{strategy}"] = (
            opt.step_stats["muon/matrices"],
            planned,
            opt.plan.ns_flops_per_rank,
        )

    # the runtime never holds more than max_inflight batches
    opt = Muon(_sharded([(8, 4)] * 9 + [(12, 4)] * 5, mesh), max_inflight=2)
    seen = []
    real_run = AsyncRuntime.run

    def run(self):
        real_run(self)
        seen.append(self.peak_inflight)

    AsyncRuntime.run = run
    try:
        opt.step()
    finally:
        AsyncRuntime.run = real_run
    out["peak_inflight"] = seen[0]

    # auto: link constants measured at construction (the same on every rank), a choice per
    # remainder batch, visible in step_stats
    opt = Muon(_sharded(shapes, mesh), remainder_strategy="auto")
    opt.step()
    out["auto"] = (
        opt.plan.link,
        sorted({b.path for _, bs in opt.plans for b in bs}),
        {k: v for k, v in opt.step_stats.items() if k.endswith("/batches")},
    )

    # padding slots run no Newton-Schulz: one real matrix on W=4 is orthogonalized once
    calls: list[bool] = []
    real_orthogonalize = muon_task.orthogonalize

    def spy(m, **kw):
        calls.append(bool((m == 0).all()))
        return real_orthogonalize(m, **kw)

    muon_task.orthogonalize = spy
    try:
        opt = Muon(_sharded([(16, 8)], mesh), remainder_strategy="pad_all2all")
        opt.step()
    finally:
        muon_task.orthogonalize = real_orthogonalize
    out["pad_ns_calls"] = calls

    # a rank with a different parameter order fails with the fingerprint error instead of
    # hanging in a mismatched collective (a hang would end the world at its timeout: no clock)
    shapes = [(8, 4), (12, 4)] if rank != 1 else [(12, 4), (8, 4)]
    holder = _sharded(shapes, mesh)
    try:
        Muon(holder)
        out["fingerprint"] = None
    except RuntimeError as e:
        out["fingerprint"] = str(e)
    return out


def test_memory_balance_inflight_and_fingerprint():
    results = run_world(_behaviour_world, W, timeout_s=300)
    S = results[0]["matrix_bytes"]
    pad = [r["pad_all2all"][0] for r in results]
    assert min(pad) >= S, f"pad_all2all: every rank holds a full matrix; peaks {pad}, S={S}"
    ragged = [r["ragged_all_to_all"] for r in results]
    busy = [peak for peak, n in ragged if n > 0]
    idle = [peak for peak, n in ragged if n == 0]
    assert len(busy) == 1 and len(idle) == W - 1
    assert busy[0] >= S
    # idle ranks hold only their send and return shards (S/W each, here S/2 in all), never S
    assert max(idle) < 0.75 * S, f"ragged idle ranks must not allocate a full matrix: {idle}"
    agrs = [r["agrs"][0] for r in results]
    assert min(agrs) >= 3 * S, f"agrs: every rank holds all R=3 matrices; peaks {agrs}"
    from muon.cost import block_flops as ns_flops

    for strategy in ("agrs", "ragged_all_to_all", "pad_all2all"):
        counts = [r[f"balance/{strategy}"][0] for r in results]
        assert counts == [r[f"balance/{strategy}"][1] for r in results], strategy
        assert sum(counts) == 14  # every matrix orthogonalized once, padding slots never
        loads = results[0][f"balance/{strategy}"][2]
        assert all(r[f"balance/{strategy}"][2] == loads for r in results)  # same on every rank
        # LPT by cost: no rank more than the largest matrix's cost above the least loaded
        assert max(loads) - min(loads) <= ns_flops(24, 4, steps=5), (strategy, loads)
    assert all(r["peak_inflight"] == 2 for r in results)
    link, paths, batches = results[0]["auto"]
    assert all(r["auto"][0] == link for r in results)
    assert link.latency_s > 0 and link.bytes_per_s > 0
    assert paths == ["full", "ragged_all_to_all"]  # one full batch, five remainders on W=4
    assert batches == {"muon/full/batches": 1.0, "muon/ragged_all_to_all/batches": 5.0}
    calls = [c for r in results for c in r["pad_ns_calls"]]
    assert calls == [False], f"pad_all2all ran Newton-Schulz on padding slots: {calls}"
    for r in results:
        assert r["fingerprint"] and "different optimizer plans" in r["fingerprint"]


def _ns_shapes_world(expert_aware: bool, strategy: str):
    """Fused experts on (efsdp=2, ep=2): record every matrix shape Newton-Schulz sees."""
    mesh = init_mesh((2, 2), ("efsdp", "ep"))
    E, rows, cols = 4, 6, 5  # global [24, 5]; EP-local [12, 5]; blocks [6, 5]
    holder = nn.ParameterList()
    for _ in range(3):
        full = torch.randn(E * rows, cols)
        holder.append(nn.Parameter(distribute_tensor(full, mesh["ep"], [Shard(0)])))
    fully_shard(holder, mesh=mesh["efsdp"])
    for p in holder:
        p.grad = DTensor.from_local(
            torch.randn(p.to_local().shape),
            p.device_mesh,
            p.placements,
            shape=p.shape,
            stride=p.stride(),
        )
    seen = []
    real = muon_blocks.orthogonalize_blocks

    def spy(m, num_blocks, *args, **kwargs):
        seen.append((tuple(m.shape), num_blocks))
        return real(m, num_blocks, *args, **kwargs)

    muon_blocks.orthogonalize_blocks = spy
    try:
        opt = Muon(
            [{"params": list(holder), "num_blocks": E}],
            remainder_strategy=strategy,
            expert_aware=expert_aware,
        )
        opt.step()
    finally:
        muon_blocks.orthogonalize_blocks = real
    batch = opt.plans[0][1][-1]
    return seen, batch.path, batch.fsdp_visible_rows, batch_cost.collective_buffer_bytes(batch, 0)


def test_ns_sees_ep_local_blocks_and_agrs_buffer_from_fsdp_visible_dim():
    results = run_world(_ns_shapes_world, 4, False, "agrs", timeout_s=120)
    for seen, path, visible, buf in results:
        assert path == "agrs"
        assert visible == 12  # 24 global rows // ep 2
        # W=2 padded shards of 6 rows, one matrix; fp32 params travel in the bf16 NS dtype
        assert buf == 2 * 1 * 6 * 5 * 2
        for shape, blocks in seen:
            assert shape == (12, 5) and blocks == 2, seen  # EP-local matrix, 2 blocks of [6, 5]
    # the agrs batch of 3 is split 2+1 over efsdp=2... each rank owns some, so NS ran somewhere
    assert sum(len(r[0]) for r in results) >= 3
