"""Gram Newton-Schulz keeps the documented band on ill-conditioned bf16 blocks (newton_schulz).

The default `ns_algorithm="auto"` runs Gram on these shapes; each case compares it with the
standard iteration on the same bf16 input. Band (tests/unit/test_newton_schulz.py): after five
Polar Express steps every normalized singular value in [0.001, 1] lands in [0.846, 1.1236];
bf16 allows 0.04 beyond it (10 roundings at 2^-8). Single process, CPU.
"""

import importlib

import pytest
import torch

from muon.cost import effective_algorithm
from muon.newton_schulz import newton_schulz

ns_module = importlib.import_module("muon.newton_schulz")  # muon exports a function of that name

BAND = (0.846, 1.1236)
BF16_SLACK = 0.04
# Gram with restarts every two steps evaluates the standard iteration's polynomial with a few
# more bf16 roundings (2^-8 relative each) per segment; its distance to the polar factor may
# exceed the standard iteration's by at most 4 such roundings.
ERR_SLACK = 4 * 2**-8


def spectrum(m, n, cond, seed, rank=None):
    """[m, n] float32 with random singular vectors and singular values log-spaced from 1 down
    to 1/cond (the first `rank` of them, the rest exactly 0), and its polar factor U V^T
    (restricted to the nonzero part)."""
    gen = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=gen))
    s = torch.logspace(0, -torch.log10(torch.tensor(float(cond))).item(), k)
    r = k if rank is None else rank
    s[r:] = 0
    return (U * s) @ V.T, U[:, :r] @ V[:, :r].T


def rel_err(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


CASES = [
    # (m, n, condition number, rank): the two measured cases first
    (512, 1536, 1e2, None),
    pytest.param(1024, 3072, 1e2, None, marks=pytest.mark.slow),  # ~10 s on one idle core
    (512, 1536, 1e3, None),
    (512, 1536, 1e4, None),
    (768, 256, 1e2, None),  # tall: orthogonalized as its transpose
    (256, 768, 1e2, 64),  # rank-deficient
]


@pytest.mark.parametrize("m, n, cond, rank", CASES)
def test_auto_keeps_the_band_on_ill_conditioned_bf16_blocks(m, n, cond, rank):
    assert effective_algorithm(m, n, 5, "auto") == "gram"
    G, polar = spectrum(m, n, cond, seed=m + int(cond), rank=rank)
    auto = newton_schulz(G, coefficients="polar_express", algorithm="auto")
    std = newton_schulz(G, coefficients="polar_express", algorithm="standard")
    s = torch.linalg.svdvals(auto.float())  # float32: exact to ~1e-6, far below the slack
    r = rank or min(m, n)
    assert s.max() <= BAND[1] + BF16_SLACK, (s.max().item(), (s > BAND[1] + BF16_SLACK).sum())
    x = torch.logspace(0, -torch.log10(torch.tensor(cond)), min(m, n))[:r]
    if x[-1] / x.norm() >= 1e-3:  # every normalized singular value inside the band's range
        assert s[:r].min() >= BAND[0] - BF16_SLACK, s[:r].min().item()
    if rank is not None:
        # casting to bf16 puts noise of ~2^-8 of the entries into the null space, which Polar
        # Express lifts like any small singular value (to ~0.25 here): Gram may lift it no higher
        # than the standard iteration does, up to bf16 slack
        s_std = torch.linalg.svdvals(std.float())
        assert s[r:].max() <= s_std[r:].max() + BF16_SLACK, (s[r:].max(), s_std[r:].max())
    d_auto, d_std = rel_err(auto, polar), rel_err(std, polar)
    assert d_auto <= d_std + ERR_SLACK, (d_auto, d_std)


@pytest.mark.parametrize("scale", [1e-30, 0.0], ids=["tiny", "zero"])
def test_auto_on_tiny_and_zero_blocks_matches_standard(scale):
    """A block whose norm is below eps is not normalized (it stays tiny) and zero stays zero:
    Gram and the standard iteration agree and stay finite."""
    G = torch.randn(256, 768, generator=torch.Generator().manual_seed(5)) * scale
    auto = newton_schulz(G, coefficients="polar_express", algorithm="auto")
    std = newton_schulz(G, coefficients="polar_express", algorithm="standard")
    assert torch.isfinite(auto).all()
    if scale == 0:
        assert not auto.any() and not std.any()
    else:
        # the 5-step polynomial is ~ a1*...*a5 * x for tiny x: the results agree to bf16 rounding
        torch.testing.assert_close(auto, std, rtol=0.05, atol=1e-35)


def test_output_check_catches_a_block_just_above_the_band(monkeypatch):
    """The check reads the output: one singular direction of one block pushed to 1.25 (above
    the band plus slack, not a blow-up) sends that block, and only it, to the standard path."""
    G = torch.stack([spectrum(256, 768, 10.0, seed=s)[0] for s in range(3)])
    kw = dict(coefficients="polar_express", algorithm="gram")
    good = newton_schulz(G, **kw)
    std = newton_schulz(G[1:2], coefficients="polar_express")[0]  # the fallback's batch of one
    real = ns_module.gram_iteration

    def off_band(X, *args):
        out = real(X, *args)
        U, S, Vh = torch.linalg.svd(out[1].float(), full_matrices=False)
        S[0] = 1.25
        out[1] = ((U * S) @ Vh).to(out.dtype)
        return out

    monkeypatch.setattr(ns_module, "gram_iteration", off_band)
    got = newton_schulz(G, **kw)
    assert torch.equal(got[1], std)
    assert torch.equal(got[0], good[0]) and torch.equal(got[2], good[2])


@pytest.mark.parametrize("shape", [(256, 768), (3, 64, 192), (1, 16)])
def test_output_check_is_a_lower_bound(shape):
    """The check's estimate never exceeds the largest singular value (Rayleigh-Ritz on an
    orthonormal basis), so a flagged block is truly out of band. float32 blocks: each of its
    two products per vector sums n terms, so the estimate may pass the exact value by at most
    about 2 n 2^-24 relative (9e-5 at n = 768); 1e-4 allows that."""
    X = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    top = torch.linalg.matrix_norm(X, ord=2)
    est = ns_module.top_singular_value(X)
    assert est.shape == top.shape
    assert (est <= top * (1 + 1e-4)).all(), (est, top)
    assert (est >= 0.5 * top).all(), (est, top)  # and not vacuous
