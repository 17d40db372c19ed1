"""Muon Split on one device: blocks of unequal heights (`split_sizes`) are independent Muon
updates, each with its own lr, equal to torch.optim.Muon run on every block as its own matrix."""

from __future__ import annotations

import pytest
import torch

from muon import Muon

# (rows, cols), split sizes: MLA-like (nope, rope) x heads, a wide and a tall mix
SPECS = [((48, 16), (8, 4) * 4), ((20, 24), (12, 8)), ((30, 6), (6, 10, 14))]
STEPS = 3


def _params(seed: int) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape, _ in SPECS]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*shape, generator=gen) for shape, _ in SPECS]


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_split_equals_per_block_torch_muon(adjust_lr):
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    ours_p = _params(0)
    groups = [
        dict(params=[p], split_sizes=splits) for p, (_, splits) in zip(ours_p, SPECS, strict=True)
    ]
    # torch.optim.Muon's iteration (bf16, the fixed quintic), block by block below
    opt = Muon(groups, **kw, adjust_lr=adjust_lr, ns_coefficients="fixed", ns_algorithm="standard")
    blocks = [
        torch.nn.Parameter(block.clone())
        for p, (_, splits) in zip(_params(0), SPECS, strict=True)
        for block in p.detach().split(list(splits))
    ]
    ref = torch.optim.Muon(blocks, **kw, adjust_lr_fn=adjust_lr)
    for step in range(STEPS):
        grads = _grads(step)
        for p, g in zip(ours_p, grads, strict=True):
            p.grad = g.clone()
        pieces = [
            piece
            for g, (_, splits) in zip(grads, SPECS, strict=True)
            for piece in g.split(list(splits))
        ]
        for b, g in zip(blocks, pieces, strict=True):
            b.grad = g.clone()
        opt.step()
        ref.step()
    ours = torch.cat([p.detach().reshape(-1) for p in ours_p])
    theirs = torch.cat([b.detach().reshape(-1) for b in blocks])
    # the same bf16 Newton-Schulz per block, batched with the other blocks of its height: a
    # batched matmul may round differently from a single one (bf16: 2^-8 of the update), so
    # the parameters agree to well below one update (lr 0.02 x 3 steps); measured: 0.0
    assert (ours - theirs).abs().max() < 2e-3
    # ... and a whole-matrix update (no split) is far from the per-block one
    whole_p = _params(0)
    whole = Muon(whole_p, **kw, adjust_lr=adjust_lr, ns_coefficients="fixed")
    for step in range(STEPS):
        for p, g in zip(whole_p, _grads(step), strict=True):
            p.grad = g.clone()
        whole.step()
    assert (torch.cat([p.detach().reshape(-1) for p in whole_p]) - theirs).abs().max() > 1e-2


def test_equal_split_sizes_are_num_blocks():
    p = torch.nn.Parameter(torch.randn(12, 5))
    opt = Muon([dict(params=[p], split_sizes=[4, 4, 4])])
    assert opt.param_groups[0]["num_blocks"] == 3 and opt.param_groups[0]["split_sizes"] is None


@pytest.mark.parametrize(
    "group, match",
    [
        (dict(split_sizes=(4, 5)), "split_sizes: 2 blocks of 9 rows in all; shape"),
        (dict(split_sizes=(4, 0, 8)), "split_sizes: expected a sequence of positive ints"),
        (dict(split_sizes="48"), "split_sizes: expected a sequence of positive ints"),
        (dict(split_sizes=(4, 8), num_blocks=3), "num_blocks: 3 disagrees with split_sizes"),
    ],
)
def test_bad_split_sizes_are_rejected(group, match):
    with pytest.raises(ValueError, match=match):
        Muon([dict(params=[torch.nn.Parameter(torch.randn(12, 5))], **group)])


def test_split_with_normuon_keeps_one_moment_row_per_block():
    p = torch.nn.Parameter(torch.randn(20, 24))
    opt = Muon([dict(params=[p], split_sizes=(12, 8))], normuon=True, ns_dtype=torch.float32)
    p.grad = torch.randn(20, 24)
    opt.step()
    v = opt.state[p]["normuon_v"]
    # both blocks are wide: per-column moments, 24 each
    assert v.shape == (2, 24) and bool((v > 0).all())
