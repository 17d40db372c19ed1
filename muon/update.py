"""The update math of one step as pure tensor functions over a batch (foreach ops: a few kernel
launches per batch, not per parameter; no host reads, so a CUDA graph can capture them).

Every argument is a list over the batch's parameters, each entry this rank's local tensor:
`M` momentum buffers, `G` gradients, `X` parameters, `U` orthogonalized updates laid out like
`X`, `target_RC` the `[rows, C]` send-buffer slots the Newton-Schulz inputs are written into
(possibly of a narrower wire dtype). AdamW groups use torch's own fused AdamW
(`adamw_group_`).
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as torch_adamw

from muon.layout import local


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


def adamw_group_(params: list, state, *, lr: float, betas, eps: float, weight_decay: float) -> None:
    """torch's fused AdamW (`torch.optim.adamw.adamw(..., fused=True)`: one kernel per device
    and dtype) over `params` (each with a grad) and their `state`. The bias corrections are
    computed on the device from the step counters, which live on the parameters' device as
    torch keeps them for `fused=True`: no host read, and a CUDA graph can capture it (the lr
    a Python float, fixed in a captured graph)."""
    X, G, m, v, t = [], [], [], [], []
    for p in params:
        st, x = state[p], local(p)
        if st["step"].device != x.device:  # a counter loaded onto the host: moved once
            st["step"] = st["step"].to(x.device, torch.float32)
        X.append(x)
        G.append(local(p.grad))
        m.append(local(st["exp_avg"]))
        v.append(local(st["exp_avg_sq"]))
        t.append(st["step"])
    if not X:
        return
    beta1, beta2 = betas
    torch_adamw(
        X,
        G,
        m,
        v,
        [],
        t,
        fused=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
