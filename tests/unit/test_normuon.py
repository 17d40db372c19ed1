"""NorMuon on one device: the update against the formula, state, resume and bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from muon import Muon
from muon.newton_schulz import orthogonalize_blocks

# (shape, blocks): tall (per-row moments), wide blocks (per-column), square blocks
SPECS = [((12, 5), 1), ((6, 16), 2), ((8, 8), 4)]
KW = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, normuon=True)


def _setup(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s, _ in SPECS]
    groups = [dict(params=[p], num_blocks=b) for p, (_, b) in zip(params, SPECS, strict=True)]
    return params, groups


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(*s, generator=gen) for s, _ in SPECS]


def _step(opt, params, step):
    for p, g in zip(params, _grads(step), strict=True):
        p.grad = g
    opt.step()


def test_matches_the_formula():
    params, groups = _setup()
    ref = [p.detach().clone() for p in params]
    opt = Muon(groups, **KW)
    momenta = [torch.zeros_like(p) for p in params]
    moments: list[torch.Tensor | None] = [None] * len(SPECS)
    for step in range(3):
        _step(opt, params, step)
        for i, (((rows, cols), blocks), g) in enumerate(zip(SPECS, _grads(step), strict=True)):
            momenta[i].lerp_(g, 0.05)
            nesterov = g.lerp(momenta[i], 0.95)
            o = orthogonalize_blocks(nesterov, blocks, 5, "polar_express", torch.float32, 1e-7)
            r = rows // blocks
            o = o.view(blocks, r, cols)
            axis = 2 if r >= cols else 1  # per row for tall/square blocks, per column for wide
            if moments[i] is None:
                moments[i] = torch.zeros(blocks, r if r >= cols else cols)
            moments[i] = 0.95 * moments[i] + 0.05 * (o**2).mean(axis)
            u = o / (moments[i].sqrt() + 1e-8).unsqueeze(axis)
            u = u * (o.norm(dim=(1, 2)) / u.norm(dim=(1, 2)))[:, None, None]
            lr = 0.05 * 0.2 * math.sqrt(max(r, cols))
            ref[i] = ref[i] * (1 - 0.05 * 0.1) - lr * u.reshape(rows, cols)
    for i, p in enumerate(params):
        # same float32 operations, in another order (lerp vs the explicit EMA, fused vs
        # separate products): a few ulps of updates ~1e-2, summed over 3 steps
        torch.testing.assert_close(p.detach(), ref[i], rtol=0, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["normuon_v"], moments[i], rtol=1e-6, atol=1e-9)
    # the normalization changed the update: NorMuon is not plain Muon
    plain_params, plain_groups = _setup()
    plain = Muon(plain_groups, **{**KW, "normuon": False})
    for step in range(3):
        _step(plain, plain_params, step)
    assert max((a - b).abs().max().item() for a, b in zip(params, plain_params, strict=True)) > 1e-3
    assert "normuon_v" not in plain.state[plain_params[0]]


def test_resume_is_bit_exact():
    params, groups = _setup()
    opt = Muon(groups, **KW)
    for step in range(2):
        _step(opt, params, step)
    saved = copy.deepcopy(opt.state_dict())  # the state dict holds the live tensors
    weights = [p.detach().clone() for p in params]
    for step in range(2, 4):
        _step(opt, params, step)
    resumed_params, resumed_groups = _setup(seed=1)  # other weights: all of it comes from disk
    with torch.no_grad():
        for p, w in zip(resumed_params, weights, strict=True):
            p.copy_(w)
    resumed = Muon(resumed_groups, **KW)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        _step(resumed, resumed_params, step)
    for p, q in zip(params, resumed_params, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["normuon_v"], resumed.state[q]["normuon_v"])


def test_gradless_parameter_keeps_its_moments():
    params, groups = _setup()
    opt = Muon(groups, **KW)
    _step(opt, params, 0)
    before = opt.state[params[0]]["normuon_v"].clone()
    for p, g in zip(params, _grads(1), strict=True):
        p.grad = g
    params[0].grad = None
    opt.step()
    assert torch.equal(opt.state[params[0]]["normuon_v"], before)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(normuon_beta2=1.0), "normuon_beta2: must be in"),
        (dict(normuon_beta2=-0.1), "normuon_beta2: must be in"),
        (dict(normuon="yes"), "normuon: must be a bool"),
    ],
)
def test_bad_knobs_are_rejected(kw, match):
    _, groups = _setup()
    with pytest.raises(ValueError, match=match):
        Muon(groups, **kw)


def test_three_dim_parameter_equals_its_2d_view_with_e_blocks():
    """[E, out, in] is E blocks of [out, in]: the same as the [E * out, in] view, num_blocks=E."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, 6, generator=gen)
    p3, p2 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.reshape(12, 6).clone())
    opt3 = Muon([p3], **KW)
    opt2 = Muon([dict(params=[p2], num_blocks=3)], **KW)
    for _ in range(2):
        g = torch.randn(3, 4, 6, generator=gen)
        p3.grad, p2.grad = g.clone(), g.reshape(12, 6).clone()
        opt3.step()
        opt2.step()
    torch.testing.assert_close(p3.detach().reshape(12, 6), p2.detach(), rtol=0, atol=1e-6)
    assert torch.equal(opt3.state[p3]["normuon_v"], opt2.state[p2]["normuon_v"])
