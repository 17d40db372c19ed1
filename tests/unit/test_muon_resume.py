"""A resumed Muon equals the uninterrupted one: saved at lr 0 (a schedule's end or warm-up
start), with NorMuon's float32 moments on bfloat16 parameters. Single process, CPU."""

from __future__ import annotations

import copy

import torch
from torch import nn

from muon import Muon


def _params(dtype=torch.float32, seed=0) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(24, 16), (16, 8), (8,)]
    return [nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in shapes]


def _build(params, **kw) -> Muon:
    groups = [
        {"params": params[:2], "num_blocks": 1},
        {"params": params[2:], "algorithm": "adamw"},
    ]
    return Muon(groups, lr=0.05, weight_decay=0.1, **kw)


def _step(opt, params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    opt.step()


def _resume_equals_uninterrupted(dtype, lam, save_at: int, steps: int = 5, **kw) -> None:
    """Train `save_at` steps under LambdaLR(`lam`), save (a deep copy, as a checkpoint holds
    it), go on `steps` steps; a fresh optimizer on other weights loads the save and goes the
    same `steps`: every parameter and state tensor bit-equal."""
    params = _params(dtype)
    opt = _build(params, **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    for step in range(save_at):
        _step(opt, params, step)
        sched.step()
    saved = copy.deepcopy((opt.state_dict(), sched.state_dict(), [p.detach() for p in params]))
    for step in range(save_at, save_at + steps):
        _step(opt, params, step)
        sched.step()
    other = _params(dtype, seed=1)
    with torch.no_grad():
        for p, w in zip(other, saved[2], strict=True):
            p.copy_(w)
    resumed = _build(other, **kw)
    again = torch.optim.lr_scheduler.LambdaLR(resumed, lam)
    resumed.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    for step in range(save_at, save_at + steps):
        _step(resumed, other, step)
        again.step()
    for p, q in zip(params, other, strict=True):
        assert torch.equal(p, q), (dtype, kw)
        for key, value in opt.state[p].items():
            got = resumed.state[q][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (key, dtype, kw)


def test_state_dict_saved_at_lr_0_loads_and_resumes_bit_equal():
    """lr 0 where the save happens (a decay to min_lr_ratio=0 that comes back up, as a
    cycle would; a warm-up from 0 saved before any step): it loaded with a ValueError before."""
    _resume_equals_uninterrupted(torch.float32, lambda s: abs(s - 2) / 2, save_at=2)
    _resume_equals_uninterrupted(torch.float32, lambda s: s / 5, save_at=0)


def test_normuon_moments_stay_float32_across_a_load_of_bf16_parameters():
    """torch's load casts floating state to the parameter's dtype; NorMuon's moments are
    float32 whatever the parameters (they came back bf16: 0.0078 apart after 3 steps)."""
    for dtype in (torch.bfloat16, torch.float16):
        _resume_equals_uninterrupted(dtype, lambda s: 1.0, save_at=2, normuon=True)
