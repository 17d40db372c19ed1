"""Per-step counters of one rank: bytes per path, blocks orthogonalized, batches per path, and
the time spent in Newton-Schulz and in waiting for collectives (`Muon.step_stats`)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch


class StepStats:
    """Counters of one optimizer step on this rank."""

    def __init__(self) -> None:
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_recv: dict[str, int] = defaultdict(int)
        self.matrices: dict[str, int] = defaultdict(int)
        self.batches: dict[str, int] = defaultdict(int)
        self.ns_s = 0.0
        self.wait_s = 0.0

    def moved(self, path: str, *, sent: int, recv: int) -> None:
        self.bytes_sent[path] += sent
        self.bytes_recv[path] += recv

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - t0

    def orthogonalize(
        self, fn: Callable, x: torch.Tensor, units: list, path: str, blocks: int
    ) -> torch.Tensor:
        """`fn(x, units=units)`, timed, counting `blocks` orthogonalized on `path`."""
        t0 = time.perf_counter()
        out = fn(x, units=units)
        self.ns_s += time.perf_counter() - t0
        self.matrices[path] += blocks
        return out

    def as_dict(self) -> dict[str, float]:
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
