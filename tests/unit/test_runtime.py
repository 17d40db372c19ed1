"""AsyncRuntime: bounded tasks in flight, created lazily, resumed round-robin."""

import pytest

from muon.runtime import AsyncRuntime


def _tasks(log, n, yields=2):
    for i in range(n):
        log.append(("create", i))
        yield _task(log, i, yields)


def _task(log, i, yields):
    log.append(("start", i))
    for k in range(yields):
        log.append(("phase", i, k))
        yield
    log.append(("done", i))


def test_at_most_max_inflight_tasks_exist_and_later_ones_are_created_lazily():
    log = []
    rt = AsyncRuntime(_tasks(log, 5), max_inflight=2)
    rt.run()
    assert rt.peak_inflight == 2
    alive, most = set(), 0
    for event in log:
        if event[0] == "create":
            alive.add(event[1])
        elif event[0] == "done":
            alive.discard(event[1])
        most = max(most, len(alive))
    assert most == 2  # a task's buffers cannot exist before a slot frees up
    assert log.index(("create", 2)) > log.index(("done", 0))
    assert [e for e in log if e[0] == "done"] == [("done", i) for i in range(5)]


def test_tasks_interleave_so_communication_can_overlap():
    log = []
    AsyncRuntime(_tasks(log, 2), max_inflight=3).run()
    phases = [e for e in log if e[0] == "phase"]
    assert phases[:2] == [("phase", 0, 0), ("phase", 1, 0)]  # task 1 launches before 0 resumes


def test_max_inflight_must_be_positive():
    with pytest.raises(ValueError, match="max_inflight"):
        AsyncRuntime(iter(()), max_inflight=0)


def test_sliding_window_launches_the_next_task_as_soon_as_one_finishes():
    """With 3 in flight, the 4th batch launches (runs to its first collective) before the 3rd
    returns: the window never drains between waves."""
    log = []
    AsyncRuntime(_tasks(log, 6), max_inflight=3).run()
    assert log.index(("phase", 3, 0)) < log.index(("done", 2))
    assert log.index(("phase", 3, 0)) == log.index(("done", 0)) + 3  # create, start, launch
    alive, most = set(), 0
    for event in log:
        if event[0] == "start":
            alive.add(event[1])
        elif event[0] == "done":
            alive.discard(event[1])
        most = max(most, len(alive))
    assert most == 3
