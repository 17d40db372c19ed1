"""NorMuon: a second-moment normalization of each orthogonalized block (arXiv 2510.05491).

After O = NS(M) for an `[r, c]` block, one running second moment per row (per column when the
block is wide, r < c: the axis with more entries, as modded-nanogpt and nanochat choose) scales
the update so that every row (column) moves at a similar rate, and a Frobenius rescale keeps the
update's overall size that of O:

    s_i = mean_j O_ij^2                       (j over the other axis)
    v_i <- beta2 * v_i + (1 - beta2) * s_i
    U = O / (sqrt(v) + 1e-8);  U <- U * ||O||_F / ||U||_F

`v` is optimizer state: one float32 vector of `state_len(r, c)` entries per block, computed by the
rank that orthogonalizes the block (it holds the whole block, so the result does not depend on
the layout). The optimizer keeps `v` replicated over the FSDP group (`muon.optimizer`), in every
rank's copy up to date for the blocks it owns, and makes the copies equal before a state dict is
taken or the plan changes (`sync_owned`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: added to sqrt(v) before dividing (the paper's and dion's value)
EPS = 1e-8


def per_row(rows: int, cols: int) -> bool:
    """True when the second moment is kept per row (tall or square blocks), else per column."""
    return rows >= cols


def state_len(rows: int, cols: int) -> int:
    """Entries of one block's second-moment vector."""
    return rows if per_row(rows, cols) else cols


def normalize(o_BRC: torch.Tensor, v_BL: torch.Tensor, beta2: float) -> torch.Tensor:
    """NorMuon of a batch of orthogonalized blocks `o_BRC`, updating their float32 second
    moments `v_BL` in place; returns the normalized blocks in `o_BRC`'s dtype."""
    rows, cols = o_BRC.shape[-2:]
    reduce = 2 if per_row(rows, cols) else 1  # the axis averaged over
    o = o_BRC.float()
    v_BL.mul_(beta2).add_(o.square().mean(dim=reduce), alpha=1 - beta2)
    u = o / (v_BL.sqrt() + EPS).unsqueeze(reduce)
    # a zero block (zero momentum) stays zero instead of 0 / 0
    scale = o.norm(dim=(1, 2)) / u.norm(dim=(1, 2)).clamp_min(torch.finfo(torch.float32).tiny)
    return (u * scale[:, None, None]).to(o_BRC.dtype)


def sync_owned(tensors: list[torch.Tensor], owned: list[torch.Tensor], group) -> None:
    """Make every rank's copy of the second moments equal: rows a rank does not own are zeroed,
    then one SUM all-reduce over `group` gives every rank the owner's value (x + 0 is exact, so
    the copies are bit-identical to the owner's). `owned[i]` is a bool mask over the blocks
    (dim 0) of `tensors[i]`; every block has exactly one owner in the group."""
    if not tensors:
        return
    for t, mask in zip(tensors, owned, strict=True):
        t[~mask] = 0
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
