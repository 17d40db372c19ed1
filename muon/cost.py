"""The cost model, in one place: what Newton-Schulz runs and costs, what each path moves and
holds, what a link costs, and the step's sliding-window memory bound.

- Newton-Schulz: `ns_flops` (4·m²·n + 2·m³ per standard iteration on an m x n block, m <= n;
  Gram Newton-Schulz counted as it arranges its products) and `effective_algorithm` (the
  iteration `muon.newton_schulz.newton_schulz` actually runs on a shape) are the cost
  everywhere: the kernel picks its iteration with them, the owner assignment balances
  `block_flops` (their integer form, so every rank sums loads exactly), the dry-run planner
  reports them and the benchmark compares measured time against them. `ns_block_bytes` is the
  iteration's workspace.
- Per path: the functions of a `muon.plan.BatchPlan` and an FSDP rank below (`blocks_on`,
  `bytes_sent`, `collective_buffer_bytes`, `exchange_buffer_bytes`, `ns_workspace_bytes`,
  `peak_bytes`, `modelled_s`) count, from the plan alone, what the path's exchange in
  `muon.comm` does; the tests check each figure against the real step.
- `LinkModel` turns a collective's bytes into seconds with two constants per backend, measured
  at construction with two tiny collectives (`measure_link`) or given by the caller;
  `remainder_strategy="auto"` compares the remainder strategies with it.
- `window_peak_bytes`: the largest sum of per-batch peaks over `max_inflight` consecutive
  batches (the runtime keeps that many alive), which the dry-run planner and the whole-step
  estimate (`recipes.step_memory`) both report.

This module reads plans by their fields only and imports neither `muon.plan` nor `muon.comm`,
so both may import it.
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
    """Newton-Schulz temporaries of one block of batch `b`: X and the next X, plus the square
    m x m matrices alive at once: A = X X^T and B for the standard iteration; Gram
    Newton-Schulz keeps two more (R and Q; `recipes.memory` measures +2 m^2 on bf16 256 x 768
    and 64 x 192 blocks)."""
    rows, cols = b.block_shape
    small = min(rows, cols)
    squares = 4 if effective_algorithm(rows, cols, b.ns_steps, b.ns_algorithm) == "gram" else 2
    return (2 * rows * cols + squares * small * small) * ns_itemsize


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
        return blocks_on(b, r) * batch_block_flops(b)
    return sum(batch_blocks_flops(b, f, c) for _, f, c in b.units_on(r))


# -------------------------------------------------------------------------- bytes per path
# Layout legend (as in `muon.comm`): a shard is `[rows_r, C]`, rows the sharded dim; a unit is
# what one owner assembles, `[N, C]`; W is the exchange group's size, n the batch size,
# p = ceil(N / W) * C * itemsize a padded shard.
class _LocalCost:
    """No communication: each rank orthogonalizes its own blocks, one parameter at a time."""

    collectives = 0

    def blocks_on(self, b, r: int) -> int:
        return b.size * b.unit_blocks(r)[1]

    def bytes_sent(self, b, r: int) -> int:
        return 0

    def collective_buffer_bytes(self, b, r: int) -> int:
        return 0

    def exchange_buffer_bytes(self, b, r: int) -> int:
        return 0

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        blocks = self.blocks_on(b, r) // max(1, b.size)
        if not blocks:
            return 0
        # one parameter's blocks at a time, plus its NS output until applied
        rows = b.shard_sizes[r if b.fsdp_size > 1 else 0]
        return blocks * ns_block_bytes(b, ns_itemsize) + rows * b.other_numel * b.itemsize


class _OwnerAllToAllCost:
    """all_to_all_single with per-rank split sizes (full, ragged remainder, sub-group): each
    rank sends its rows of the n units it holds to their owners, and an owner receives the
    other rows of each unit it owns, in the exchange group's coordinates (`exchange_view`)."""

    collectives = 2

    def _figures(self, b, r: int) -> tuple[int, int, int, int, int]:
        """Bytes on the wire dtype: (my rows of one unit, units held here that others own,
        units I own, bytes of the units I own, of those the bytes other ranks hold)."""
        view = b.exchange_view(r)
        row = b.other_numel * b.wire_itemsize
        mine = view.sizes[view.me] * row
        owned = view.owned()
        owned_bytes = sum(view.unit_rows(u) for u in owned) * row
        own_rows = sum(view.me in view.holders(u) for u in owned) * mine
        away = sum(o != view.me for o in view.held)
        return mine, away, len(owned), owned_bytes, owned_bytes - own_rows

    def blocks_on(self, b, r: int) -> int:
        return self._figures(b, r)[2] * b.blocks_per_unit

    def bytes_sent(self, b, r: int) -> int:
        # my rows of each unit owned elsewhere; each owned unit's other rows back
        mine, away, _, _, others = self._figures(b, r)
        return mine * away + others

    def collective_buffer_bytes(self, b, r: int) -> int:
        # the owned units arrive whole; the return lands in the send buffer
        mine, _, _, owned_bytes, _ = self._figures(b, r)
        return max(owned_bytes, b.size * mine)

    def exchange_buffer_bytes(self, b, r: int) -> int:
        # send (later the return) + received units + NS output; several units are also
        # gathered into one contiguous input
        mine, _, owned, owned_bytes, _ = self._figures(b, r)
        return b.size * mine + (2 if owned == 1 else 3) * owned_bytes

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        return self.blocks_on(b, r) * ns_block_bytes(b, ns_itemsize)


def _padded(b) -> int:
    return b.padded_shard_rows * b.other_numel * b.wire_itemsize


