"""recipes.memory on one process: peak memory on CPU (the profiler counter) and the CUDA
bookkeeping (a fake allocator)."""

from __future__ import annotations

import ctypes
import gc
import threading

import pytest
import torch
import torch.distributed as dist

from recipes import memory
from recipes.memory import MemoryMeter, MiB
from recipes.ranks import gather_peaks, rank_metrics

TOL = 0.02  # relative tolerance on figures that should be exact sizes


def tensor_of_bytes(n: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device=device)


def close_to(value: int, expected: int, tol: float = TOL) -> bool:
    return abs(value - expected) <= tol * expected


# -- single process, CPU --------------------------------------------------------------------
def test_region_delta_of_a_known_tensor():
    meter = MemoryMeter("cpu")
    with meter.measure() as m, m.region("alloc"):
        kept = tensor_of_bytes(8 * MiB)
    assert close_to(m.peak_delta_bytes("alloc"), 8 * MiB), m
    assert close_to(m.end_bytes("alloc") - m.start_bytes("alloc"), 8 * MiB), m
    assert m.peak_bytes("alloc") >= m.peak_delta_bytes("alloc")
    assert m.peak_bytes() >= m.peak_delta_bytes() >= m.peak_delta_bytes("alloc")
    # The tensor is alive after the span: the absolute counter includes it.
    assert m.end_bytes() >= 8 * MiB
    del kept


def test_sequential_allocations_peak_at_one_not_their_sum():
    meter = MemoryMeter("cpu")
    with meter.measure() as m, m.region("seq"):
        for _ in range(3):
            t = tensor_of_bytes(4 * MiB)
            t.fill_(1)
            del t
    assert close_to(m.peak_delta_bytes("seq"), 4 * MiB), m
    assert close_to(m.peak_delta_bytes(), 4 * MiB), m
    assert abs(m.end_bytes() - m.start_bytes()) < 64 * 1024, m


def test_nested_and_repeated_regions_are_consistent():
    meter = MemoryMeter("cpu")
    with meter.measure("train") as m:
        a = tensor_of_bytes(2 * MiB)
        with m.region("outer"):
            b = tensor_of_bytes(4 * MiB)
            with m.region("inner"):
                c = tensor_of_bytes(8 * MiB)
                del c
            d = tensor_of_bytes(1 * MiB)
        for size in (1 * MiB, 3 * MiB):
            with m.region("again"):
                e = tensor_of_bytes(size)
                del e
        del a, b, d
    assert m.regions == ["outer", "inner", "again"]
    assert close_to(m.peak_delta_bytes("inner"), 8 * MiB), m
    assert close_to(m.peak_delta_bytes("outer"), 12 * MiB), m  # b + c
    assert close_to(m.peak_delta_bytes(), 14 * MiB), m  # a + b + c
    assert close_to(m.peak_delta_bytes("again"), 3 * MiB), m  # the larger entry
    assert close_to(m.start_bytes("inner") - m.start_bytes("outer"), 4 * MiB), m
    assert close_to(m.end_bytes("outer") - m.start_bytes("outer"), 5 * MiB), m
    assert m.peak_bytes() == m.peak_bytes("outer") == m.peak_bytes("inner"), m
    assert m.peak_bytes("again") < m.peak_bytes("outer")
    for region in (None, "outer", "inner", "again"):
        assert m.peak_bytes(region) >= m.peak_delta_bytes(region) >= 0
        assert m.peak_bytes(region) >= max(m.start_bytes(region), m.end_bytes(region))
    summary = m.summary()
    assert set(summary) == {
        f"{k}_{f}"
        for k in ("train", "outer", "inner", "again")
        for f in ("peak_mib", "peak_delta_mib")
    }
    assert summary["inner_peak_delta_mib"] == pytest.approx(8.0, rel=TOL)


def test_tensors_of_a_marker_size_do_not_confuse_the_boundaries():
    meter = MemoryMeter("cpu")
    # Boundary markers 0..3 of this span: span start, region start, region end, span end.
    sizes = [memory.marker_bytes(i) for i in range(4)]
    with meter.measure() as m:
        # same size as the region-start marker, allocated before it
        early = tensor_of_bytes(sizes[1])
        with m.region("r"):
            decoy = tensor_of_bytes(sizes[2])  # same size as the region-end marker, freed later
            big = tensor_of_bytes(4 * MiB)
            del decoy
            kept = tensor_of_bytes(sizes[3])  # same size as the span-end marker, kept
        del big
    assert close_to(m.peak_delta_bytes("r"), 4 * MiB + sizes[2]), m
    assert m.end_bytes("r") - m.start_bytes("r") == 4 * MiB + sizes[3], m
    assert m.start_bytes("r") - m.start_bytes() == sizes[1], m
    del early, kept


