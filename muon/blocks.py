"""Orthogonalization of an assembled matrix block by block.

A shard travels as `[rows, C]` (`muon.layout`); an owner orthogonalizes what it assembled in the
parameter's Muon layout (blocks are runs of dim 0, of equal or of unequal heights, or the dim-0
slices of a >2-D parameter) and hands the blocks to NorMuon when it is on (`post`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from muon.newton_schulz import newton_schulz, orthogonalize_blocks


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a DTensor (a plain tensor is its own)."""
    return t.to_local() if isinstance(t, DTensor) else t


def orthogonalize(
    m: torch.Tensor,
    block_rows,
    steps,
    coefficients,
    dtype,
    eps,
    block_shape=(),
    moved_shape=(),
    dim=0,
    algorithm="",
    units=(),
    post=None,
    heights=(),
) -> torch.Tensor:
    """Newton-Schulz of `m` block by block, blocks being `block_rows` runs of the parameter's dim 0
    (`heights` rows each when they are unequal), each orthogonalized as a `block_shape` matrix,
    then `post(O_BRC, blocks)` on them when given (NorMuon; `units` say whose blocks they are).

    With `dim` != 0, `m` is a whole matrix in the exchanged `[shape[dim], rest]` layout; its
    Muon matrix is `[shape[0], rest]`, so it is orthogonalized in that layout and moved back.
    """
    kw = dict(algorithm=algorithm)
    ids = [(j, i) for j, first, count in units for i in range(first, first + count)]

    def finish(o_BRC: torch.Tensor) -> torch.Tensor:
        return o_BRC if post is None else post(o_BRC, ids)

    def slices(x: torch.Tensor) -> torch.Tensor:  # a >2-D parameter: one block per dim-0 slice
        return finish(
            newton_schulz(x.reshape(-1, *block_shape), steps, coefficients, dtype, eps, **kw)
        )

    def rows(x: torch.Tensor) -> torch.Tensor:  # `[rows, C]` in the Muon layout
        if heights:
            ns = dict(steps=steps, coefficients=coefficients, dtype=dtype, eps=eps)
            return orthogonalize_split(x, [heights[i] for _, i in ids], ids, ns, algorithm, post)
        o = orthogonalize_blocks(x, x.size(0) // block_rows, steps, coefficients, dtype, eps, **kw)
        return o if post is None else finish(o.reshape(-1, block_rows, o.size(1))).reshape(o.shape)

    if dim == 0:
        if block_shape and block_shape[0] != block_rows:
            return slices(m).reshape(m.shape)
        return rows(m)
    x = m.reshape(moved_shape).movedim(0, dim)
    shape = x.shape
    o = slices(x) if len(shape) > 2 else rows(x.reshape(shape[0], -1))
    return o.reshape(shape).movedim(dim, 0).reshape(m.shape)


def orthogonalize_split(x, heights, ids, ns: dict, algorithm: str, post) -> torch.Tensor:
    """Newton-Schulz of the blocks of unequal `heights` stacked along dim 0 of `x`, each on its
    own: blocks of one height go through one batched call (`ids[i]`, the (parameter, block) of
    block i, tells NorMuon's `post` whose moments they use)."""
    starts = [0]
    for h in heights[:-1]:
        starts.append(starts[-1] + h)
    out = torch.empty_like(x)
    by_height: dict[int, list[int]] = {}
    for i, h in enumerate(heights):
        by_height.setdefault(h, []).append(i)
    for h, members in by_height.items():
        rows = torch.cat([torch.arange(starts[i], starts[i] + h) for i in members]).to(x.device)
        o = newton_schulz(
            x.index_select(0, rows).view(len(members), h, -1), algorithm=algorithm, **ns
        )
        if post is not None:
            o = post(o, [ids[i] for i in members])
        out.index_copy_(0, rows, o.reshape(-1, x.size(1)))
    return out
