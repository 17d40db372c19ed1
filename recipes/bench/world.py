"""Run a function on a fresh local world of N ranks: the one runner of scripts and tests.

`run_world(fn, world_size, *args)` spawns `world_size` processes and returns each rank's
`fn(*args)` in rank order. One port strategy: the calling process hosts the TCPStore on a port
the kernel picks (port 0), and every rank joins it as a client (torch's agent-store mode, so
`dist.init_process_group` from the environment works too), so no free port is ever guessed and
raced for. One failure and timeout policy: a rank's exception is re-raised here with the
child's traceback, a rank that dies names its exit code, and a world that does not finish in
`timeout_s` is killed, naming the ranks still running, so a deadlocked collective fails
instead of hanging.

`backend="gloo"` / `"nccl"` (one GPU per rank, `cuda:<rank>`) joins the process group before
`fn` and destroys it after; `backend=None` leaves it to `fn` (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT are set). Every rank runs with one intra-op thread
(OMP_NUM_THREADS=1, read by torch at import, so set before the spawn) unless `threads` says
otherwise. `pythonpath`: a directory whose `muon`, `models` and `recipes` packages the ranks
import instead of this tree's (a before/after benchmark against another checkout).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_HOST = "127.0.0.1"
_OWN_PACKAGES = ("muon", "models", "recipes")


class WorldError(RuntimeError):
    """A rank of a spawned world raised, died or did not finish in time."""


def _worker(rank: int, world_size: int, port: int, spec: dict, fn: Callable, args: tuple, results):
    import torch
    import torch.distributed as dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=_HOST,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="1",  # the store exists: every rank is its client
    )
    if spec["threads"] is not None:
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
            dist.init_process_group(
                spec["backend"],
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=spec["collective_timeout_s"]),
                **kwargs,
            )
        out = fn(*args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - forwarded to the caller, whatever it is
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str | None = "gloo",
    timeout_s: float = 300.0,
    threads: int | None = 1,
    pythonpath: str | None = None,
) -> list[Any]:
    """Run module-level `fn(*args)` on `world_size` spawned ranks; their results by rank.

    Raises WorldError when a rank raises, dies or the world outlives `timeout_s`."""
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    ctx = mp.get_context("spawn")
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
    spec = dict(
        backend=backend,
        threads=threads,
        pythonpath=pythonpath,
        collective_timeout_s=max(timeout_s, 60.0),
    )
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in names}
    if threads is not None:
        os.environ.update({k: str(threads) for k in names})
    try:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store.port, spec, fn, args, results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        outputs = _collect(fn, procs, results, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
    return [outputs[r] for r in range(world_size)]


def _collect(fn: Callable, procs: list, results, timeout_s: float) -> dict[int, Any]:
    """The ranks' results as they arrive; the first failure, death or the timeout raises."""
    world_size = len(procs)
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(outputs) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue.Empty:
            if time.monotonic() > deadline:
                pending = sorted(set(range(world_size)) - set(outputs))
                raise WorldError(
                    f"{fn.__name__}: rank(s) {pending} did not finish within {timeout_s:.0f} s "
                    "(deadlocked collective?)"
                ) from None
            dead = [
                r
                for r, p in enumerate(procs)
                if r not in outputs and not p.is_alive() and p.exitcode not in (0, None)
            ]
            if dead and results.empty():
                time.sleep(0.5)  # the queue feeder may still be flushing the error
                if results.empty():
                    codes = {r: procs[r].exitcode for r in dead}
                    raise WorldError(
                        f"{fn.__name__}: rank(s) died with exit codes {codes}"
                    ) from None
            continue
        if status == "error":
            raise WorldError(f"{fn.__name__}: rank {rank} raised:\n{payload}")
        outputs[rank] = payload
    return outputs
