"""The momentum and apply phases of one batch's task (`muon.task.batch_task`): the batch's
parameters grouped by what their foreach ops share, the math being `muon.update`'s and the fit
check `muon.guard`'s. A batch costs a fixed number of dispatched ops per group of equal
hyperparameters, not per parameter: the send buffer's slots and the returned shards are views
the path made once per batch (`muon.paths`), and the update guard works on the stacked
returned tensor when the whole batch is one group (`muon.guard.guard_stacked`), which the
apply then adds in the parameters' dtype (widened once when it travelled narrower).

`params` is the batch's (or local chunk's) `[(parameter, its group)]`; `gradless` the ids of
parameters without a grad on any rank this step (`muon.census`): they keep their momentum,
send zeros and are not written.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from muon import guard, update
from muon.chunks import Chunk, adjusted_lr, row_scales
from muon.layout import from_rows, local


def momentum_(params: list, slots: list, shard_dim: int, state, gradless: set[int]) -> None:
    """The momentum phase (`muon.update.muon_momentum_`) into the send-buffer slots, per
    (momentum, nesterov) of the batch's groups."""
    lists: dict[tuple, tuple[list, list, list]] = {}
    zero = []
    for (p, g), slot in zip(params, slots, strict=True):
        if id(p) in gradless:
            zero.append(slot)
            continue
        buf = local(state[p]["momentum_buffer"])
        out = lists.setdefault((g["momentum"], g["nesterov"]), ([], [], []))
        out[0].append(buf)
        out[1].append(local(p.grad))
        same = shard_dim == 0 and slot.shape == buf.shape  # from_rows would be a no-op view
        out[2].append(slot if same else from_rows(slot, buf, shard_dim))
    if zero:
        torch._foreach_zero_(zero)
    for (mu, nesterov), (M, G, target) in lists.items():
        update.muon_momentum_(M, G, target, momentum=mu, nesterov=nesterov)


@dataclass
class Pending:
    """One chunk's returned updates, checked on this rank and not yet written (`check`):
    `ok` (bool `[len(params)]`, False where this rank's shard of the parameter at that position
    cannot be written) is what the ranks holding the parameter's other shards all-reduce (MIN)
    before `write_`, so that a parameter is written on every rank or on none."""

    ok: torch.Tensor
    #: per (lr, adjust_lr, rows, cols, weight_decay, dtype): (parameters, updates, positions)
    groups: dict
    #: the one group holds every parameter: its updates are the stacked tensor's
    stacked: torch.Tensor | None


def check(
    params: list, shards: list, b, chunk: Chunk, *, stacked: Callable[[], torch.Tensor], gradless
) -> Pending:
    """The update check of batch `b`'s returned `shards` (views of `stacked()`, in slots
    `chunk.slots`: `muon.paths.Path.stacked`) on this rank: decoupled weight decay then the
    update at the per-block lr must fit each parameter's dtype (`muon.guard.fits`). Writes
    nothing. A parameter without a grad anywhere, or without rows here, is never unfit here."""
    if len(b.global_shape) > 2:  # each dim-0 slice is a block
        rows, cols = b.block_shape
    groups: dict[tuple, tuple[list, list, list]] = {}
    for k, ((p, g), o) in enumerate(zip(params, shards, strict=True)):
        x = local(p)
        if id(p) in gradless or not x.numel():  # no grad anywhere, or nothing here
            continue
        if len(b.global_shape) <= 2:
            rows, cols = b.global_shape[0] // g["num_blocks"], b.block_cols
        key = (g["lr"], g["adjust_lr"], rows, cols, g["weight_decay"], x.dtype)
        same = b.shard_tensor_dim == 0 and o.shape == x.shape
        out = groups.setdefault(key, ([], [], []))
        out[0].append(x)
        out[1].append(o if same else from_rows(o, x, b.shard_tensor_dim))
        out[2].append(k)
    whole = len(groups) == 1 and len(next(iter(groups.values()))[0]) == len(params)
    flags: list = [None] * len(params)
    for (lr, mode, rows, cols, wd, _), (X, U, members) in groups.items():
        top = max(adjusted_lr(lr, mode, h, cols) for h in b.split_sizes or (rows,))
        if whole:  # the peaks of the stacked tensor's slots, taken in position order
            U_S = stacked()
            peaks = guard.slot_peaks(U_S).index_select(0, chunk.slot_index)
            return Pending(guard.fits(X, peaks, top, 1 - lr * wd), groups, U_S)
        ok = guard.fits(X, guard.peaks(U), top, 1 - lr * wd)
        for k, flag in zip(members, ok.unbind(), strict=True):
            flags[k] = flag
    device = local(params[0][0]).device
    if all(f is None for f in flags):  # nothing written here: nothing unfit here
        return Pending(torch.ones(len(params), dtype=torch.bool, device=device), groups, None)
    fine = torch.ones((), dtype=torch.bool, device=device)
    return Pending(torch.stack([fine if f is None else f for f in flags]), groups, None)


