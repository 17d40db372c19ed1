"""The cost model: Newton-Schulz FLOPs of a block, and a latency/bandwidth model of a link.

One function, `muon.newton_schulz.ns_flops` (4·m²·n + 2·m³ per standard iteration on an m x n
block, m <= n; Gram Newton-Schulz counted as it arranges its products), is the Newton-Schulz
cost everywhere: the owner assignment balances it, the
dry-run planner reports it and the benchmark compares measured time against it; `block_flops`
is its integer form, so every rank sums loads exactly. `LinkModel` turns a collective's bytes
into seconds with two constants per backend, measured at construction with two tiny
collectives (`measure_link`) or given by the caller; `remainder_strategy="auto"` compares the
remainder strategies with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from muon.newton_schulz import effective_algorithm, ns_flops


def block_flops(rows: int, cols: int, *, steps: int, algorithm: str = "standard") -> int:
    """`ns_flops` of one `[rows, cols]` block as an exact integer, for the iteration that
    `newton_schulz(..., algorithm=algorithm)` runs on that shape (Gram only where cheaper)."""
    return round(
        ns_flops(rows, cols, steps, algorithm=effective_algorithm(rows, cols, steps, algorithm))
    )


@dataclass(frozen=True)
class LinkModel:
    """Time of one collective: `latency_s + bytes / bytes_per_s` (per rank, busiest rank's
    bytes), and Newton-Schulz time at `flops_per_s`; all three are per backend."""

    latency_s: float
    bytes_per_s: float
    flops_per_s: float

    def collective_s(self, nbytes: int) -> float:
        """Seconds for one collective in which the busiest rank sends `nbytes`."""
        return self.latency_s + nbytes / self.bytes_per_s

    def ns_s(self, flops: int) -> float:
        return flops / self.flops_per_s


#: Used where nothing can be measured (the fake backend of the dry-run planner): an H200 with
#: 400 Gb/s links, ~10 ms of bf16 Newton-Schulz for one 8192x6144 matrix
#: (`block_flops(8192, 6144, steps=5)` = 8.5 TFLOP at ~0.85 PFLOP/s), ~20 us per collective.
DEFAULT_LINKS: dict[str, LinkModel] = {
    "nccl": LinkModel(latency_s=20e-6, bytes_per_s=50e9, flops_per_s=0.85e15),
    "gloo": LinkModel(latency_s=200e-6, bytes_per_s=1e9, flops_per_s=20e9),
    "fake": LinkModel(latency_s=20e-6, bytes_per_s=50e9, flops_per_s=0.85e15),
}

_TINY_BYTES = 4
_SMALL_BYTES = 1 << 20


def measure_link(group, device: torch.device, *, repeats: int = 3) -> LinkModel:
    """Measure latency and bandwidth on `group` with two tiny all-reduces (4 B and 1 MiB).

    Collective: every rank of `group` must call it. The constants are the maximum over the
    group's ranks (one all-reduce of two floats), so every rank builds the same plan from them.
    Newton-Schulz throughput is not measured (it would cost a real NS call); it comes from
    `DEFAULT_LINKS` for the backend.
    """
    backend = dist.get_backend(group)
    default = DEFAULT_LINKS.get(backend, DEFAULT_LINKS["gloo"])
    if backend == "fake":
        return default
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(numel_bytes: int) -> float:
        x = torch.zeros(max(1, numel_bytes // 4), dtype=torch.float32, device=device)
        dist.all_reduce(x, group=group)  # warm-up: connection set-up is not latency
        sync()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    t_tiny, t_small = timed(_TINY_BYTES), timed(_SMALL_BYTES)
    both = torch.tensor([t_tiny, t_small], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    t_tiny, t_small = both.tolist()
    # an all-reduce moves about 2x its bytes per rank (ring: reduce-scatter + all-gather)
    bandwidth = 2 * (_SMALL_BYTES - _TINY_BYTES) / max(t_small - t_tiny, 1e-9)
    return LinkModel(latency_s=t_tiny, bytes_per_s=bandwidth, flops_per_s=default.flops_per_s)
