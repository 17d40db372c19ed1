"""The step's muon/ns_s on a CUDA device: device time, not launches."""

import torch
from torch import nn

from muon import Muon, newton_schulz


def test_cuda_ns_time_is_device_time():
    """The step's muon/ns_s covers the device time of its Newton-Schulz, not only the launches:
    at least half the event-timed duration of the same call (launches alone take ~1% of it
    for an 8192 x 8192 bf16 block)."""
    w = nn.Parameter(torch.randn(8192, 8192, device="cuda"))
    opt = Muon([w], momentum=0.0, nesterov=False)
    w.grad = torch.randn_like(w)
    opt.step()  # warm-up: kernels compiled, workspaces allocated
    w.grad = torch.randn_like(w)
    torch.cuda.synchronize()
    opt.step()
    ns_s = opt.step_stats["muon/ns_s"]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    newton_schulz(w.grad, coefficients="polar_express", algorithm="auto")
    end.record()
    end.synchronize()
    assert ns_s >= 0.5 * start.elapsed_time(end) / 1e3, (ns_s, start.elapsed_time(end))
