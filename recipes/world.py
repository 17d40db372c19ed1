"""Run a function on a fresh local world of N ranks: the one runner of scripts and tests.

`run_world(fn, world_size, *args)` starts `world_size` processes and returns each rank's
`fn(*args)` in rank order. On Linux a rank is forked from a fork server (multiprocessing's
"forkserver", Python 3.14's default there), one per calling process, started at its first
world with torch and the other libraries of a training rank imported: a rank starts without
importing torch again, and a process running many worlds (a test session, a sweep) pays that
import once. The server never runs a torch op nor touches CUDA and imports torch with one
OpenMP thread, so a fork of it is as clean as a fresh interpreter; each rank gets the
caller's environment, working directory, `sys.path` and stdout/stderr as they are when the
world starts. Elsewhere ranks are spawned (a fresh interpreter each).

One port strategy: the calling process hosts the TCPStore on a port the kernel picks (port 0),
and every rank joins it as a client (torch's agent-store mode, so
`dist.init_process_group` from the environment works too), so no free port is ever guessed and
raced for. One failure and timeout policy: a failure names the rank it follows from, not the
first peer to notice it (`recipes.world_faults`: a rank that died, by its signal or exit
status, before one that raised, before one that stopped responding), with its traceback or
the last lines of its log (`rank_log`); a world that does not finish in `timeout_s` is killed,
naming the ranks still running, so a deadlocked collective fails instead of hanging
(`timeout_s=None`: no deadline, for training, whose ranks set a collective timeout instead).
However the call ends, no rank outlives it: ranks still running are killed (after `grace_s`
seconds of SIGTERM when `grace_s` > 0 and no rank failed), and on Linux a rank dies with the
calling process, even one killed outright.

Stop signals: with `stop_signals=(signal.SIGTERM, signal.SIGINT)`, say, the calling process
catches those signals while the world runs (the previous handlers come back afterwards), asks
every rank to stop with SIGTERM, waits up to `grace_s` for them to exit (no longer once a rank
has failed or is stopped: the others' checkpoint cannot complete), kills the rest and
raises `WorldStopped` naming the signal and the killed ranks. Ranks that handle SIGTERM (the
trainer checkpoints) finish their step and exit. Needs the main thread.

`backend="gloo"` / `"nccl"` (one GPU per rank, `cuda:<rank>`) joins the process group before
`fn` and destroys it after; `backend=None` leaves it to `fn` (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT are set). Every rank runs with one intra-op thread
(OMP_NUM_THREADS=1 in its environment, torch.set_num_threads(1)) unless `threads` says
otherwise (None: torch's default in the calling process). `pythonpath`: a directory whose
`muon`, `models` and `recipes` packages the ranks import instead of this tree's (a
before/after benchmark against another checkout).
`daemon=False`: ranks may start processes of their own (dataloader workers, a checkpoint
writer), which multiprocessing forbids daemonic processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Collection, Iterator
from datetime import timedelta
from typing import Any

from recipes.world_faults import SETTLE_S, blame, cannot_finish, set_collective_timeout

_HOST = "127.0.0.1"
_OWN_PACKAGES = ("muon", "models", "recipes")
#: imported once by the fork server: the libraries every training rank imports (most of a
#: spawned rank's start). Not this project's packages: the server (Python 3.11's) does not get
#: the caller's sys.path, so they could come from another checkout, and a `pythonpath` world's
#: ranks import another checkout's.
_PRELOAD = ("torch", "torch.distributed.fsdp", "torch.distributed.checkpoint", "hydra")
_PRELOAD += ("safetensors", "torch._dynamo")  # the latter: what a meta-device init imports
_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


class WorldError(RuntimeError):
    """A rank of a spawned world raised, died or did not finish in time.

    `rank`, `exitcode`, `detail`, `reason`: the rank whose failure the others follow from
    (`recipes.world_faults.blame`), its exit status (1 for a rank that raised, -N for one
    killed by signal N, None for one still running that stopped responding), its traceback or
    what became of it (with the last lines of its log and its peers' errors), and what
    happened to it in a few words ("raised", "died first (killed by SIGKILL, pid N)", ...);
    None, None, "", "" for a world that ran out of time."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        exitcode: int | None = None,
        detail: str = "",
        reason: str = "",
    ) -> None:
        super().__init__(message, rank, exitcode, detail, reason)  # all in args: it pickles
        self.rank, self.exitcode, self.detail, self.reason = rank, exitcode, detail, reason

    def __str__(self) -> str:
        return self.args[0]


