"""The finiteness check of a step's updates: an update that does not fit its parameter's dtype
is not applied, and the step is marked skipped on every rank.

Finite gradients and validated hyperparameters can still give an update that is not finite:
a float16 parameter overflows at 65504, so an lr large enough for `lr * O` to pass it (or a
coefficient schedule whose outputs leave the band) would write infinities. Each parameter's
update is checked on the device (no host sync per parameter) and replaced by zeros, its
weight decay undone, when it fails; the step's verdict is read once, after the last batch
(`updates_finite`). An AdamW update whose scale lr / (1 - beta1^t) passes the dtype's
largest value is not written either (`muon.optimizer.Muon._adamw_group`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muon.planner import comm_device


def fit(alpha: float, dtype: torch.dtype) -> float:
    """`alpha` clamped to the range of `dtype`, so that torch accepts it as a scale (a larger
    one only ever multiplies an update `guard_update` replaced by zeros)."""
    top = torch.finfo(dtype).max
    return max(-top, min(top, alpha))


def guard_update(
    x: torch.Tensor, update: torch.Tensor, lr: float, g: dict, verdicts: list
) -> torch.Tensor:
    """Apply the decoupled weight decay of group `g` to the parameter `x` and return the update
    to add at learning rate `lr` (at most); when `lr * update` does not fit `x`'s dtype (its
    largest magnitude, in float32, above the dtype's largest value; NaN fails too) the decay
    is not applied and zeros are returned. Appends the 0-d verdict to `verdicts`."""
    decay = 1 - g["lr"] * g["weight_decay"]
    if not update.numel():
        return update
    peak = update.abs().amax().float() * abs(lr)
    ok = peak <= torch.finfo(x.dtype).max  # False for NaN and for an overflow to inf
    verdicts.append(ok)
    if decay != 1.0:  # x * decay as a Python scalar, rounded as an in-place mul_ would be
        x.copy_(torch.where(ok, x * decay, x))
    return torch.where(ok, update, torch.zeros((), dtype=update.dtype, device=update.device))


def updates_finite(verdicts: list[torch.Tensor]) -> bool:
    """True when every verdict of this step holds on every rank (one int32 all-reduce when the
    default process group has more than one rank, so that all ranks mark the same steps)."""
    bad = torch.stack([~v for v in verdicts]).any() if verdicts else torch.tensor(False)
    flag = bad.to(torch.int32).reshape(1)
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        flag = flag.to(comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return not bool(flag.item())
