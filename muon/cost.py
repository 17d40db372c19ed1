"""The rank-independent cost model: what Newton-Schulz runs and costs and what a link costs.

- Newton-Schulz: `ns_flops` (4·m²·n + 2·m³ per standard iteration on an m x n block, m <= n;
  Gram Newton-Schulz counted as it arranges its products) and `effective_algorithm` (the
  iteration `muon.newton_schulz.newton_schulz` actually runs on a shape) are the cost
  everywhere: the kernel picks its iteration with them, the owner assignment balances
  `block_flops` (their integer form, so every rank sums loads exactly), the dry-run planner
  reports them and the benchmark compares measured time against them. `ns_block_bytes` is the
  iteration's workspace.
- What each path moves and holds is counted by the path object itself (`muon.paths`), next
  to its exchange; `ns_block_bytes` here is the Newton-Schulz workspace those figures use.
- `LinkModel` turns a collective's bytes into seconds with two constants per backend, measured
  at construction with two tiny collectives (`measure_link`) or given by the caller;
  `remainder_strategy="auto"` compares the remainder strategies with it.

This module reads plans by their fields only and imports no other muon module, so every
module may import it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# --------------------------------------------------------------------- Newton-Schulz algorithms
NS_ALGORITHMS = ("standard", "gram", "auto")
#: "auto" runs Gram Newton-Schulz only on blocks whose Gram matrix has at least this many rows:
#: smaller blocks are bound by the cost of each call, not by FLOPs, and Gram makes more calls
#: (plus its output check). `scripts/bench_newton_schulz.py` measures where Gram starts to pay on
#: 1:3 bf16 blocks (its "Where Gram starts to pay" table, docs/newton_schulz.md): since the
#: restarts every two steps and the output check, from 256 rows.
GRAM_MIN_ROWS = 256
#: Gram Newton-Schulz restarts before these steps (segments of 1, 2 and 2 steps of 5): in bf16,
#: with one restart (before step 2) the rounding of the R updates pushed 31-66 singular values
#: of condition-100 blocks above the band; restarting every two steps keeps them in it
#: (tests/unit/test_gram_band.py), at 0.83x the standard iteration's FLOPs at 1:3.
GRAM_RESTARTS = (1, 3)


def check_algorithm(algorithm: str) -> str:
    """Validate an `ns_algorithm` value; returns it."""
    if algorithm not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm: {algorithm!r} is not one of {', '.join(NS_ALGORITHMS)}")
    return algorithm


def restart_segments(steps: int, restarts: Sequence[int]) -> list[tuple[int, int]]:
    """Split steps 0..steps-1 into [first, last) runs at the restart points."""
    cuts = sorted({0, steps, *(r for r in restarts if 0 < r < steps)})
    return list(zip(cuts[:-1], cuts[1:], strict=False))


def _sym_fraction(m: int) -> float:
    """Share of an m x m product that `_mul(symmetric=True)` computes: the top h rows and the
    lower-right (m - h) x (m - h) block, h = m // 2."""
    h = m // 2
    return (h * m + (m - h) ** 2) / (m * m)


def ns_flops(
    rows: int,
    cols: int,
    steps: int = 5,
    *,
    algorithm: str = "standard",
    symmetric: bool = False,
    restarts: Sequence[int] = GRAM_RESTARTS,
) -> float:
    """Floating-point operations (2 per multiply-add) of one block's orthogonalization, counted
    the way `newton_schulz` arranges the products (without the fallback: "gram" is costed as
    Gram even where `newton_schulz` would run the standard iteration instead; resolve "auto"
    with `effective_algorithm` first)."""
    if check_algorithm(algorithm) == "auto":
        raise ValueError("ns_flops: resolve algorithm='auto' with effective_algorithm first")
    m, n = min(rows, cols), max(rows, cols)
    s = _sym_fraction(m) if symmetric else 1.0
    gram_xxt, square, apply_x = 2 * m * m * n * s, 2 * m**3 * s, 2 * m * m * n
    if algorithm == "standard":
        return steps * (gram_xxt + square + apply_x)
    total = 0.0
    for first, last in restart_segments(steps, restarts):
        length = last - first
        total += gram_xxt + apply_x  # R = X X^T at the start, X <- Q X at the end
        # each step: R^2; Q <- H Q (free on the segment's first step, Q = H); R <- H (H R)
        # (not on the segment's last step, whose R is never read)
        total += square * (length + (length - 1) + 2 * (length - 1))
    return total


