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

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from muon.layout import local as _local

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


# ------------------------------------------------ the optimizer's side (`muon.optimizer.Muon`)
def init_state(opt) -> None:
    """NorMuon's second moments: `[num_blocks, L]` float32 per parameter (L the rows or the
    columns of a block, `muon.normuon.state_len`), replicated over the FSDP group and sharded
    on the experts' EP dim, so that DCP saves one copy and reshards it onto any mesh."""
    for mp, batches in opt.plan.plans:
        for b in batches:
            for i in b.param_indices:
                p, gi = opt.plan.params[i]
                g = opt.param_groups[gi]
                if not g.get("normuon"):
                    continue
                blocks, cols = g["num_blocks"], math.prod(p.shape[1:])
                heights = g.get("split_sizes") or (p.shape[0] // blocks,)
                if p.ndim > 2:  # one [d1, d2 * ...] block per dim-0 slice
                    blocks, heights, cols = p.shape[0], (p.shape[1],), math.prod(p.shape[2:])
                length = max(state_len(h, cols) for h in heights)
                if not isinstance(p, DTensor):
                    v = torch.zeros(blocks, length, device=p.device)
                else:
                    placements = [
                        Shard(0) if d == mp.ep_mesh_dim else Replicate()
                        for d in range(p.device_mesh.ndim)
                    ]
                    local = torch.zeros(
                        blocks // mp.non_fsdp_shard_factor, length, device=p.to_local().device
                    )
                    v = DTensor.from_local(
                        local,
                        p.device_mesh,
                        placements,
                        run_check=False,
                        shape=(blocks, length),
                        stride=(length, 1),
                    )
                opt.state[p].setdefault("normuon_v", v)


def sync(opt) -> None:
    """Give every rank the owners' NorMuon moments (collective over each FSDP group): a
    rank updates only the blocks it orthogonalizes, so the copies differ between steps."""
    for mp, batches in opt.plan.plans:
        if not mp.sharded:
            continue
        tensors, owned = [], []
        for b in batches:
            for j, i in enumerate(b.param_indices):
                p, gi = opt.plan.params[i]
                if not opt.param_groups[gi].get("normuon"):
                    continue
                v = _local(opt.state[p]["normuon_v"])
                mask = torch.zeros(v.size(0), dtype=torch.bool, device=v.device)
                for unit, first, count in b.units_on(mp.fsdp_rank):
                    if unit == j:
                        mask[first : first + count] = True
                tensors.append(v)
                owned.append(mask)
        sync_owned(tensors, owned, opt.plan.groups[(mp, 0)])


def normalize_blocks(o_BRC: torch.Tensor, blocks, moments) -> torch.Tensor:
    """NorMuon of the orthogonalized blocks `o_BRC` of several parameters: `blocks[i]` is the
    (parameter j, block index) of `o_BRC[i]`, `moments[j]` parameter j's (local second moments
    `[num_blocks, L]`, beta2), or None to leave its blocks as they are (NorMuon off, or no
    gradient). Normalizes in place and updates the moments of those blocks; returns `o_BRC`.
    Parameters of one beta2 whose blocks are one run of `o_BRC` are normalized in one call
    (their moments stacked, then copied back); runs of positions and block indices are slices,
    so no index tensor is made."""
    by_param: dict[int, tuple[list, list]] = {}
    for pos, (j, i) in enumerate(blocks):
        by_param.setdefault(j, ([], []))[0].append(pos)
        by_param[j][1].append(i)
    by_beta2: dict[float, list] = {}
    for j, (pos, idx) in by_param.items():
        if moments[j] is not None:
            v_all, beta2 = moments[j]
            by_beta2.setdefault(beta2, []).append((pos, v_all, _selector(idx, v_all.device)))
    for beta2, members in by_beta2.items():
        at = _selector([q for pos, _, _ in members for q in pos], o_BRC.device)
        if len(members) > 1 and not isinstance(at, slice):  # not one run: one at a time
            for member in members:
                _normalize_members(o_BRC, [member], _selector(member[0], o_BRC.device), beta2)
        else:
            _normalize_members(o_BRC, members, at, beta2)
    return o_BRC


def _normalize_members(o_BRC, members, at, beta2: float) -> None:
    """`normalize` of the blocks `o_BRC[at]`, whose moments are the members' rows, in order."""
    length = state_len(*o_BRC.shape[1:])  # blocks of unequal heights: a prefix of the row
    views = [v_all[rows_of, :length] for _, v_all, rows_of in members]
    v = views[0] if len(views) == 1 else torch.cat(views)
    o_BRC[at] = normalize(o_BRC[at], v, beta2)
    if len(views) > 1:  # the stacked moments back into each parameter's state
        torch._foreach_copy_(views, list(v.split([w.size(0) for w in views])))
    for (_, v_all, rows_of), w in zip(members, views, strict=True):
        if not isinstance(rows_of, slice):  # an index copy, not a view: write it back
            v_all[rows_of, :length] = w


def _selector(seq: list[int], device) -> slice | torch.Tensor:
    """`seq` as a slice when it is an arithmetic run (always, for the layouts the plan builds:
    a unit's blocks, or every k-th one), else as an index tensor."""
    step = seq[1] - seq[0] if len(seq) > 1 else 1
    if step > 0 and all(b - a == step for a, b in zip(seq, seq[1:], strict=False)):
        return slice(seq[0], seq[-1] + 1, step)
    return torch.tensor(seq, device=device)
