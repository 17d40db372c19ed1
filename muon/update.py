"""The update math of one step as pure tensor functions over a batch (foreach ops: a few kernel
launches per batch, not per parameter; no host reads, so a CUDA graph can capture them).

Every argument is a list over the batch's parameters, each entry this rank's local tensor:
`M` momentum buffers, `G` gradients, `X` parameters, `U` orthogonalized updates laid out like
`X`, `target_RC` the `[rows, C]` send-buffer slots the Newton-Schulz inputs are written into
(possibly of a narrower wire dtype), `m`/`v` AdamW's moments, `t` AdamW's step counters
(float32 scalars on the parameters' device, as torch.optim's `capturable=True` keeps them).
"""

from __future__ import annotations

import torch


def muon_momentum_(M, G, target_RC, *, momentum: float, nesterov: bool) -> None:
    """M <- lerp(M, G, 1 - mu); the NS input (lerp(G, M, mu) with Nesterov, else M) into the
    targets. A narrower target rounds the float result once, as Newton-Schulz's own cast would."""
    if not M:
        return
    torch._foreach_lerp_(M, G, 1 - momentum)
    if not nesterov:
        torch._foreach_copy_(target_RC, M)
    elif target_RC[0].dtype == M[0].dtype:  # in place in the targets: no temporaries
        torch._foreach_copy_(target_RC, G)
        torch._foreach_lerp_(target_RC, M, momentum)
    else:
        torch._foreach_copy_(target_RC, torch._foreach_lerp(G, M, momentum))


def muon_apply_(X, U, *, decay: float, lr: float, row_scale=None) -> None:
    """Decoupled weight decay `X *= decay`, then `X -= lr * U` (`* row_scale`, a per-row factor
    broadcast over the other dims, for blocks of unequal heights)."""
    if not X:
        return
    if decay != 1.0:
        torch._foreach_mul_(X, decay)
    if row_scale is None:
        torch._foreach_add_(X, U, alpha=-lr)
    else:
        torch._foreach_addcmul_(X, U, [row_scale] * len(X), value=-lr)


def adamw_(X, G, m, v, t, *, lr: float, beta1: float, beta2: float, eps: float, wd: float) -> None:
    """AdamW (torch.optim.AdamW's update, with the bias corrections computed on the device from
    the step counters `t`, as its `capturable=True` form does)."""
    if not X:
        return
    torch._foreach_add_(t, 1.0)
    if wd:
        torch._foreach_mul_(X, 1 - lr * wd)
    torch._foreach_lerp_(m, G, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, G, G, value=1 - beta2)
    # step = -lr / (1 - beta1^t); denominator sqrt(v) / sqrt(1 - beta2^t) + eps
    bias1 = torch._foreach_pow(beta1, t)
    torch._foreach_sub_(bias1, 1.0)
    torch._foreach_div_(bias1, lr)
    torch._foreach_reciprocal_(bias1)
    bias2 = torch._foreach_pow(beta2, t)
    torch._foreach_neg_(bias2)
    torch._foreach_add_(bias2, 1.0)
    torch._foreach_sqrt_(bias2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bias2)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(denom, bias1)
    torch._foreach_addcdiv_(X, m, denom)
