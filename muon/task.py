"""One Muon batch through a step, its phases top to bottom, the same for every path.

`Muon.update` hands `batch_tasks` to the `muon.runtime.AsyncRuntime`, which keeps a window of
them in flight; each task is a generator that yields where it waits for a collective:

    momentum -> launch -> wait -> orthogonalize -> return -> wait -> check -> agree -> apply

The momentum and apply math is `muon.phases`' (over `muon.update`'s foreach functions), the
exchange the batch's path object's (`muon.paths`), the orthogonalization `muon.blocks`' (with
NorMuon, `muon.normuon`). What a task reads of the optimizer is its `StepContext`: the plan,
the groups and state, and the step's bookkeeping (`muon.verdict`, `muon.blowups`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from muon import normuon, phases
from muon.blocks import orthogonalize
from muon.blowups import GramBlowups
from muon.chunks import Chunk
from muon.layout import local, moved_shape
from muon.paths import PATHS
from muon.plan import BatchPlan, MeshCommPlan
from muon.stats import StepStats
from muon.verdict import StepVerdict


@dataclass(frozen=True)
class StepContext:
    """What one update's tasks read of `muon.Muon`: its step plan (`muon.planner.StepPlan`),
    `param_groups` and `state`, the per-batch chunks made at planning (`muon.chunks`), the ids
    of the parameters without a grad on any rank this step (`muon.census`), where verdicts are
    recorded and agreed (`muon.verdict`, `muon.verdict.verdict_groups`) and the Gram blow-up
    counters (`muon.blowups`)."""

    plan: object
    param_groups: list[dict]
    state: dict
    chunks: dict
    gradless: set[int]
    verdict: StepVerdict
    verdict_groups: dict
    blowups: GramBlowups


def batch_tasks(ctx: StepContext, stats: StepStats) -> Iterator:
    """One task per batch (per chunk on the local path), created lazily in plan order."""
    for mi, (mp, batches) in enumerate(ctx.plan.plans):
        for bi, b in enumerate(batches):
            for chunk in ctx.chunks[(mi, bi)]:
                yield batch_task(ctx, mp, b, chunk, stats)


def batch_task(ctx: StepContext, mp: MeshCommPlan, b: BatchPlan, chunk: Chunk, stats: StepStats):
    """One batch through its path's phases (the local path has nothing to wait for)."""
    r, path = mp.fsdp_rank, PATHS[b.path]
    params = [
        (p, ctx.param_groups[gi])
        for p, gi in (ctx.plan.params[b.param_indices[j]] for j in chunk.positions)
    ]
    device = local(params[0][0]).device
    group = ctx.plan.groups.get((mp, b.subgroup_size if b.path == "subgroup" else 0))
    wire = getattr(torch, b.wire_dtype)
    if chunk.positions[0] == 0:  # a batch counts once, however many chunks it has
        stats.batches[b.path] += 1
    # 1. momentum: buffers updated, NS inputs written straight into the send buffer's slots
    send, slots = path.send_buffer(b, r, dtype=wire, device=device, count=len(params))
    phases.momentum_(params, slots, b.shard_tensor_dim, ctx.state, ctx.gradless)
    # 2. launch the exchange; wait
    ex = path.launch(b, send, fsdp_rank=r, group=group, stats=stats)
    del send
    if path.collectives:
        yield
        stats.wait(ex.work)
        ex.work = None  # a finished Work still references its buffers
    # 3. orthogonalize what this rank assembled
    units = path.received(b, ex, r)
    result = None
    if units is not None:
        blocks = sum(count for _, _, count in chunk.units)
        ortho = _orthogonalizer(ctx, b, chunk, params)
        result = stats.orthogonalize(ortho, units, b.path, blocks, units=chunk.units)
    del units
    # 4. return the orthogonalized units; wait
    path.give_back(b, ex, result, fsdp_rank=r, group=group, stats=stats)
    del result
    if path.collectives:
        yield
        stats.wait(ex.work)
        ex.work = None
    # 5. check the returned shards; the ranks holding the parameters' shards agree
    shards = path.returned(b, ex, slots)
    stacked = partial(path.stacked, b, ex)
    pending = phases.check(params, shards, b, chunk, stacked=stacked, gradless=ctx.gradless)
    del shards
    agree = ctx.verdict_groups.get(mp)
    if agree is not None:
        work = dist.all_reduce(pending.ok, op=dist.ReduceOp.MIN, group=agree, async_op=True)
        yield
        stats.wait(work)
    # 6. write them, or none of a parameter refused on any rank
    phases.write_(pending, b, chunk, r)
    ctx.verdict.record(b, chunk, pending.ok)


def _orthogonalizer(ctx: StepContext, b: BatchPlan, chunk: Chunk, params: list):
    """Newton-Schulz of the batch's units in its layout, with NorMuon on the blocks of the
    parameters that have it (`muon.normuon.normalize_blocks`, given their moments)."""
    g0 = params[0][1]
    offset = chunk.positions[0] if b.path == "local" else 0
    moments: list = [None] * b.size
    for k, (p, g) in enumerate(params):
        if g.get("normuon") and id(p) not in ctx.gradless:
            moments[offset + k] = (local(ctx.state[p]["normuon_v"]), g["normuon_beta2"])
    post = None
    if any(m is not None for m in moments):
        post = partial(normuon.normalize_blocks, moments=moments)
    # blocks are runs of dim 0; a matrix sharded on another dim is exchanged with that dim
    # first and orthogonalized in its own layout (see muon.blocks.orthogonalize)
    return partial(
        orthogonalize,
        block_rows=b.block_rows,
        block_shape=b.block_shape,
        moved_shape=moved_shape(b.global_shape, b.shard_tensor_dim),
        dim=b.shard_tensor_dim,
        steps=g0["ns_steps"],
        coefficients=g0["ns_coefficients"],
        dtype=getattr(torch, g0["ns_dtype"]),
        eps=g0["eps"],
        # absent in older state dicts; "standard" once the batch's Gram output blew up
        algorithm=ctx.blowups.algorithm(b, g0.get("ns_algorithm", "standard")),
        post=post,
        split=chunk.split,
        blowups=ctx.blowups.counter(b),
    )
