"""One run per run directory (recipes.runlock): a held lock refuses, naming its holder; a lock
left by a dead process is taken over with a warning; without flock the text decides."""

import fcntl
import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from recipes import runlock


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(runlock, "_held", None)
    yield
    if runlock._held is not None:
        runlock._held.release()


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(proc.stdout)


def _record(path, **fields) -> None:
    holder = {"pid": 1, "host": socket.gethostname(), "started": "then", "command": "train.py"}
    path.write_text(json.dumps(holder | fields))


def test_a_held_lock_refuses_a_second_start_naming_the_holder(tmp_path):
    """Another open file description holding the flock (another process's, as the kernel sees
    it) with its record: the start is refused, naming pid, host and command."""
    path = tmp_path / runlock.LOCK_NAME
    _record(path, pid=4242, host="node7", command="train.py optim.lr=1")
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(runlock.RunDirInUse) as err:
            runlock.hold(tmp_path)
        assert f"run directory {tmp_path} is in use by pid 4242 on host node7" in str(err.value)
        assert "command: train.py optim.lr=1" in str(err.value)
        assert json.loads(path.read_text())["pid"] == 4242  # the holder's record untouched
    finally:
        os.close(fd)
    lock = runlock.hold(tmp_path)  # released: taken, with this process's record
    held = json.loads(path.read_text())
    assert (held["pid"], held["host"]) == (os.getpid(), socket.gethostname())
    lock.release()
    assert path.read_text() == ""  # released: an empty file, kept


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = _dead_pid()
    _record(tmp_path / runlock.LOCK_NAME, pid=dead)
    with caplog.at_level(logging.WARNING, logger="recipes"):
        runlock.hold(tmp_path)
    assert f"it was left by pid {dead} on host {socket.gethostname()}" in caplog.text
    assert json.loads((tmp_path / runlock.LOCK_NAME).read_text())["pid"] == os.getpid()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recipes"):
        runlock.hold(tmp_path / "next")  # a sweep's next job: the previous lock released
    assert not caplog.records
    assert (tmp_path / runlock.LOCK_NAME).read_text() == ""
    fd = os.open(tmp_path / runlock.LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it any more
    finally:
        os.close(fd)


def test_without_flock_the_record_decides(tmp_path, monkeypatch, caplog):
    """A file system without flock: a live pid here, or a holder on another host, refuses (the
    message says which file to delete); a dead pid here, or this Slurm job's own earlier run on
    another host (a requeue), is taken over."""
    monkeypatch.setattr(runlock, "_flock", lambda fd: None)
    path = tmp_path / runlock.LOCK_NAME
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for holder in ({"pid": os.getppid()}, {"host": "elsewhere", "slurm_job_id": "77"}):
        _record(path, **holder)
        with pytest.raises(runlock.RunDirInUse, match=f"no file lock here: delete {path}"):
            runlock.hold(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for holder in ({"pid": _dead_pid()}, {"host": "elsewhere", "slurm_job_id": "77"}):
        _record(path, **holder)
        with caplog.at_level(logging.WARNING, logger="recipes"):
            runlock.hold(tmp_path).release()
        assert "which is gone" in caplog.text
        caplog.clear()
