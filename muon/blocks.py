"""Orthogonalization of an assembled matrix block by block.

A shard travels as `[rows, C]` (`muon.layout`); an owner orthogonalizes what it assembled in the
parameter's Muon layout (blocks are runs of dim 0, of equal or of unequal heights, or the dim-0
slices of a >2-D parameter) and hands the blocks to NorMuon when it is on (`post`).

Gram Newton-Schulz's blow-ups (`blowups`, the optimizer's form): a block whose Gram output
left the band reaches NorMuon as zeros (its moments see no blown-up values) and leaves as NaN,
so that the update guard (`muon.guard`) refuses the update of the parameter it belongs to on
every rank holding a shard of it (the rank orthogonalizing a block is not always one of them),
and the count of such blocks is added to a device counter that the next census reads.
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
    blowups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Newton-Schulz of `m` block by block, blocks being `block_rows` runs of the parameter's dim 0
    (of unequal heights when `split`, the units' blocks grouped by height, is given), each
    orthogonalized as a `block_shape` matrix, then `post(O_BRC, blocks)` on them when given
    (NorMuon; `units` say whose blocks they are: `blocks[i]` is the (parameter, block) of the
    i-th).

    With `dim` != 0, `m` is a whole matrix in the exchanged `[shape[dim], rest]` layout; its
    Muon matrix is `[shape[0], rest]`, so it is orthogonalized in that layout and moved back.

    `blowups`, a 0-d integer device tensor, asks for Newton-Schulz's form without a host read
    (see the module docstring): the blocks whose Gram output left the band come back as NaN and
    their count is added to it.
    """
    found: list | None = None if blowups is None else []
    kw = dict(algorithm=algorithm, blowups=found)
    ids = [(j, i) for j, first, count in units for i in range(first, first + count)]

    def finish(o_BRC: torch.Tensor) -> torch.Tensor:
        o_BRC = o_BRC if post is None else post(o_BRC, ids)
        return refuse_blown_up(o_BRC, found, blowups)

    def slices(x: torch.Tensor) -> torch.Tensor:  # a >2-D parameter: one block per dim-0 slice
        return finish(
            newton_schulz(x.reshape(-1, *block_shape), steps, coefficients, dtype, eps, **kw)
        )

    def rows(x: torch.Tensor) -> torch.Tensor:  # `[rows, C]` in the Muon layout
        if split:
            ns = dict(steps=steps, coefficients=coefficients, dtype=dtype, eps=eps)
            return orthogonalize_split(x, split, ids, ns, algorithm, post, blowups)
        o = orthogonalize_blocks(x, x.size(0) // block_rows, steps, coefficients, dtype, eps, **kw)
        if post is None and not found:
            return o
        return finish(o.unflatten(0, (-1, block_rows))).reshape(o.shape)

    if dim == 0:
        if block_shape and block_shape[0] != block_rows:
            return slices(m).reshape(m.shape)
        return rows(m)
    x = m.reshape(moved_shape).movedim(0, dim)
    shape = x.shape
    o = slices(x) if len(shape) > 2 else rows(x.reshape(shape[0], -1))
    return o.reshape(shape).movedim(dim, 0).reshape(m.shape)


def orthogonalize_split(
    x, split: SplitGroups, ids, ns: dict, algorithm: str, post, blowups=None
) -> torch.Tensor:
    """Newton-Schulz of the blocks of unequal heights stacked along dim 0 of `x`, each on its
    own: blocks of one height go through one batched call (`split`, from `split_groups`;
    `ids[i]`, the (parameter, block) of block i, tells NorMuon's `post` whose moments they use;
    `blowups` as in `orthogonalize`)."""
    out = torch.empty_like(x)
    for h, members, rows in split:
        found: list | None = None if blowups is None else []
        o = newton_schulz(
            x.index_select(0, rows).view(len(members), h, -1),
            algorithm=algorithm,
            blowups=found,
            **ns,
        )
        if post is not None:
            o = post(o, [ids[i] for i in members])
        o = refuse_blown_up(o, found, blowups)
        out.index_copy_(0, rows, o.reshape(-1, x.size(1)))
    return out


def refuse_blown_up(o_BRC: torch.Tensor, found: list | None, count: torch.Tensor | None):
    """The blocks of `o_BRC` that `found` (the flags one `newton_schulz(..., blowups=found)`
    call appended; empty when it ran the standard iteration) marks as blown up, set to NaN in
    place, which the update guard refuses; their number added to the device counter `count`."""
    if not found:
        return o_BRC
    (bad,) = found
    o_BRC.masked_fill_(bad.view(-1, 1, 1), float("nan"))
    count.add_(bad.sum())
    return o_BRC