def write_(pending: Pending, b, chunk: Chunk, r: int) -> None:
    """The apply phase (`muon.update.muon_apply_`) of batch `b` on FSDP rank `r`, once every
    rank holding a shard agreed on `pending.ok`: decoupled weight decay (`muon.guard.decay_`),
    then the orthogonalized update at the per-block lr, per (lr, adjust_lr) group; neither for
    a parameter unfit on any rank (its update zeroed, its value kept)."""
    ok, U_S = pending.ok, pending.stacked
    by_position = None if U_S is not None else ok.unbind()
    for (lr, mode, rows, cols, wd, dtype), (X, U, members) in pending.groups.items():
        if U_S is not None:
            group_ok = ok
            unfit_S = ok.new_zeros(U_S.size(0)).index_copy_(0, chunk.slot_index, ~ok)
            guard.zero_unfit_slots_(U_S, unfit_S)
            U = _widened(U_S, X, chunk.slots, b.shard_tensor_dim) or U
        else:
            group_ok = torch.stack([by_position[k] for k in members])
            guard.zero_unfit_(U, group_ok)
        guard.decay_(X, group_ok, 1 - lr * wd)
        if b.split_sizes:  # blocks of unequal heights: each height its own lr, per row
            if mode not in chunk.row_scales:  # adjust_lr changed since planning: made once
                chunk.row_scales.update(row_scales(b, r, [mode], X[0].device))
            scale = chunk.row_scales[mode]
            update.muon_apply_(X, U, decay=1.0, lr=guard.fit(lr, dtype), row_scale=scale)
        else:
            alpha = guard.fit(adjusted_lr(lr, mode, rows, cols), dtype)
            update.muon_apply_(X, U, decay=1.0, lr=alpha)


def _widened(U_S: torch.Tensor, X: list, slots: list, shard_dim: int) -> list | None:
    """The updates of `X` as views of `U_S` cast once to the parameters' dtype, when `U_S` is
    narrower (the wire dtype) and each of its slots is exactly its parameter's rows: the apply's
    foreach add is then one kernel over the batch on a GPU (its fast path wants one dtype), not
    one per parameter. The same values: the cast is exact, and an add of a narrower tensor
    widens it first. None otherwise (the add then widens each update itself)."""
    x = X[0]  # a batch's parameters have one local shape on a rank
    if U_S.dtype == x.dtype or shard_dim != 0 or math.prod(U_S.shape[1:]) != x.numel():
        return None
    wide = U_S.to(x.dtype)
    if wide.shape[1:] != x.shape:  # e.g. `[E, out, in]` experts travel as `[E, out * in]`
        wide = wide.view(U_S.shape[0], *x.shape)
    parts = wide.unbind()
    return [parts[s] for s in slots]
