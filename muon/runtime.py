"""AsyncTask / AsyncRuntime: a few batches in flight so communication overlaps compute.

An AsyncTask is a generator: it launches a collective with `async_op=True` and yields; resumed,
it waits, computes, launches the return collective and yields again; resumed once more, it
applies its result and stops. The runtime keeps a sliding window of at most `max_inflight` live
tasks: a new task is created (lazily, so the buffers of batches not yet started are never
allocated) and launched - run to its first collective - as soon as a slot frees, before any
other task resumes, so the window never drains between waves. Live tasks are resumed
round-robin. Every rank creates and resumes tasks in the same order, so collectives on a process
group are issued in the same order on every rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable

AsyncTask = Generator[None, None, object]


class AsyncRuntime:
    """Drive tasks to completion with a bounded number alive at once."""

    def __init__(self, tasks: Iterable[AsyncTask], *, max_inflight: int = 3) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        self._tasks = iter(tasks)
        self.max_inflight = max_inflight
        #: the most tasks that were alive at once during `run` (for tests and logging)
        self.peak_inflight = 0

    def run(self) -> None:
        live: deque[AsyncTask] = deque()

        def fill() -> None:
            """Launch new tasks until the window is full or none are left."""
            while len(live) < self.max_inflight:
                task = next(self._tasks, None)
                if task is None:
                    return
                try:
                    next(task)  # up to its first collective
                except StopIteration:  # a task without communication is done already
                    continue
                live.append(task)
                self.peak_inflight = max(self.peak_inflight, len(live))

        fill()
        while live:
            task = live.popleft()
            try:
                next(task)
            except StopIteration:
                fill()  # the next batch launches its first collective at once
                continue
            live.append(task)
