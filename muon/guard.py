"""The update check of a step, and the one definition of a skipped step.

A step is skipped when some update of it was not written (`Muon.last_step_skipped`, counted by
`Muon.skipped_steps`); two kinds, by what they leave moved:
- a non-finite gradient on any rank (`muon.census`): nothing moves (parameters, momentum,
  NorMuon's moments, AdamW's state), on every rank;
- a refused update: a parameter whose written value `p * decay - lr * U` could pass its dtype
  (`fits`: float16 overflows at 65504; an lr large enough, or a coefficient schedule whose
  outputs leave the band, would write infinities) or holds NaN (a Gram Newton-Schulz block
  that left its band, `muon.blowups`) keeps its value on every rank holding a shard of it (no
  weight decay either): the ranks agree on each parameter's verdict in a device all-reduce
  before anything of it is written (`muon.phases.check`), so no shard moves if one is refused.
  Every other parameter and the AdamW groups are updated; the refused parameter's momentum and
  NorMuon moments have moved (keeping them would hold a copy of every batch's momentum until
  its verdict; they took in a finite gradient). Each refusal is counted
  (`Muon.refused_updates`) and warned once, naming the parameter, at the next census.
An AdamW update whose scale lr / (1 - beta1^t) passes the dtype's largest value is refused as
well, decided on the host from the hyperparameters alone (`muon.optimizer.Muon._adamw_group`).

The updates of a batch are checked together on the device: when they are the slots of one
stacked tensor, as the exchange returns them (the usual case), in one max and one min over it
and one compare (`slot_peaks`, `fits`), however many parameters the batch has; otherwise
(parameters of several groups, or some without a grad, in one batch) with a foreach max-norm.
After the agreement the refused updates are zeroed (`zero_unfit_slots_`, `zero_unfit_`) and
the decay applied to the others (`decay_`). The step's verdict stays on the device
(`SkipFlag`): all-reduced asynchronously across ranks, read by the host only when someone asks
(`last_step_skipped`, `skipped_steps`)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from muon.wire import collectives_move_data, comm_device

FLOAT32_MAX = torch.finfo(torch.float32).max


def fit(alpha: float, dtype: torch.dtype) -> float:
    """`alpha` clamped to the range of `dtype`, so that torch accepts it as a scale. Only a
    zero update is ever written at a clamped scale: `fits` refuses any other (the scale would
    write a smaller update than asked)."""
    top = torch.finfo(dtype).max
    return max(-top, min(top, alpha))


def peaks(U: list) -> torch.Tensor:
    """The largest magnitude of each update of `U`, float32 `[len(U)]` (NaN stays NaN)."""
    return torch.stack(torch._foreach_norm(U, ord=math.inf, dtype=torch.float32))


def slot_peaks(U_S: torch.Tensor) -> torch.Tensor:
    """`peaks` of the slots of one stacked tensor `U_S` (`[S, ...]`), float32 `[S]`: the largest
    magnitude of a slot is that of its update (the rest of the slot is zeros). max(max, -min),
    exact in U_S's dtype and widened after (no float32 copy of the batch); NaN propagates. Two
    plain reductions rather than an inf-norm, which finds the same value but is an order of
    magnitude slower on CPU."""
    dims = tuple(range(1, U_S.dim()))
    return torch.maximum(U_S.amax(dim=dims), U_S.amin(dim=dims).neg()).float()


def fits(X: list, u_peaks: torch.Tensor, lr: float, decay: float) -> torch.Tensor:
    """Whether each parameter of `X` (one dtype) can be written as `X * decay - lr * U` with
    `U`'s largest magnitudes `u_peaks`: bool `[len(X)]`; NaN fails. float16 (largest value
    65504, which a weight can reach): the value written, bounded by max|X| * decay + lr * max|U|
    in float32, must fit, so no entry written is ever infinite (a parameter at 40000 with
    lr * |U| = 65000 is refused, though lr * |U| alone fits). Wider dtypes (3.4e38, beyond any
    weight): lr * max|U| must fit (reading every parameter for its largest entry would cost
    the step a pass over the weights). An lr past the dtype's range cannot scale a non-zero
    update in that dtype (`fit` would clamp it and write a smaller update): such an update is
    refused, a zero one passes."""
    top, lr = torch.finfo(X[0].dtype).max, abs(lr)
    if X[0].dtype == torch.float16:
        x_peaks = peaks(X)
        if lr > top:
            return (u_peaks == 0) & (x_peaks * decay <= top)
        return torch.add(u_peaks * lr, x_peaks, alpha=decay) <= top
    if lr > top:
        return u_peaks == 0
    # u * lr <= top in one compare; at most float32's largest value, so inf (and NaN) fail
    # even where lr * inf would be NaN (lr 0)
    return u_peaks <= (min(top / lr, FLOAT32_MAX) if lr else FLOAT32_MAX)


def decay_(X: list, ok: torch.Tensor, decay: float) -> None:
    """`X[k] *= decay` where `ok[k]` (else by exactly 1), in one foreach op. The factor is a
    `[1]`-shaped tensor in the parameters' math dtype (float32, float64 for float64): a shaped
    operand takes part in type promotion, so the product is made in that dtype and rounded once
    into the parameter, as an in-place multiply by the Python scalar rounds it. (A 0-d factor
    does not take part: CUDA reads it in the parameter's dtype, rounding 0.998 to bfloat16's
    0.99609, twice the decay, and 0.9999 to 1.0, none.)"""
    if decay == 1.0:
        return
    scale = torch.where(ok, decay, 1.0)  # float32: Python scalars take the default dtype
    if X[0].dtype == torch.float64:
        scale = torch.where(ok, torch.tensor(decay, dtype=torch.float64), 1.0)
    torch._foreach_mul_(X, list(scale.view(-1, 1).unbind()))


def zero_unfit_(U: list, ok: torch.Tensor) -> None:
    """Zeros in place of the updates `U[k]` that are not `ok[k]` (fresh buffers the apply
    consumes: no copy of the batch, which a stacked `where` would hold beside the exchange's
    buffers)."""
    for unfit, u in zip((~ok).unbind(), U, strict=True):
        u.masked_fill_(unfit, 0)


def zero_unfit_slots_(U_S: torch.Tensor, unfit_S: torch.Tensor) -> None:
    """Zeros in place of the slots of `U_S` that `unfit_S` (`[S]`) marks, in one op."""
    U_S.masked_fill_(unfit_S.view(-1, *(1 for _ in U_S.shape[1:])), 0)


class SkipFlag:
    """Whether a step's updates were all written, on every rank, kept on the device: `launch`
    all-reduces the step's verdicts asynchronously (one int32 MAX when the default process
    group has more than one rank); `read` waits and reads it on the host, once."""

    def __init__(self, verdicts: list[torch.Tensor], unfit_on_host: bool) -> None:
        self._work = None
        self._value: bool | None = None
        ranks = collectives_move_data()
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

    @property
    def value(self) -> bool | None:
        """What `read` found, without a read: None until it has been read."""
        return self._value
