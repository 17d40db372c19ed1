"""One run per run directory: `<run dir>/run.lock`, held by the process that starts the run.

The exclusion is an OS lock on that file (`fcntl.flock`, taken without waiting): the kernel
drops it when its process ends, however it ends (kill -9 included), so a run that died never
blocks the next start, and two processes can never both hold it (the check and the taking are
one system call). The file's text says who holds it - pid, host, start time, the command, the
Slurm job - and is what a refused second start prints. A holder that ends normally empties
the file; a non-empty file whose lock is free was left by a process that died, and the next
start takes it over with a warning naming it. The file is never deleted: a start that opened
the old file while another deleted it and made a new one would hold a lock nobody else sees.

Where the file system has no flock (some network mounts answer ENOLCK or EOPNOTSUPP), the text
alone decides: a live pid on this host, or any holder on another host that is not this Slurm
job's earlier run (a requeue keeps SLURM_JOB_ID), refuses the start; a holder known dead is
taken over with the warning.

A process holds one run directory at a time: a multirun's jobs run one after another in one
process, so taking the next job's lock releases the previous one's; the last is released when
the process exits.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("recipes")

LOCK_NAME = "run.lock"
#: errors of flock on a file system that does not support it (the text alone decides there)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class RunDirInUse(RuntimeError):
    """Another live process holds the run directory's lock; the message names it."""


@dataclass
class RunLock:
    """A held lock: the open file (its descriptor holds the flock) and the run directory."""

    path: Path
    fd: int

    def release(self) -> None:
        """Empty the file (nobody holds it) and drop the OS lock; safe to call twice."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = -1


_held: RunLock | None = None


def _holder_record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def describe(holder: dict) -> str:
    """`pid 123 on host h (started ..., command ...)`, as a refusal or a warning names it."""
    text = f"pid {holder.get('pid')} on host {holder.get('host')}"
    details = [f"started {holder['started']}"] if holder.get("started") else []
    if holder.get("slurm_job_id"):
        details.append(f"Slurm job {holder['slurm_job_id']}")
    if holder.get("command"):
        details.append(f"command: {holder['command']}")
    return text + (f" ({'; '.join(details)})" if details else "")


def _read_holder(fd: int) -> dict | None:
    """The record in the lock file; None when it is empty. Unreadable text is a record too
    (it was left by someone): its raw start."""
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    return (
        holder
        if isinstance(holder, dict)
        else {"pid": "?", "host": raw[:80].decode(errors="replace")}
    )


def pid_alive(pid: object) -> bool:
    """Whether a process of this id runs on this host (one of another user counts as alive)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _known_dead(holder: dict) -> bool:
    """Without flock: whether the recorded holder is certainly gone."""
    if holder.get("host") == socket.gethostname():
        return not pid_alive(holder.get("pid"))
    job = os.environ.get("SLURM_JOB_ID")
    return job is not None and holder.get("slurm_job_id") == job  # a requeue of this job


def _flock(fd: int) -> bool | None:
    """Take the OS lock without waiting: True taken, False held elsewhere, None unsupported."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in _NO_FLOCK:
            return None
        raise
    return True


def hold(run_dir: Path) -> RunLock:
    """Take `run_dir`'s lock for this process (releasing the one it held for another run
    directory), or raise RunDirInUse naming the live holder. A lock left by a dead process is
    taken over with a warning that names it."""
    global _held
    run_dir = Path(run_dir)
    if _held is not None:
        if _held.path == run_dir and _held.fd >= 0:
            return _held
        _held.release()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        taken = _flock(fd)
        holder = _read_holder(fd)
        if taken is False or (taken is None and holder is not None and not _known_dead(holder)):
            who = describe(holder) if holder else "a process that has not written its name yet"
            raise RunDirInUse(
                f"run directory {run_dir} is in use by {who}; one run per run directory: wait "
                f"for it to end (or stop it), or start this one under another run.name"
                + ("" if taken is False else f" (no file lock here: delete {path} if it is gone)")
            )
        if holder is not None:
            log.warning(
                "took over %s: it was left by %s, which is gone (the run it started ended "
                "without releasing it)",
                path,
                describe(holder),
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder_record()) + "\n").encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _held = RunLock(run_dir, fd)
    return _held


@atexit.register
def _release_at_exit() -> None:
    if _held is not None:
        _held.release()