def gram_is_cheaper(rows: int, cols: int, steps: int = 5, **kw) -> bool:
    """Whether Gram Newton-Schulz needs fewer FLOPs than the standard iteration for a block."""
    return ns_flops(rows, cols, steps, algorithm="gram", **kw) < ns_flops(
        rows, cols, steps, algorithm="standard", **{k: v for k, v in kw.items() if k != "restarts"}
    )


def effective_algorithm(
    rows: int, cols: int, steps: int = 5, algorithm: str = "standard", **kw
) -> str:
    """The iteration `newton_schulz(..., algorithm=algorithm)` runs on a `[rows, cols]` block:
    "gram" only where it needs fewer FLOPs (`kw`: symmetric, restarts), and for "auto" only on
    blocks of at least `GRAM_MIN_ROWS` rows and columns."""
    algorithm = check_algorithm(algorithm)
    if algorithm == "standard" or not gram_is_cheaper(rows, cols, steps, **kw):
        return "standard"
    if algorithm == "auto" and min(rows, cols) < GRAM_MIN_ROWS:
        return "standard"
    return "gram"


def block_flops(rows: int, cols: int, *, steps: int, algorithm: str = "standard") -> int:
    """`ns_flops` of one `[rows, cols]` block as an exact integer, for the iteration that
    `newton_schulz(..., algorithm=algorithm)` runs on that shape (Gram only where cheaper)."""
    return round(
        ns_flops(rows, cols, steps, algorithm=effective_algorithm(rows, cols, steps, algorithm))
    )


def ns_block_bytes(b, ns_itemsize: int) -> int:
    """Newton-Schulz temporaries of one block of batch `b`, output included, by the references
    `muon.newton_schulz` holds: the normalized input X0 (its caller keeps it for the whole
    call), the current X, and for the standard iteration the next X beside A = X X^T and
    B (3 X + 2 m^2), or the next A or B beside both of the last step's (2 X + 3 m^2); Gram
    Newton-Schulz keeps X0, a restarted X and the next one (Q X) beside R, K and Q
    (3 X + 3 m^2; measured: 256 x 768 bf16 blocks within 2% on CPU)."""
    rows, cols = b.block_shape
    x, sq = rows * cols, min(rows, cols) ** 2
    if effective_algorithm(rows, cols, b.ns_steps, b.ns_algorithm) == "gram":
        return (3 * x + 3 * sq) * ns_itemsize
    return max(3 * x + 2 * sq, 2 * x + 3 * sq) * ns_itemsize


# ------------------------------------------------------------------------ FLOPs of a batch
def batch_block_flops(b) -> int:
    """Newton-Schulz FLOPs of one `block_shape` block of batch `b`."""
    return block_flops(*b.block_shape, steps=b.ns_steps, algorithm=b.ns_algorithm)


def batch_blocks_flops(b, first: int = 0, count: int | None = None) -> int:
    """Newton-Schulz FLOPs of blocks first .. first+count-1 of one matrix of `b` (default all)."""
    heights = b.block_heights[first : None if count is None else first + count]
    if not b.split_sizes:
        return len(heights) * batch_block_flops(b)
    return sum(
        block_flops(h, b.block_cols, steps=b.ns_steps, algorithm=b.ns_algorithm) for h in heights
    )


def ns_flops_on(b, r: int) -> int:
    """Newton-Schulz FLOPs FSDP rank `r` spends on batch `b`."""
    if not b.split_sizes:
        return sum(count for _, _, count in b.units_on(r)) * batch_block_flops(b)
    return sum(batch_blocks_flops(b, f, c) for _, f, c in b.units_on(r))


# ------------------------------------------------------------------------------- the link
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