class WorldStopped(WorldError):
    """The calling process got one of `stop_signals`: the ranks were asked to stop (SIGTERM);
    `killed` lists those that had not exited after the grace period, `when` says when they
    were killed (`after 90 s`, or `at once: rank 1 killed by SIGKILL` once one failed)."""

    def __init__(self, message: str, signum: int, killed: list[int], when: str = "") -> None:
        RuntimeError.__init__(self, message, signum, killed, when)
        self.rank, self.exitcode, self.detail, self.reason = None, None, "", ""
        self.signum, self.killed, self.when = signum, killed, when

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def _die_with_parent(caller: int) -> None:
    """Linux: the kernel kills this process when its parent dies: the calling process (a
    spawned rank) or the fork server, which exits when the calling process does."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    try:
        os.kill(caller, 0)
    except ProcessLookupError:  # the caller died before the line above
        os._exit(1)
    if os.getppid() != parent:  # the parent did
        os._exit(1)


def _release_fork_server() -> None:
    """A fork server's child holds the caller's end of the pipe the server watches (to ask the
    server for processes of its own, which a rank never does): closed, the server exits as soon
    as the caller does, and the parent-death signal takes the rank with it."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the module's one instance (no public handle)
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


class _CallerStreams:
    """The caller's stdout and stderr at the moment a rank starts, handed to the rank (a fork
    server's child would otherwise write where the caller's were when the server started)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _adopt_streams, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt_streams(out, err) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, dup in ((1, out), (2, err)):
        received = dup.detach()
        if received != fd:
            os.dup2(received, fd)
            os.close(received)


def _worker(rank: int, world_size: int, port: int, spec: dict, fn: Callable, args: tuple, results):
    _die_with_parent(spec["parent"])
    if spec["forked"]:
        _release_fork_server()
    import torch
    import torch.distributed as dist

    os.environ.clear()  # a fork server's child has the server's: take the caller's
    os.environ.update(spec["env"])
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # torch checks == "True": the store exists, join it
    )
    torch.set_num_threads(spec["threads"])
    try:
        if spec["pythonpath"]:
            sys.path.insert(0, spec["pythonpath"])
            for name in [m for m in sys.modules if m.split(".")[0] in _OWN_PACKAGES]:
                del sys.modules[name]  # later imports find the other checkout's packages
        if spec["backend"] is not None:
            store = dist.TCPStore(
                _HOST, port, world_size + 1, is_master=False, timeout=timedelta(seconds=60)
            )
            kwargs = {}
            if spec["backend"] == "nccl":
                kwargs["device_id"] = torch.device("cuda", rank)
                torch.cuda.set_device(rank)
            if spec["collective_timeout_s"] is not None:
                kwargs["timeout"] = set_collective_timeout(spec["collective_timeout_s"])
            dist.init_process_group(
                spec["backend"], store=store, rank=rank, world_size=world_size, **kwargs
            )
        out = fn(*args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - forwarded to the caller, whatever it is
        results.put((rank, "error", traceback.format_exc()))
        failed = True
    else:
        failed = False
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if failed:
        sys.exit(1)  # the status a rank that raised has under any launcher


def run_world(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout_s: float | None = 300.0,
    threads: int | None = 1,
    pythonpath: str | None = None,
    daemon: bool = True,
    stop_signals: Collection[int] = (),
    grace_s: float = 0.0,
    rank_log: str | None = None,
) -> list[Any]:
    """Run module-level `fn(*args)` on `world_size` local ranks; their results by rank.

    Raises WorldError when a rank raises, dies or the world outlives `timeout_s` (None: no
    deadline), WorldStopped when one of `stop_signals` stopped it (see the module's doc).
    `rank_log`: each rank's log file, `{rank}` in it, whose last lines a failure reports."""
    import torch
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 or None (no deadline), got {timeout_s!r}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be >= 0, got {grace_s!r}")
    if stop_signals and threading.current_thread() is not threading.main_thread():
        raise ValueError("stop_signals: signal handlers can only be set in the main thread")
    ctx = _context()
    results = ctx.Queue()
    # The calling process hosts the store; the ranks count towards world_size + 1 clients.
    store = dist.TCPStore(
        _HOST,
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    forked = ctx.get_start_method() == "forkserver"
    with _thread_vars(threads):
        env = dict(os.environ)  # what a spawned rank inherits
    spec = dict(
        backend=backend,
        # the caller's torch default for None (a forked rank's torch was imported with one)
        threads=torch.get_num_threads() if threads is None else threads,
        pythonpath=pythonpath,
        # No deadline: torch's default collective timeout, as under any launcher.
        collective_timeout_s=None if timeout_s is None else max(timeout_s, 60.0),
        parent=os.getpid(),
        env=env,
        forked=forked,
        streams=_CallerStreams() if forked else None,  # unpickled in the rank: adopted there
    )
    received: list[int] = []  # the stop signals caught, first one first
    with _catching(stop_signals, received):
        procs = _start(ctx, world_size, threads, daemon, (store.port, spec, fn, args, results))
        grace = grace_s
        try:
            outputs = _collect(fn, procs, results, timeout_s, received, rank_log)
        except WorldError:
            grace = 0.0  # a failed world cannot checkpoint: its ranks are not waited for
            raise
        finally:
            killed, when = _stop(procs, results, grace)
            results.close()
    if outputs is None:
        name = signal.Signals(received[0]).name
        after = f"; rank(s) {killed} killed {when}" if killed else ""
        raise WorldStopped(f"{fn.__name__}: stopped by {name}{after}", received[0], killed, when)
    return [outputs[r] for r in range(world_size)]


def start_fork_server() -> None:
    """Start this process's fork server now, where ranks are forked from one (a no-op when it
    runs already): it imports torch on another core while the caller goes on (train.py, say,
    composing its config before it starts a local world)."""
    _context()


def _context():
    """The fork server on Linux (started here at the first world, outside any thread setting
    of this call), else spawn. The server holds no package of this project, so a rank of a
    `pythonpath` world imports that checkout's as a spawned one would."""
    if not sys.platform.startswith("linux"):
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    # One OpenMP thread while it imports torch (which otherwise starts a pool there): a fork of
    # a process with threads inherits their state but not the threads, and its first parallel
    # region may crash. The ranks set their own thread count.
    with _thread_vars(1):
        forkserver.ensure_running()
    return ctx


@contextlib.contextmanager
def _catching(signals: Collection[int], received: list[int]) -> Iterator[None]:
    """While the world runs, each of `signals` is recorded in `received` (the loop acts on it),
    then the previous handlers come back."""
    previous = {
        sig: signal.signal(sig, lambda signum, _: received.append(signum)) for sig in signals
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _thread_vars(threads: int | None) -> Iterator[None]:
    """OMP_NUM_THREADS and MKL_NUM_THREADS set to `threads` (None: left as they are) in this
    process's environment meanwhile, for a process started from it to read at torch's import."""
    saved = {k: os.environ.get(k) for k in _THREAD_VARS}
    if threads is not None:
        os.environ.update({k: str(threads) for k in _THREAD_VARS})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start(ctx, world_size: int, threads: int | None, daemon: bool, worker_args: tuple) -> list:
    procs = []
    # A spawned rank reads them when it imports torch (a forked one has them from `spec`).
    with _thread_vars(threads):
        try:
            for r in range(world_size):
                procs.append(
                    ctx.Process(target=_worker, args=(r, world_size, *worker_args), daemon=daemon)
                )
                procs[-1].start()
        except BaseException:
            _stop(procs, None, 0.0)
            raise
    return procs


def _stop(procs: list, results, grace_s: float) -> tuple[list[int], str]:
    """End every rank still running: SIGTERM and up to `grace_s` to exit (the results queue
    drained meanwhile, so no rank blocks flushing it), then SIGKILL. The ranks killed, and
    when: `after <grace> s`, or `at once: <why>` when a rank failed or is stopped meanwhile."""
    when = f"after {grace_s:.0f} s"
    try:
        if grace_s > 0 and any(p.is_alive() for p in procs):
            for p in procs:
                if p.is_alive():
                    p.terminate()
            end = time.monotonic() + grace_s
            while time.monotonic() < end and any(p.is_alive() for p in procs):
                with contextlib.suppress(queue.Empty, OSError, ValueError):
                    results.get(timeout=0.2)
                why = cannot_finish(procs)
                if why:  # no checkpoint can complete: the others are not waited for
                    when = f"at once: {why}"
                    break
    finally:  # even when a signal handler raised during the grace period
        killed = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
    return killed, when


def _collect(
    fn: Callable,
    procs: list,
    results,
    timeout_s: float | None,
    received: list[int],
    rank_log: str | None = None,
) -> dict[int, Any] | None:
    """The ranks' results as they arrive. A failure (an error reported, a rank gone without a
    result) raises once the others have reported too or `SETTLE_S` has passed, blaming the rank
    it follows from (`recipes.world_faults`); so does the timeout. None as soon as a stop signal
    has been received."""
    world_size = len(procs)
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in arrival order
    gone: dict[int, float] = {}  # first seen exited without a result
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    failed_at = None
    while len(outputs) < world_size:
        if received:
            return None
        with contextlib.suppress(queue.Empty):
            rank, status, payload = results.get(timeout=0.2)
            (errors if status == "error" else outputs)[rank] = payload
        now = time.monotonic()
        for r, p in enumerate(procs):  # exited without a result (exit status 0 included)
            if p.exitcode is not None and r not in outputs and r not in errors:
                gone.setdefault(r, now)
        if failed_at is None and (errors or gone):
            failed_at = now
        if failed_at is not None:
            reported = len(outputs) + len(errors.keys() | gone.keys())
            if reported == world_size or now - failed_at > SETTLE_S:
                _drain(results, outputs, errors)  # a result still in the queue's pipe
                gone = {r: t for r, t in gone.items() if r not in outputs and r not in errors}
                if errors or gone:
                    raise WorldError(*blame(fn.__name__, procs, errors, gone, rank_log))
                failed_at = None  # it had exited after sending its result
        elif deadline is not None and now > deadline:
            pending = sorted(set(range(world_size)) - set(outputs))
            raise WorldError(
                f"{fn.__name__}: rank(s) {pending} did not finish within {timeout_s:.0f} s "
                "(deadlocked collective?)"
            )
    return outputs


def _drain(results, outputs: dict[int, Any], errors: dict[int, str]) -> None:
    """What the ranks' queue still holds, read for half a second (a rank that raised puts its
    traceback there before it exits; the queue's feeder may still be flushing it)."""
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.1)
        except (queue.Empty, OSError, ValueError):
            continue
        (errors if status == "error" else outputs)[rank] = payload
