"""The fit check of a step's updates: an update that does not fit its parameter's dtype is not
applied, and the step is marked skipped on every rank, without a host read in the step.

Finite gradients and validated hyperparameters can still give an update that is not finite:
a float16 parameter overflows at 65504, so an lr large enough for `lr * O` to pass it (or a
coefficient schedule whose outputs leave the band) would write infinities. The updates of a
batch are checked together on the device: when they are the slots of one stacked tensor, as
the exchange returns them (`guard_stacked`, the usual case), in one max and one min over it,
one compare, one `torch.where` for the decay and one `masked_fill_` of the unfit slots, however
many parameters the batch has; otherwise (parameters of several groups, or some without a
grad, in one batch: `guard_batch`) with a foreach max-norm and a `masked_fill_` per parameter.
A parameter whose update fails keeps its value and its weight decay is not applied. The step's
verdict stays on the device (`SkipFlag`): all-reduced asynchronously across ranks, read by the
host only when someone asks (`last_step_skipped`, `skipped_steps`). An AdamW update whose scale
lr / (1 - beta1^t) passes the dtype's largest value is not written either; that is decided on
the host from the hyperparameters alone (`muon.optimizer.Muon._adamw_group`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from muon.planner import comm_device


def fit(alpha: float, dtype: torch.dtype) -> float:
    """`alpha` clamped to the range of `dtype`, so that torch accepts it as a scale (a larger
    one only ever multiplies an update `guard_batch` replaced by zeros)."""
    top = torch.finfo(dtype).max
    return max(-top, min(top, alpha))


def guard_batch(X: list, U: list, lr: float, decay: float, verdicts: list) -> list:
    """Decoupled weight decay `X *= decay` for the parameters whose update fits, and the updates
    to add at learning rate `lr` (at most): zeros where `lr * U` does not fit the parameters'
    dtype (its largest magnitude, in float32, above the dtype's largest value; NaN fails too).
    `X` (one dtype) and `U` are a batch's non-empty local tensors; appends the batch's bool
    verdicts `[len(X)]` to `verdicts`. Overwrites the unfit updates in `U`."""
    peaks = torch.stack(torch._foreach_norm(U, ord=math.inf, dtype=torch.float32))
    ok = _fits(peaks, lr, X[0].dtype, verdicts)
    _decay_fit_(X, ok, decay, range(len(X)))
    # In place on the returned updates (fresh buffers the apply consumes): no copy of the
    # batch, which a stacked `where` would hold beside the exchange's buffers.
    for unfit, u in zip((~ok).unbind(), U, strict=True):
        u.masked_fill_(unfit, 0)
    return U


def guard_stacked(
    X: list, U_S: torch.Tensor, slots: list[int], lr: float, decay: float, verdicts: list
) -> None:
    """`guard_batch` for updates that are the slots of one tensor `U_S` (`[S, ...]`: X[k]'s
    update is in slot `slots[k]`, the other slots and rows hold zeros): the same verdicts
    (`[S]`), decay and zeros, in a fixed number of ops however many parameters the batch has.
    Zeroes the unfit slots of `U_S` in place."""
    dims = tuple(range(1, U_S.dim()))
    # The largest magnitude of a slot is that of its update (the rest of the slot is zeros):
    # max(max, -min), exact in U_S's dtype and widened after (no float32 copy of the batch);
    # NaN propagates. Two plain reductions rather than an inf-norm, which finds the same value
    # but is an order of magnitude slower on CPU.
    peaks = torch.maximum(U_S.amax(dim=dims), U_S.amin(dim=dims).neg()).float()
    ok = _fits(peaks, lr, X[0].dtype, verdicts)
    _decay_fit_(X, ok, decay, slots)
    U_S.masked_fill_(~ok.view(-1, *(1 for _ in dims)), 0)


def _fits(peaks: torch.Tensor, lr: float, dtype: torch.dtype, verdicts: list) -> torch.Tensor:
    """Whether `lr` times each peak fits `dtype` (False for NaN and inf), appended to
    `verdicts`."""
    ok = peaks * abs(lr) <= torch.finfo(dtype).max
    verdicts.append(ok)
    return ok


def _decay_fit_(X: list, ok: torch.Tensor, decay: float, index) -> None:
    """`X[k] *= decay` where `ok[index[k]]`, in one foreach op."""
    if decay == 1.0:
        return
    # a float64 factor: rounded to the parameter's math as a Python scalar is
    scale = torch.where(ok, torch.full_like(ok, decay, dtype=torch.float64), 1.0).unbind()
    torch._foreach_mul_(X, [scale[i] for i in index])


class SkipFlag:
    """Whether a step's updates were all written, on every rank, kept on the device: `launch`
    all-reduces the step's verdicts asynchronously (one int32 MAX when the default process
    group has more than one rank); `read` waits and reads it on the host, once."""

    def __init__(self, verdicts: list[torch.Tensor], unfit_on_host: bool) -> None:
        self._work = None
        self._value: bool | None = None
        ranks = dist.is_initialized() and dist.get_world_size() > 1
        ranks = ranks and dist.get_backend() != "fake"
        if verdicts:  # made on the device; the host's verdict joins it as a Python scalar
            bad = (~torch.cat(verdicts)).any() | unfit_on_host  # each verdict is 1-D
            self.flag = bad.to(torch.int32).reshape(1)
        else:  # a fill, not a copy from the host
            device = comm_device() if ranks else "cpu"
            self.flag = torch.full((1,), int(unfit_on_host), dtype=torch.int32, device=device)
        if ranks:
            self.flag = self.flag.to(comm_device())
            self._work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)

    def wait(self) -> torch.Tensor:
        """The all-reduced flag (int32 `[1]`), on the device: waits for the collective (on
        NCCL the stream waits, not the host)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.flag

    def read(self) -> bool:
        """True when an update of the step did not fit on some rank (one host read)."""
        if self._value is None:
            self._value = bool(self.wait().item())
        return self._value
