"""Timing that treats the variants alike: interleaved, order rotated, every rank in step.

Background load on a shared machine drifts over seconds; timing variant A's steps and then B's
would charge the drift to one of them. `rotations` visits the variants once per round in an
order rotated by one each round, so every variant runs in every position equally often;
`timed` measures one call between a barrier and a device synchronization (the slowest rank's
time is then the step's). `calibrated_medians` times single-process calls (one block of a
batch) on `block_clock`'s clock, each sample long enough that the clock's noise does not count.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence


def rotations(names: Sequence[str], rounds: int) -> Iterator[str]:
    """`names` `rounds` times, round i starting at the i-th name (mod len)."""
    names = list(names)
    for i in range(rounds):
        k = i % len(names)
        yield from names[k:] + names[:k]


def timed(fn: Callable[[], object], *, sync: Callable[[], None] | None = None) -> float:
    """Seconds `fn()` takes; with a process group, all ranks start together (a barrier), and
    `sync` (e.g. torch.cuda.synchronize) brackets the call so queued device work counts."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    if sync:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    return time.perf_counter() - t0


def interleaved(
    fns: dict[str, Callable[[], object]],
    rounds: int,
    *,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Each function's seconds per call over `rounds` interleaved, rotated rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in rotations(list(fns), rounds):
        times[name].append(timed(fns[name], sync=sync))
    return times


def peak_bytes(meter, fn: Callable[[], object], repeats: int, *, sync=None) -> int:
    """The largest `peak_delta_bytes` of `fn()` over `repeats` calls, each measured by `meter`
    (a recipes.memory.MemoryMeter) with every rank starting together."""
    import torch.distributed as dist

    peak = 0
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        if sync:
            sync()
        with meter.measure() as m, m.region("step"):
            fn()
            if sync:
                sync()
        peak = max(peak, m.peak_delta_bytes("step"))
    return peak


def block_clock(device: str) -> Callable[[], float]:
    """The clock of single-process timings: CPU process time (of one thread when torch runs one,
    so other load on the machine does not enter), or synchronized wall time on CUDA."""
    if device == "cpu":
        return time.process_time

    def wall() -> float:
        import torch

        torch.cuda.synchronize()
        return time.perf_counter()

    return wall


def calibrated_medians(
    clock: Callable[[], float], fns: dict[str, Callable[[], object]], repeats: int, per_call: int
) -> dict[str, float]:
    """Median seconds per block of each function (`per_call` blocks a call), in `repeats`
    interleaved rounds; each sample repeats the call until it lasts ~50 ms per function (short
    samples are dominated by the clock's and the allocator's noise)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    t0 = clock()
    for f in fns.values():  # warm-up
        f()
    calls = max(1, math.ceil(0.05 * len(fns) / max(clock() - t0, 1e-9)))
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = clock()
            for _ in range(calls):
                f()
            times[k].append((clock() - t0) / (per_call * calls))
    return {k: statistics.median(v) for k, v in times.items()}