def test_free_on_another_thread_is_not_retained():
    """Buffers freed or allocated on a worker thread are counted (c10's report flag is set)."""
    lib = ctypes.CDLL(memory.libc10_path())
    meter = MemoryMeter("cpu")
    assert meter.cpu_tracking
    assert ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value

    def span():
        gc.collect()  # no unrelated garbage freed inside the span
        with meter.measure() as m:
            box = [tensor_of_bytes(16 * MiB)]  # allocated here, freed on the worker
            out = []

            def worker():
                box.clear()
                out.append(tensor_of_bytes(24 * MiB))  # allocated on the worker, freed here

            t = threading.Thread(target=worker)
            t.start()
            t.join()
            out.clear()
        return m

    spans = [span() for _ in range(3)]
    for m in spans:
        # The 24 MiB peak shows only in the free event's "counter before the free".
        assert close_to(m.peak_delta_bytes(), 24 * MiB), m
        assert abs(m.end_bytes() - m.start_bytes()) < 64 * 1024, m
    # Without the flag each span would start 16 MiB higher than the one before.
    assert abs(spans[2].start_bytes() - spans[0].start_bytes()) < 64 * 1024


def test_misuse_is_reported_and_a_failed_span_cleans_up():
    meter = MemoryMeter("cpu")
    m = meter.measure()
    with pytest.raises(RuntimeError, match="inside"), m.region("x"):
        pass
    with m:
        with pytest.raises(RuntimeError, match="after"):
            m.peak_bytes()
        with pytest.raises(RuntimeError, match="another profiler"), meter.measure():
            pass
        errors = []

        def other_thread():
            try:
                with m.region("x"):
                    pass
            except RuntimeError as err:
                errors.append(err)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert errors and "thread" in str(errors[0])
    with pytest.raises(KeyError, match="no region"):
        m.peak_bytes("missing")
    with pytest.raises(RuntimeError, match="only once"), m:
        pass
    with pytest.raises(ValueError, match="boom"), meter.measure() as failed:
        raise ValueError("boom")
    with pytest.raises(RuntimeError, match="failed"):
        failed.peak_bytes()
    assert not torch._C._autograd._profiler_enabled()
    with meter.measure() as again:  # the profiler was stopped: a new span works
        tensor_of_bytes(MiB)
    assert close_to(again.peak_delta_bytes(), MiB)
    with pytest.raises(ValueError, match="cpu and cuda"):
        MemoryMeter("meta")


def test_gather_peaks_without_a_process_group():
    assert not dist.is_initialized()
    peaks = gather_peaks({"step_peak_mib": 3, "optim_peak_mib": 2.5})
    assert peaks == [{"step_peak_mib": 3.0, "optim_peak_mib": 2.5}]
    assert rank_metrics(peaks) == {
        "memory/rank_0/step_peak_mib": 3.0,
        "memory/rank_0/optim_peak_mib": 2.5,
    }


# -- CUDA bookkeeping, checked on CPU with a simulated allocator -----------------------------
class _FakeCudaAllocator:
    """Just the statistics the meter reads: allocated bytes and their peak since the reset."""

    def __init__(self, allocated: int) -> None:
        self.allocated = self.peak = allocated

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def memory_allocated(self, device=None) -> int:
        return self.allocated


def test_cuda_bookkeeping_folds_peaks_across_region_resets(monkeypatch):
    fake = _FakeCudaAllocator(allocated=100 * MiB)
    for name in ("reset_peak_memory_stats", "max_memory_allocated", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    fake.alloc(50 * MiB)  # a peak before the span is not the span's
    fake.free(50 * MiB)
    meter = MemoryMeter("cuda:0")
    with meter.measure() as m:
        fake.alloc(6 * MiB)  # transient before any region: only the span sees it
        fake.free(6 * MiB)
        with m.region("outer"):
            fake.alloc(4 * MiB)
            with m.region("inner"):
                fake.alloc(2 * MiB)
                fake.free(2 * MiB)
            fake.alloc(1 * MiB)
        with m.region("after"):
            fake.free(5 * MiB)
    assert m.start_bytes() == 100 * MiB and m.end_bytes() == 100 * MiB
    assert m.peak_bytes() == 106 * MiB and m.peak_delta_bytes() == 6 * MiB
    assert m.peak_bytes("outer") == 106 * MiB and m.peak_delta_bytes("outer") == 6 * MiB
    assert m.peak_bytes("inner") == 106 * MiB and m.peak_delta_bytes("inner") == 2 * MiB
    assert m.start_bytes("inner") == 104 * MiB and m.end_bytes("outer") == 105 * MiB
    assert m.peak_bytes("after") == 105 * MiB and m.peak_delta_bytes("after") == 0
