"""A failed world: which rank its failure follows from, and the collective timeout.

When one rank dies, its peers fail too, a moment later, with errors that only say a peer went
away (gloo's `Connection reset by peer`, a collective that timed out). The first error to
reach the caller is then often a peer's, so `recipes.world` waits `SETTLE_S` after the first
failure for the others' reports and the exit codes, and blames, in this order:

1. a rank that died without reporting (killed by a signal, or an exit status with no
   traceback), the first one seen gone;
2. a rank that raised an error of its own (one that is not a peer's failure), the first one;
3. a rank still running while every error is a peer's failure: it stopped responding (frozen
   by SIGSTOP, a debugger, or a hang); a stopped one (process state `T`) before the others;
4. the first error.

The report holds what happened to that rank, the last lines of its log (`rank_log`), and one
line of each peer's error, marked as following from it.

A frozen rank fails its peers only through their collective timeout, which torch applies per
process group: the world group's comes from `init_process_group(timeout=...)`, but every
later group (a DeviceMesh's dimensions, `new_group` without a timeout) takes torch's default,
30 minutes for gloo. `set_collective_timeout` replaces those defaults as well, so one timeout
holds for every collective of the process.
"""

from __future__ import annotations

import contextlib
import re
import signal
from datetime import timedelta
from pathlib import Path

#: how long after the first failure the other ranks get to report theirs
SETTLE_S = 3.0
#: lines of the blamed rank's log in the report
LOG_LINES = 20
#: errors that only say a peer failed (gloo, NCCL, torch's store): never the cause themselves
_PEER_FAILURE = re.compile(
    r"Connection (reset|closed|refused) by peer|Broken pipe|Timed out waiting|timed out after"
    r"|Socket Timeout|DistNetworkError|DistStoreError|Watchdog caught collective operation timeout"
    r"|NCCL communicator was aborted|ProcessGroup\w* is aborted|NCCL error",
    re.IGNORECASE,
)
_STATES = {"T": "stopped", "t": "stopped by a debugger", "D": "in uninterruptible I/O"}
_STATES |= {"R": "running", "S": "sleeping", "Z": "exited (a zombie)"}


def set_collective_timeout(seconds: float) -> timedelta:
    """The timeout of every process group this process creates from now on, the world's
    included (pass the returned value to `init_process_group`): torch's defaults for groups
    made without one are module globals of `torch.distributed.distributed_c10d`, read when a
    group is made (no public setter exists)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=seconds)
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:  # None: torch built without NCCL
        c10d.default_pg_nccl_timeout = timeout
    return timeout


def cannot_finish(procs: list) -> str:
    """Why the collective work the ranks would finish on a stop request (a checkpoint) cannot:
    a rank failed (a non-zero exit) or is stopped (SIGSTOP: it cannot act on SIGTERM); ""."""
    for r, p in enumerate(procs):
        if p.exitcode not in (None, 0):
            return f"rank {r} {describe_exit(p.exitcode)}"
        if p.exitcode is None and process_state(p.pid) in ("T", "t"):
            return f"rank {r} is stopped (pid {p.pid}, process state T)"
    return ""


def is_peer_failure(traceback_text: str) -> bool:
    """Whether a rank's traceback is a communication failure: a consequence of a peer's."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return bool(lines) and bool(_PEER_FAILURE.search(lines[-1]))


def process_state(pid: int | None) -> str | None:
    """The process's state letter from /proc (Linux; None elsewhere or when it is gone)."""
    if pid is None:
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def describe_exit(exitcode: int) -> str:
    """`killed by SIGKILL` for -9, `exit status 1` for 1."""
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def log_tail(rank_log: str | None, rank: int, lines: int = LOG_LINES) -> str:
    """The last `lines` lines of the rank's log (`rank_log` formatted with `rank`), or why
    there are none; "" without a log."""
    if rank_log is None:
        return ""
    path = Path(rank_log.format(rank=rank))
    try:
        text = path.read_text(errors="replace").rstrip()
    except OSError:
        return f"{path}: none written"
    if not text:
        return f"{path}: empty"
    tail = text.splitlines()[-lines:]
    return f"last lines of {path}:\n" + "\n".join(f"  {line}" for line in tail)


def _last_line(traceback_text: str) -> str:
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no traceback)"


def blame(
    name: str, procs: list, errors: dict[int, str], gone: dict[int, float], rank_log: str | None
) -> tuple[str, int, int | None, str, str]:
    """(message, rank, exit code, detail, reason) of the rank the failure follows from.

    `errors`: the tracebacks ranks reported, in arrival order; `gone`: when each rank that
    exited without a result was first seen gone; `procs`: the ranks' processes."""
    silent = [r for r in gone if r not in errors]
    primary = [r for r in errors if not is_peer_failure(errors[r])]
    running = [r for r, p in enumerate(procs) if p.exitcode is None and r not in errors]
    if silent:
        rank = min(silent, key=lambda r: (gone[r], procs[r].exitcode >= 0, r))
        code = procs[rank].exitcode
        reason = f"died first ({describe_exit(code)}, pid {procs[rank].pid})"
        own = ""
    elif primary or not running:
        rank = (primary or list(errors))[0]
        code, reason, own = 1, "raised", errors[rank]
    else:
        states = {r: process_state(procs[r].pid) for r in running}
        rank = next((r for r in running if states[r] in ("T", "t")), running[0])
        state = _STATES.get(states[rank] or "", states[rank] or "unknown")
        code, own = None, ""
        reason = (
            f"stopped responding (pid {procs[rank].pid}, process state: {state}): its peers' "
            "collectives failed waiting for it"
        )
    parts = [own.rstrip()] if own else []
    tail = log_tail(rank_log, rank)
    if tail:
        parts.append(tail)
    peers = [f"  rank {r}: {_last_line(t)}" for r, t in errors.items() if r != rank]
    peers += [f"  rank {r}: {describe_exit(procs[r].exitcode)}" for r in silent if r != rank]
    if peers:
        parts.append(f"the other ranks' failures, which follow from rank {rank}'s:")
        parts += peers
    detail = "\n".join(parts) or "no traceback, no log, no other rank failed"
    return f"{name}: rank {rank} {reason}:\n{detail}", rank, code, detail, reason
