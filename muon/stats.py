"""Per-step counters of one rank: bytes per path, blocks orthogonalized, batches per path, and
the time spent in Newton-Schulz and in waiting for collectives (`Muon.step_stats`).

Times on CPU are host time (`time.perf_counter`). On CUDA, kernels and collective waits are
asynchronous: the host returns from a launch (or from `work.wait()`, which only makes the
current stream wait) long before the device is done, so each span is timed with a pair of CUDA
events on the current stream instead, and `as_dict` (once per step) waits for the last event.
`muon/ns_s` is then device time in Newton-Schulz and `muon/wait_s` the time the stream stood
waiting for collectives.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

import torch


def _cuda_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class StepStats:
    """Counters of one optimizer step on this rank; `device` picks host or CUDA-event timing."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_recv: dict[str, int] = defaultdict(int)
        self.matrices: dict[str, int] = defaultdict(int)
        self.batches: dict[str, int] = defaultdict(int)
        self.ns_s = 0.0
        self.wait_s = 0.0
        self.cuda = device is not None and torch.device(device).type == "cuda"
        #: (attribute, start event, end event) of the CUDA spans not yet read
        self._events: list[tuple[str, object, object]] = []

    @contextmanager
    def _span(self, attribute: str):
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            setattr(self, attribute, getattr(self, attribute) + time.perf_counter() - t0)
            return
        start, end = _cuda_event(), _cuda_event()
        start.record()
        yield
        end.record()
        self._events.append((attribute, start, end))

    def moved(self, path: str, *, sent: int, recv: int) -> None:
        self.bytes_sent[path] += sent
        self.bytes_recv[path] += recv

    def wait(self, work) -> None:
        with self._span("wait_s"):
            work.wait()

    def orthogonalize(
        self, fn: Callable, x: torch.Tensor, path: str, blocks: int, units: list | None = None
    ) -> torch.Tensor:
        """`fn(x)`, or `fn(x, units=units)` when given (whose blocks `x` holds), timed, counting
        `blocks` orthogonalized on `path`."""
        with self._span("ns_s"):
            out = fn(x) if units is None else fn(x, units=units)
        self.matrices[path] += blocks
        return out

    def _read_events(self) -> None:
        for attribute, start, end in self._events:
            end.synchronize()
            setattr(self, attribute, getattr(self, attribute) + start.elapsed_time(end) / 1e3)
        self._events.clear()

    def as_dict(self) -> dict[str, float]:
        """The counters as flat `muon/...` floats (on CUDA, after the step's events)."""
        self._read_events()
        out: dict[str, float] = {}
        for path in sorted(set(self.bytes_sent) | set(self.matrices) | set(self.batches)):
            out[f"muon/{path}/bytes_sent"] = float(self.bytes_sent[path])
            out[f"muon/{path}/bytes_recv"] = float(self.bytes_recv[path])
            out[f"muon/{path}/matrices"] = float(self.matrices[path])
            out[f"muon/{path}/batches"] = float(self.batches[path])
        out["muon/bytes_sent"] = float(sum(self.bytes_sent.values()))
        out["muon/bytes_recv"] = float(sum(self.bytes_recv.values()))
        out["muon/matrices"] = float(sum(self.matrices.values()))
        out["muon/ns_s"] = self.ns_s
        out["muon/wait_s"] = self.wait_s
        return out
