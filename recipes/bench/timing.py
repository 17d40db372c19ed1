"""Timing that treats the variants alike: interleaved, order rotated, every rank in step.

Background load on a shared machine drifts over seconds; timing variant A's steps and then B's
would charge the drift to one of them. `rotations` visits the variants once per round in an
order rotated by one each round, so every variant runs in every position equally often;
`timed` measures one call between a barrier and a device synchronization (the slowest rank's
time is then the step's).
"""

from __future__ import annotations

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
