"""recipes.memory in a 2-rank world: per-rank peaks, busy vs idle ranks, receive buffers."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from recipes.memory import MemoryMeter, MiB
from recipes.ranks import gather_peaks, rank_metrics
from tests.harness import run_world
from tests.unit.test_memory import TOL


# -- a 2-rank gloo world ------------------------------------------------------------------
def _world_busy_rank_and_collectives() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    meter = MemoryMeter("cpu")
    send = torch.full((8 * MiB // 4,), float(rank))  # 8 MiB fp32
    shard = torch.full((4 * MiB // 4,), float(rank))  # 4 MiB fp32
    with meter.measure() as m:
        with m.region("optim"):
            if rank == 0:  # the busy rank holds a full-matrix buffer for a while
                full = torch.ones(32 * MiB, dtype=torch.uint8)
                del full
        # Receive buffers are kept until the span ends, so no free races with gloo's threads.
        with m.region("all_to_all"):
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send)
        with m.region("all_to_all_async"):
            recv_async = torch.empty_like(send)
            dist.all_to_all_single(recv_async, send, async_op=True).wait()
        with m.region("all_gather"):
            gathered = torch.empty(world * shard.numel())
            with warnings.catch_warnings():  # deprecated in favour of all_gather_single
                warnings.simplefilter("ignore", FutureWarning)
                dist.all_gather_into_tensor(gathered, shard)
    half = send.numel() // world
    expected_recv = torch.cat([torch.full((half,), float(r)) for r in range(world)])
    assert torch.equal(recv, expected_recv) and torch.equal(recv_async, expected_recv)
    assert torch.equal(gathered.view(world, -1)[:, 0], torch.arange(world, dtype=torch.float32))
    return {"peaks": gather_peaks(m.summary()), "span_start": m.start_bytes()} | {
        f"{r}_peak": m.peak_bytes(r) for r in m.regions
    }


def test_two_rank_world_busy_vs_idle_and_receive_buffers():
    ranks = run_world(_world_busy_rank_and_collectives, 2)
    peaks = ranks[0]["peaks"]
    assert len(peaks) == 2 and ranks[1]["peaks"] == peaks  # every rank gets the gather
    busy, idle = peaks
    assert busy["optim_peak_delta_mib"] == pytest.approx(32.0, rel=TOL)
    assert idle["optim_peak_delta_mib"] < 0.5
    metrics = rank_metrics(peaks)
    assert metrics["memory/rank_0/optim_peak_mib"] - metrics[
        "memory/rank_1/optim_peak_mib"
    ] == pytest.approx(32.0, rel=TOL)
    for rank, out in enumerate(ranks):
        # Measured from the quiet span start, the receive buffers pile up: 8, 8, 8 MiB.
        a2a = (out["all_to_all_peak"] - out["span_start"]) / MiB
        a2a_async = (out["all_to_all_async_peak"] - out["span_start"]) / MiB
        gather = (out["all_gather_peak"] - out["span_start"]) / MiB
        assert a2a == pytest.approx(8.0, abs=0.5), (rank, peaks[rank])
        assert a2a_async == pytest.approx(16.0, abs=0.5), (rank, peaks[rank])
        # all_gather_into_tensor: the 8 MiB receive buffer (+ gloo's flat staging copy, 8 MiB).
        assert 24.0 - 0.5 <= gather <= 32.0 + 0.5, (rank, peaks[rank])
        assert peaks[rank]["all_to_all_peak_delta_mib"] == pytest.approx(8.0, abs=0.5)
        assert peaks[rank]["all_gather_peak_delta_mib"] >= 8.0 - 0.5