class _PadAllToAllCost:
    """The batch padded to W matrices of c-row shards: flat in R, the same on every rank."""

    collectives = 2

    def blocks_on(self, b, r: int) -> int:
        return b.num_blocks if r in b.owners else 0

    def bytes_sent(self, b, r: int) -> int:
        return 2 * _padded(b) * (b.fsdp_size - 1)

    def collective_buffer_bytes(self, b, r: int) -> int:
        return b.fsdp_size * _padded(b)

    def exchange_buffer_bytes(self, b, r: int) -> int:
        # send (later the return) + received slab + an owner's NS output copied back into it
        return 2 * b.fsdp_size * _padded(b) + (b.matrix_bytes if r in b.owners else 0)

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        return self.blocks_on(b, r) * ns_block_bytes(b, ns_itemsize)


class _AgrsCost:
    """All-gather the batch, orthogonalize the owned share, reduce-scatter: grows with n."""

    collectives = 2

    def _owned(self, b, r: int) -> int:
        return sum(o == r for o in b.owners)

    def blocks_on(self, b, r: int) -> int:
        return self._owned(b, r) * b.num_blocks

    def bytes_sent(self, b, r: int) -> int:
        # all-gather my padded shards to W-1 peers; reduce-scatter W-1 padded shards back
        return 2 * b.size * _padded(b) * (b.fsdp_size - 1)

    def collective_buffer_bytes(self, b, r: int) -> int:
        return b.fsdp_size * b.size * _padded(b)

    def exchange_buffer_bytes(self, b, r: int) -> int:
        # send (later the reduce-scatter output) + gathered (later its input) + owned results
        n, w = b.size, b.fsdp_size
        return n * _padded(b) * (1 + w) + self._owned(b, r) * b.matrix_bytes

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        return (b.num_blocks if self._owned(b, r) else 0) * ns_block_bytes(b, ns_itemsize)


#: the cost of each path of `muon.plan.PATHS`, counted from what its `muon.comm` exchange does
PATH_COSTS = {
    "local": _LocalCost(),
    "subgroup": _OwnerAllToAllCost(),
    "full": _OwnerAllToAllCost(),
    "ragged_all_to_all": _OwnerAllToAllCost(),
    "pad_all2all": _PadAllToAllCost(),
    "agrs": _AgrsCost(),
}


def blocks_on(b, r: int) -> int:
    """Blocks FSDP rank `r` orthogonalizes for batch `b`."""
    return PATH_COSTS[b.path].blocks_on(b, r)


def bytes_sent(b, r: int) -> int:
    """Bytes FSDP rank `r` sends for batch `b`, both directions, counted from the plan."""
    return PATH_COSTS[b.path].bytes_sent(b, r)


def collective_buffer_bytes(b, r: int) -> int:
    """Bytes of the largest receive buffer one collective of batch `b` allocates on rank `r`."""
    return PATH_COSTS[b.path].collective_buffer_bytes(b, r)


def exchange_buffer_bytes(b, r: int) -> int:
    """Peak bytes of batch `b`'s exchange buffers alive at once on rank `r` (NS inputs
    included)."""
    return PATH_COSTS[b.path].exchange_buffer_bytes(b, r)


def ns_workspace_bytes(b, r: int, ns_itemsize: int) -> int:
    """Rough peak Newton-Schulz temporaries for what rank `r` orthogonalizes at once."""
    return PATH_COSTS[b.path].ns_workspace_bytes(b, r, ns_itemsize)


def nesterov_input_bytes(b, r: int, nesterov: bool) -> int:
    """NS input the step allocates outside the exchange buffers: on the local path, Nesterov's
    `grad.lerp(buf)` of the one parameter being stepped, in the parameter's dtype (exchanges
    write their inputs straight into the send buffer, which `exchange_buffer_bytes` counts)."""
    if b.path != "local" or not nesterov:
        return 0
    rows = b.shard_sizes[r] if b.fsdp_size > 1 else b.fsdp_visible_rows
    return rows * b.other_numel * b.itemsize


def peak_bytes(b, r: int, ns_itemsize: int, *, nesterov: bool = False) -> int:
    """Planned peak bytes of batch `b` on FSDP rank `r`: the local path's Nesterov input (with
    `nesterov`) + exchange buffers + Newton-Schulz workspace."""
    return (
        nesterov_input_bytes(b, r, nesterov)
        + exchange_buffer_bytes(b, r)
        + ns_workspace_bytes(b, r, ns_itemsize)
    )


def window_peak_bytes(plans, *, ns_itemsize: int, nesterov: bool, max_inflight: int) -> int:
    """The largest sum of per-batch `peak_bytes` over `max_inflight` consecutive batches of
    `plans` (`[(mesh plan, batches)]`, seen from each mesh plan's `fsdp_rank`): the runtime keeps
    that many batches alive. 0 without batches."""
    peaks = [
        peak_bytes(b, mp.fsdp_rank, ns_itemsize, nesterov=nesterov)
        for mp, batches in plans
        for b in batches
    ]
    k = max(1, max_inflight)
    return max((sum(peaks[i : i + k]) for i in range(max(1, len(peaks) - k + 1))), default=0)


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


def modelled_s(b, link: LinkModel, ranks=None) -> float:
    """Modelled time of batch `b`'s collectives, from the busiest rank's bytes (of `ranks`,
    default all)."""
    ranks = range(b.fsdp_size) if ranks is None else ranks
    per_collective = max(bytes_sent(b, r) for r in ranks) / 2
    return PATH_COSTS[b.path].collectives * link.collective_s(int(per_collective))
