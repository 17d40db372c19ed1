"""recipes.memory on a CUDA device: regions and spans from the allocator's statistics."""

from __future__ import annotations

import torch

from recipes.memory import MemoryMeter, MiB
from tests.unit.test_memory import close_to, tensor_of_bytes


# -- CUDA ---------------------------------------------------------------------------------
def test_cuda_regions_and_span():
    device = torch.device("cuda", torch.cuda.current_device())
    meter = MemoryMeter("cuda")
    assert meter.device == device
    with meter.measure() as m:
        assert not torch._C._autograd._profiler_enabled()  # CUDA reads allocator stats
        with m.region("alloc"):
            kept = tensor_of_bytes(8 * MiB, device)
        with m.region("seq"):
            for _ in range(3):
                t = tensor_of_bytes(4 * MiB, device)
                t.fill_(1)
                del t
        with m.region("outer"):
            with m.region("inner"):
                c = tensor_of_bytes(16 * MiB, device)
                del c
            d = tensor_of_bytes(2 * MiB, device)
            del d
    # The caching allocator counts whole blocks: sizes here are multiples of 2 MiB, so exact
    # unless a cached block is reused unsplit; allow the usual tolerance.
    assert close_to(m.peak_delta_bytes("alloc"), 8 * MiB), m
    assert close_to(m.peak_delta_bytes("seq"), 4 * MiB), m
    assert close_to(m.peak_delta_bytes("inner"), 16 * MiB), m
    assert close_to(m.peak_delta_bytes("outer"), 16 * MiB), m
    assert close_to(m.peak_delta_bytes(), 24 * MiB), m  # kept + c
    assert m.peak_bytes() == m.peak_bytes("inner") >= m.peak_delta_bytes()
    assert close_to(m.end_bytes() - m.start_bytes(), 8 * MiB), m
    assert m.start_bytes() == m.start_bytes("alloc")
    assert m.end_bytes() == torch.cuda.memory_allocated(device)
    del kept
