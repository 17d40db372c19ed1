"""Step timings (muon/stats.py): host time on CPU, CUDA events on CUDA.

On CUDA, launches and `work.wait()` return before the device is done, so host time would show
launch time; the CPU test checks the event logic with a stand-in event class, the GPU test the
figure against the device time of the same work."""

import importlib

import pytest
import torch
from torch import nn

from muon import Muon

stats_module = importlib.import_module("muon.stats")


class FakeEvent:
    """Stands in for torch.cuda.Event: each record() reads a fake device clock."""

    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None
        self.synced = False

    def record(self):
        FakeEvent.clock_ms += 7.0  # the device is 7 ms further on every record
        self.t = FakeEvent.clock_ms

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "elapsed_time read before the end event completed"
        return end.t - self.t


class Work:
    def wait(self):
        pass


def test_cuda_spans_are_timed_with_events(monkeypatch):
    """With a CUDA device each span is an event pair, read (after waiting for its end event)
    when the step's figures are taken: here 7 ms per span, whatever the host time."""
    made = []

    def event():
        made.append(FakeEvent(enable_timing=True))
        return made[-1]

    monkeypatch.setattr(stats_module, "_cuda_event", event)
    stats = stats_module.StepStats(torch.device("cuda", 0))
    stats.orthogonalize(lambda x: x * 2, torch.ones(2, 2), "local", 1)
    stats.orthogonalize(lambda x: x * 2, torch.ones(2, 2), "local", 1)
    stats.wait(Work())
    out = stats.as_dict()
    assert len(made) == 6 and all(e.t is not None for e in made)
    assert out["muon/ns_s"] == pytest.approx(2 * 7e-3)
    assert out["muon/wait_s"] == pytest.approx(7e-3)
    assert out["muon/local/matrices"] == 2.0


def test_cpu_spans_use_host_time(monkeypatch):
    def no_event():
        raise AssertionError("CPU tensors must not create CUDA events")

    monkeypatch.setattr(stats_module, "_cuda_event", no_event)
    w = nn.Parameter(torch.randn(64, 32))
    opt = Muon([w])
    w.grad = torch.randn(64, 32)
    opt.step()
    assert opt.step_stats["muon/ns_s"] > 0 and opt.step_stats["muon/wait_s"] == 0
