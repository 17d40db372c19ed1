"""Run a function on a fresh gloo world of N CPU ranks, from a test.

`run_world(fn, world_size, *args)` spawns `world_size` processes, joins them into one gloo
process group through a TCPStore hosted by the calling process (so there is no free-port race),
runs the module-level `fn(*args)` on every rank and returns the ranks' return values in rank
order. A rank's exception is re-raised in the test with the child's traceback; a world that does
not finish within `timeout_s` is killed and reported naming the ranks still running, so a
deadlocked collective fails the test instead of hanging it. `backend="nccl"` joins the ranks
into an NCCL group instead, rank k on cuda:k (the `gpu`-marked tests).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_HOST = "127.0.0.1"


class WorldError(RuntimeError):
    """A rank of a spawned world raised, died or did not finish in time."""


def _worker(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, backend: str
) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            _HOST, port, world_size + 1, is_master=False, timeout=timedelta(seconds=60)
        )
        device = None
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=600),
            device_id=device,
        )
        out = fn(*args)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - forwarded to the test, whatever it is
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, backend: str = "gloo"
) -> list[Any]:
    """Run module-level `fn(*args)` on `world_size` spawned ranks of a `backend` ("gloo", or
    "nccl" with one CUDA device per rank) process group; return results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The calling process hosts the store; children count towards world_size + 1 clients.
    store = dist.TCPStore(
        _HOST,
        0,
        world_size + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=60),
    )
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    try:
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, store.port, fn, args, results, backend),
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
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
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
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        results.close()
    return [outputs[r] for r in range(world_size)]


def init_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A CPU DeviceMesh over the current world, e.g. init_mesh((2, 2), ("ep", "efsdp"))."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)
