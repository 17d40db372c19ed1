"""Orthogonalization of an assembled matrix block by block.

A shard travels as `[rows, C]` (`muon.layout`); an owner orthogonalizes what it assembled in the
parameter's Muon layout (blocks are runs of dim 0, of equal or of unequal heights, or the dim-0
slices of a >2-D parameter) and hands the blocks to NorMuon when it is on (`post`).
"""

from __future__ import annotations

import torch

from muon.newton_schulz import newton_schulz, orthogonalize_blocks

#: blocks of unequal heights, grouped by height: (height, positions of its blocks among the
#: stacked ones, the row index of those blocks as a device tensor); made once at planning
SplitGroups = list[tuple[int, list[int], torch.Tensor]]


def split_groups(heights: list[int], device) -> SplitGroups:
    """The `SplitGroups` of blocks of `heights` stacked along dim 0 (in that order)."""
    starts = [0]
    for h in heights[:-1]:
        starts.append(starts[-1] + h)
    by_height: dict[int, list[int]] = {}
    for i, h in enumerate(heights):
        by_height.setdefault(h, []).append(i)
    return [
        (
            h,
            members,
            torch.tensor(
                [r for i in members for r in range(starts[i], starts[i] + h)], device=device
            ),
        )
        for h, members in by_height.items()
    ]


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
    split: SplitGroups | None = None,
) -> torch.Tensor:
    """Newton-Schulz of `m` block by block, blocks being `block_rows` runs of the parameter's dim 0
    (of unequal heights when `split`, the units' blocks grouped by height, is given), each
    orthogonalized as a `block_shape` matrix, then `post(O_BRC, blocks)` on them when given
    (NorMuon; `units` say whose blocks they are: `blocks[i]` is the (parameter, block) of the
    i-th).

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
        if split:
            ns = dict(steps=steps, coefficients=coefficients, dtype=dtype, eps=eps)
            return orthogonalize_split(x, split, ids, ns, algorithm, post)
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


def orthogonalize_split(x, split: SplitGroups, ids, ns: dict, algorithm: str, post) -> torch.Tensor:
    """Newton-Schulz of the blocks of unequal heights stacked along dim 0 of `x`, each on its
    own: blocks of one height go through one batched call (`split`, from `split_groups`;
    `ids[i]`, the (parameter, block) of block i, tells NorMuon's `post` whose moments they use)."""
    out = torch.empty_like(x)
    for h, members, rows in split:
        o = newton_schulz(
            x.index_select(0, rows).view(len(members), h, -1), algorithm=algorithm, **ns
        )
        if post is not None:
            o = post(o, [ids[i] for i in members])
        out.index_copy_(0, rows, o.reshape(-1, x.size(1)))
    return out
