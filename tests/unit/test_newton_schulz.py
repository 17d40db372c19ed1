"""Acceptance tests for muon/newton_schulz.py (single process, CPU, fast).

The reference used here is a float64 transcription of the spec: per-block Frobenius normalization
(clamped by eps), tall blocks transposed to the wide orientation, quintic iteration
X <- a X + (b A + c A^2) X with A = X X^T, triple i taken from the coefficient list (steps beyond
the list reuse its last triple).

Singular-value bands. In exact arithmetic NS acts on each normalized singular value x = s/||s||_2
separately, x <- a x + b x^3 + c x^5. Iterating that scalar map over a dense grid of x in
[0.01, 1] gives, after 5 steps:
  fixed (3.4445, -4.7750, 2.0315):   [0.6818, 1.1344]
  tuned (You Jiacheng's five triples): [0.9778, 1.0318]
  polar_express (derived, safety 1.01):  [0.8703, 1.1236]  (and >= 0.8461 down to x = 0.001)
(for x < 0.01 the band widens: fixed reaches 1.2024 at x ~ 0.004, and x -> 0 maps to 0, so the
test inputs are built with every normalized singular value >= 0.01). The float32 tests allow
0.005 beyond these bands. bf16 rounds each product to 2^-8 ~ 0.004 relative; near the bands the
map contracts (fixed: slope a + 3b + 5c = -0.72 at x = 1), so rounding does not pile up across
steps and the last step's few roundings remain: the bf16 tests allow 0.04 (10 x 2^-8).

Gram Newton-Schulz computes the same polynomial of X X^T, so in exact arithmetic it equals the
standard iteration; the float64 runs agree to rounding (1e-12), the float32 ones within the error
budget derived next to their test.
"""

import math

import pytest
import torch

from muon.coefficients import NS_COEFFICIENTS, polar_express_coefficients
from muon.cost import gram_is_cheaper, ns_flops
from muon.newton_schulz import newton_schulz, orthogonalize_blocks
from tests.reference import ref_ns

FIXED = (3.4445, -4.7750, 2.0315)
TUNED = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
FIXED_BAND = (0.6818, 1.1344)
TUNED_BAND = (0.9778, 1.0318)
PE_BAND = (0.8703, 1.1236)
MIN_NORMALIZED_SV = 0.01


def scalar_map(x, coefficients, steps=5):
    for i in range(steps):
        a, b, c = coefficients[min(i, len(coefficients) - 1)]
        x = a * x + b * x**3 + c * x**5
    return x


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def controlled_spectrum(batch, rows, cols, gen, lo=MIN_NORMALIZED_SV):
    """Random [batch, rows, cols] matrices with random singular vectors and a spectrum whose
    normalized singular values s/||s|| are spread log-uniformly and all >= lo."""
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(batch, rows, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(batch, cols, k, generator=gen, dtype=torch.float64))
    # s_max = 1, others log-uniform in [lo * sqrt(k), 1]: then ||s|| <= sqrt(k) and
    # s/||s|| >= lo for every singular value.
    logs = torch.empty(batch, k, dtype=torch.float64).uniform_(
        math.log(lo * math.sqrt(k)), 0.0, generator=gen
    )
    logs[:, 0] = 0.0
    s = logs.exp()
    G = U @ torch.diag_embed(s) @ V.mT
    scale = torch.empty(batch, 1, 1, dtype=torch.float64).uniform_(0.01, 100.0, generator=gen)
    return (G * scale).float()


# ----------------------------------------------------------------------------- coefficient sets


def test_named_coefficient_sets():
    fixed = [tuple(t) for t in NS_COEFFICIENTS["fixed"]]
    assert len(fixed) >= 1
    for t in fixed:
        assert t == pytest.approx(FIXED, abs=1e-12)
    tuned = [tuple(t) for t in NS_COEFFICIENTS["tuned"]]
    assert len(tuned) == 5
    assert tuned[0] == pytest.approx(TUNED[0], abs=1e-12)
    for got, want in zip(tuned, TUNED, strict=True):
        assert got == pytest.approx(want, abs=1e-12)


def test_unknown_coefficient_set_raises():
    with pytest.raises(ValueError, match="coefficients"):
        newton_schulz(torch.randn(8, 8), coefficients="no_such_set")


# ----------------------------------------------------------------------------- numerics vs ref


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (40, 40), (3, 24, 16), (2, 3, 16, 24)])
@pytest.mark.parametrize("coefficients", ["fixed", "tuned"])
def test_float32_matches_reference(shape, coefficients):
    gen = torch.Generator().manual_seed(1)
    G = torch.randn(*shape, generator=gen)
    want = ref_ns(G, [FIXED] if coefficients == "fixed" else TUNED)
    got = newton_schulz(G, coefficients=coefficients, dtype=torch.float32)
    assert got.shape == G.shape
    assert got.dtype == torch.float32
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("steps", [1, 3, 7])
def test_steps_and_explicit_coefficients(steps):
    gen = torch.Generator().manual_seed(2)
    G = torch.randn(24, 40, generator=gen)
    # explicit list of triples, steps beyond the list reuse the last triple
    got_tuned = newton_schulz(G, steps=steps, coefficients="tuned", dtype=torch.float32)
    got_explicit = newton_schulz(G, steps=steps, coefficients=TUNED, dtype=torch.float32)
    want = ref_ns(G, TUNED, steps=steps)
    assert rel_err(got_tuned, want) < 1e-4
    assert rel_err(got_explicit, want) < 1e-4
    got_fixed = newton_schulz(G, steps=steps, coefficients=[FIXED], dtype=torch.float32)
    assert rel_err(got_fixed, ref_ns(G, [FIXED], steps=steps)) < 1e-4
    # a different number of steps really is a different result
    other = ref_ns(G, TUNED, steps=steps + 1)
    assert rel_err(got_tuned, other) > 1e-3


def test_bf16_default_matches_torch_muon_ns():
    """Default compute dtype is bf16, matching torch.optim.Muon's own NS to bf16 accuracy."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    gen = torch.Generator().manual_seed(3)
    for shape in [(64, 32), (32, 96), (48, 48)]:
        G = torch.randn(*shape, generator=gen)
        got = newton_schulz(G)
        want = _zeropower_via_newtonschulz(G, FIXED, 5, 1e-7).float()
        assert got.dtype == torch.float32
        # two bf16 computations: each within a few 2^-8 (~0.004) of exact (module docstring)
        assert rel_err(got, want) < 0.03, shape
        # and bf16 compute is measurably different from float32 compute (dtype honoured)
        f32 = newton_schulz(G, dtype=torch.float32)
        assert rel_err(got, f32) > 1e-4
        assert rel_err(f32, ref_ns(G, [FIXED])) < 1e-4


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_returns_input_dtype_and_is_pure(in_dtype, ns_dtype):
    G = torch.randn(3, 16, 24, generator=torch.Generator().manual_seed(4)).to(in_dtype)
    G_copy = G.clone()
    out = newton_schulz(G, dtype=ns_dtype)
    assert out.dtype == in_dtype
    assert out.shape == G.shape
    assert torch.equal(G, G_copy), "newton_schulz modified its input"
    assert out.data_ptr() != G.data_ptr()
    # deterministic
    assert torch.equal(out, newton_schulz(G, dtype=ns_dtype))


def test_batched_equals_per_matrix():
    gen = torch.Generator().manual_seed(5)
    G = torch.randn(5, 24, 40, generator=gen)
    G[2] *= 1e-3  # each matrix has its own norm
    G[3] *= 1e3
    batched = newton_schulz(G, dtype=torch.float32)
    for i in range(G.size(0)):
        single = newton_schulz(G[i], dtype=torch.float32)
        torch.testing.assert_close(batched[i], single, rtol=1e-5, atol=1e-6)


def test_tall_is_transpose_of_wide():
    G = torch.randn(64, 24, generator=torch.Generator().manual_seed(6))
    tall = newton_schulz(G, dtype=torch.float32)
    wide = newton_schulz(G.T.contiguous(), dtype=torch.float32)
    torch.testing.assert_close(tall, wide.T, rtol=1e-5, atol=1e-6)


def test_zero_input_is_finite():
    Z = torch.zeros(2, 8, 12)
    for dt in (torch.float32, torch.bfloat16):
        out = newton_schulz(Z, dtype=dt)
        assert torch.isfinite(out).all()
        assert torch.equal(out, torch.zeros_like(out))


def test_scale_invariance():
    G = torch.randn(24, 40, generator=torch.Generator().manual_seed(7))
    a = newton_schulz(G, dtype=torch.float32)
    b = newton_schulz(G * 1e4, dtype=torch.float32)
    c = newton_schulz(G * 1e-4, dtype=torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- orthogonality


def _band_check(coefficients, band, dtype, slack, **variant):
    gen = torch.Generator().manual_seed(8)
    coef_list = {"fixed": [FIXED], "tuned": TUNED}.get(coefficients)
    coef_list = coef_list or list(NS_COEFFICIENTS[coefficients])
    for rows, cols in [(32, 32), (24, 64), (64, 24), (48, 40)]:
        G = controlled_spectrum(24, rows, cols, gen)
        s_in = torch.linalg.svdvals(G.double())
        x = s_in / s_in.norm(dim=-1, keepdim=True)
        assert x.min() >= MIN_NORMALIZED_SV * 0.999  # precondition of the band
        out = newton_schulz(G, coefficients=coefficients, dtype=dtype, **variant)
        s_out = torch.linalg.svdvals(out.double())
        lo, hi = band
        assert s_out.min().item() >= lo - slack, (rows, cols, s_out.min().item())
        assert s_out.max().item() <= hi + slack, (rows, cols, s_out.max().item())
        if dtype == torch.float32:
            # each singular value follows the scalar polynomial map
            predicted = scalar_map(x, coef_list).abs().sort(dim=-1, descending=True).values
            torch.testing.assert_close(s_out, predicted, rtol=0, atol=2e-3)


def test_singular_value_band_fixed_float32():
    _band_check("fixed", FIXED_BAND, torch.float32, 0.005)


def test_singular_value_band_tuned_float32():
    _band_check("tuned", TUNED_BAND, torch.float32, 0.005)


def test_singular_value_band_fixed_bf16():
    _band_check("fixed", FIXED_BAND, torch.bfloat16, 0.04)


def test_singular_value_band_tuned_bf16():
    _band_check("tuned", TUNED_BAND, torch.bfloat16, 0.04)


def test_gaussian_rectangular_inputs_are_orthogonalized():
    """Plain random Gaussian (aspect >= 2, so well conditioned) lands in the fixed band."""
    gen = torch.Generator().manual_seed(9)
    for shape in [(64, 32, 128), (64, 128, 32), (16, 96, 24)]:
        out = newton_schulz(torch.randn(*shape, generator=gen), dtype=torch.float32)
        s = torch.linalg.svdvals(out.double())
        assert s.min() >= FIXED_BAND[0] - 0.005 and s.max() <= FIXED_BAND[1] + 0.005


# ----------------------------------------------------------------------------- fused blocks


@pytest.mark.parametrize(
    "E,out_dim,in_dim",
    [(4, 16, 24), (4, 24, 16), (3, 20, 20), (1, 16, 32)],
    ids=["wide-blocks", "tall-blocks", "square-blocks", "single-block"],
)
def test_orthogonalize_blocks_equals_per_block(E, out_dim, in_dim):
    gen = torch.Generator().manual_seed(10)
    W = torch.randn(E * out_dim, in_dim, generator=gen)
    # very different block scales: each block must use its own norm
    for e in range(E):
        W[e * out_dim : (e + 1) * out_dim] *= 10.0 ** (e - 1)
    W_copy = W.clone()
    fused = orthogonalize_blocks(W, E, dtype=torch.float32)
    assert fused.shape == W.shape and fused.dtype == W.dtype
    assert torch.equal(W, W_copy)
    for e in range(E):
        block = W[e * out_dim : (e + 1) * out_dim]
        want = newton_schulz(block, dtype=torch.float32)
        torch.testing.assert_close(
            fused[e * out_dim : (e + 1) * out_dim], want, rtol=1e-5, atol=1e-6
        )
        assert rel_err(fused[e * out_dim : (e + 1) * out_dim], ref_ns(block, [FIXED])) < 1e-4
    if E > 1:
        whole = newton_schulz(W, dtype=torch.float32)
        assert rel_err(fused, whole) > 0.1, "blocks were orthogonalized as one matrix"


def test_gate_up_blocks_are_separate():
    """A fused gate+up weight [E*2I, H] declares 2E blocks: gate and up of each expert are
    orthogonalized separately, not as one [2I, H] matrix per expert."""
    E, inter, hidden = 3, 8, 32
    gen = torch.Generator().manual_seed(11)
    W = torch.randn(E * 2 * inter, hidden, generator=gen)
    W[:inter] *= 100.0  # expert 0's gate much larger than its up
    fused = orthogonalize_blocks(W, 2 * E, dtype=torch.float32)
    for k in range(2 * E):
        rows = slice(k * inter, (k + 1) * inter)
        want = ref_ns(W[rows], [FIXED])
        assert rel_err(fused[rows], want) < 1e-4, k
    per_expert = orthogonalize_blocks(W, E, dtype=torch.float32)
    assert rel_err(fused, per_expert) > 0.1


def test_orthogonalize_blocks_default_bf16_and_dtype():
    W = torch.randn(4 * 16, 24, generator=torch.Generator().manual_seed(12))
    out = orthogonalize_blocks(W, 4)
    assert out.dtype == torch.float32 and out.shape == W.shape
    want = newton_schulz(W.view(4, 16, 24)).reshape(64, 24)
    assert rel_err(out, want) < 0.03
    f32 = orthogonalize_blocks(W, 4, dtype=torch.float32)
    assert rel_err(out, f32) > 1e-4  # bf16 was really used by default
    out_bf16 = orthogonalize_blocks(W.bfloat16(), 4)
    assert out_bf16.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- polar express

# Amsel, Persson, Musco, Gower (2025), "The Polar Express", first step for l = 1e-3 as published.
PE_PUBLISHED_FIRST = (8.28721201814563, -23.595886519098837, 17.300387312530933)
PE_CUSHION = 0.02407327424182761


def test_polar_express_steps_are_minimax():
    """Chebyshev alternation: a step is the best odd quintic on its fit interval iff p - center
    reaches its extreme deviation with alternating signs at 4 points (endpoints and 2 interior
    extrema). The derivation without the safety factor reproduces the published first step."""
    raw = polar_express_coefficients(safety=1.0)
    assert raw[0] == pytest.approx(PE_PUBLISHED_FIRST, rel=1e-9)
    lo, hi = 1e-3, 1.0
    for a, b, c in raw[:6]:
        fit_lo = max(lo, PE_CUSHION * hi)
        x = torch.linspace(fit_lo, hi, 200001, dtype=torch.float64)
        p = a * x + b * x**3 + c * x**5
        p_lo, p_hi = p[0].item(), p[-1].item()
        assert a * lo + b * lo**3 + c * lo**5 + p_hi == pytest.approx(2.0, abs=1e-12)
        dev = (p_hi - p_lo) / 2  # the equioscillation amplitude
        interior = p[1:-1]
        peaks = (interior > p[:-2]) & (interior > p[2:])
        troughs = (interior < p[:-2]) & (interior < p[2:])
        assert p.max().item() <= p_hi + 1e-9 * dev and p.min().item() >= p_lo - 1e-9 * dev
        if dev > 1e-6:  # collapsed intervals use the limit quintic, no interior extrema left
            assert interior[peaks].max().item() == pytest.approx(p_hi, abs=1e-7 * dev + 1e-12)
            assert interior[troughs].min().item() == pytest.approx(p_lo, abs=1e-7 * dev + 1e-12)
            assert x[1:-1][peaks].max() < x[1:-1][troughs].min()  # +, -, +, - in order
        lo = a * lo + b * lo**3 + c * lo**5
        hi = 2 - lo
    safe = polar_express_coefficients()
    for (a, b, c), (sa, sb, sc) in zip(raw, safe, strict=True):  # p(x / 1.01)
        assert (sa, sb, sc) == pytest.approx((a / 1.01, b / 1.01**3, c / 1.01**5), rel=1e-12)
    assert NS_COEFFICIENTS["polar_express"] == safe


def test_polar_express_band_float32_and_bf16():
    _band_check("polar_express", PE_BAND, torch.float32, 0.005)
    _band_check("polar_express", PE_BAND, torch.bfloat16, 0.04)


def _orthogonality_error(O):
    """||O O^T - I||_F on the small side (O^T O of a wide block has rank < its size)."""
    small = O.double() @ O.double().mT if O.size(-2) <= O.size(-1) else O.double().mT @ O.double()
    eye = torch.eye(small.size(-1), dtype=torch.float64)
    return (small - eye).norm(dim=(-2, -1)).max().item()


def test_polar_express_beats_fixed_at_the_same_steps():
    gen = torch.Generator().manual_seed(20)
    G = controlled_spectrum(16, 32, 96, gen, lo=0.001)
    for dtype in (torch.float32, torch.bfloat16):
        for steps in (5, 7):
            pe = newton_schulz(G, steps, "polar_express", dtype)
            fixed = newton_schulz(G, steps, "fixed", dtype)
            assert _orthogonality_error(pe) < _orthogonality_error(fixed), (dtype, steps)


# ----------------------------------------------------------------------------- gram newton-schulz


def test_flop_model():
    m, n = 64, 192
    assert ns_flops(m, n) == 5 * (4 * m * m * n + 2 * m**3)
    assert ns_flops(n, m) == ns_flops(m, n)
    # restarts before steps 1 and 3 (the default): segments of 1, 2 and 2 steps, each 2 X-sized
    # products (4 m^2 n = 12 m^3) and 4 L - 3 Gram-sized products (2 m^3 each):
    # 3 * 12 m^3 + (1 + 5 + 5) * 2 m^3 = 58 m^3 against 70 m^3
    assert ns_flops(m, n, algorithm="gram") == 58 * m**3
    # restart before step 2 only: segments of 2 and 3 steps: 2 * 12 m^3 + 14 * 2 m^3 = 52 m^3
    assert ns_flops(m, n, algorithm="gram", restarts=(2,)) == 52 * m**3
    assert ns_flops(m, n, algorithm="gram", restarts=()) == 46 * m**3
    assert gram_is_cheaper(m, n) and gram_is_cheaper(n, m)
    assert not gram_is_cheaper(m, m) and not gram_is_cheaper(m, m + m // 4)
    # symmetric halves: 3/4 of each symmetric product
    assert ns_flops(m, n, symmetric=True) == 5 * (
        0.75 * 2 * m * m * n + 0.75 * 2 * m**3 + 2 * m * m * n
    )


def test_bad_algorithm_raises():
    with pytest.raises(ValueError, match="ns_algorithm"):
        newton_schulz(torch.randn(8, 24), algorithm="fast")


VARIANTS = [
    dict(algorithm="gram"),
    dict(algorithm="gram", restarts=()),
    dict(algorithm="gram", restarts=(1, 3)),
    dict(algorithm="gram", symmetric=True),
    dict(symmetric=True),
]
VARIANT_IDS = ["gram", "gram-norestart", "gram-r13", "gram-sym", "standard-sym"]
SHAPES = [(24, 72), (72, 24), (5, 16, 48), (3, 48, 16)]
SHAPE_IDS = ["wide", "tall", "batched-wide", "batched-tall"]


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("coefficients", ["fixed", "tuned", "polar_express"])
def test_variants_match_the_reference(variant, coefficients):
    """float64: the rearranged products equal the standard iteration to rounding. float32: each
    of the ~20 products rounds at 2^-24 relative to its largest entries; the accumulated Gram
    polynomial Q has entries up to ~prod(a_i) <= 8.2 * 4.07 ~ 34 (Polar Express' first segment)
    over singular values of order 1, so the output error is bounded by 20 * 34 * 6e-8 ~ 4e-5 of
    its norm; 2e-4 leaves a factor 5."""
    gen = torch.Generator().manual_seed(21)
    for shape in SHAPES:
        G = torch.randn(*shape, generator=gen)
        coefs = list(NS_COEFFICIENTS[coefficients])
        want = ref_ns(G, coefs)
        got64 = newton_schulz(G.double(), coefficients=coefficients, dtype=torch.float64, **variant)
        assert rel_err(got64, want) < 1e-12, shape
        got = newton_schulz(G, coefficients=coefficients, dtype=torch.float32, **variant)
        assert got.shape == G.shape and got.dtype == G.dtype
        assert rel_err(got, want) < 2e-4, shape


def test_auto_runs_gram_on_large_rectangular_blocks_only():
    """ns_algorithm="auto": Gram where it needs fewer FLOPs and the block has at least
    GRAM_MIN_ROWS rows and columns (per-call cost dominates below), the standard iteration
    elsewhere, with results bit-identical to the algorithm it picks."""
    from muon.cost import GRAM_MIN_ROWS, effective_algorithm

    big, mid = GRAM_MIN_ROWS, GRAM_MIN_ROWS // 2
    assert effective_algorithm(big, 3 * big, 5, "auto") == "gram"
    assert effective_algorithm(3 * big, big, 5, "auto") == "gram"
    assert effective_algorithm(mid, 3 * mid, 5, "auto") == "standard"
    assert effective_algorithm(mid, 3 * mid, 5, "gram") == "gram"
    assert effective_algorithm(2 * big, 2 * big, 5, "auto") == "standard"
    gen = torch.Generator().manual_seed(26)
    for shape, picks in (((2, big, 3 * big), "gram"), ((2, mid, 3 * mid), "standard")):
        G = torch.randn(*shape, generator=gen)
        kw = dict(coefficients="polar_express")
        assert newton_schulz(G, algorithm="auto", **kw).equal(
            newton_schulz(G, algorithm=picks, **kw)
        )
    with pytest.raises(ValueError, match="auto"):
        ns_flops(64, 192, algorithm="auto")


def test_parse_variant_validates_both_names():
    import importlib

    parse_variant = importlib.import_module("muon.coefficients").parse_variant
    assert parse_variant("fixed,standard") == {
        "ns_coefficients": "fixed",
        "ns_algorithm": "standard",
    }
    for text, named in (("fixed", "COEFFICIENTS,ALGORITHM"), ("cubic,gram", "ns_coefficients")):
        with pytest.raises(ValueError, match=named):
            parse_variant(text)
    with pytest.raises(ValueError, match="standard, gram, auto"):
        parse_variant("fixed,fast")


def test_gram_on_square_blocks_is_the_standard_iteration():
    G = torch.randn(4, 40, 40, generator=torch.Generator().manual_seed(22))
    for dtype in (torch.float32, torch.bfloat16):
        a = newton_schulz(G, coefficients="polar_express", dtype=dtype)
        b = newton_schulz(G, coefficients="polar_express", dtype=dtype, algorithm="gram")
        assert torch.equal(a, b)


def test_gram_band_float32():
    _band_check("polar_express", PE_BAND, torch.float32, 0.005, algorithm="gram")
    _band_check("tuned", TUNED_BAND, torch.float32, 0.005, algorithm="gram")


def test_gram_bf16_against_polar_factor():
    """bf16 Gram vs bf16 standard against the float64 polar factor. Both round every product
    at 2^-8; Gram's accumulated polynomial Q (condition up to ~1/sigma_min of its segment) makes
    its error a few times larger on ill-conditioned blocks, so Gram may be worse than standard
    by at most 2 * 2^-8 * (1 / 0.01) ~ 0.08 in relative distance for spectra down to 0.01, and
    both stay inside the method's band plus that slack."""
    gen = torch.Generator().manual_seed(23)
    for rows, cols in [(24, 72), (72, 24)]:
        G = controlled_spectrum(16, rows, cols, gen)
        U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        polar = U @ Vh
        std = newton_schulz(G, coefficients="polar_express")
        gram = newton_schulz(G, coefficients="polar_express", algorithm="gram")
        d_std, d_gram = rel_err(std, polar), rel_err(gram, polar)
        assert d_gram <= d_std + 0.08, (d_gram, d_std)
        s = torch.linalg.svdvals(gram.double())
        assert s.min() >= PE_BAND[0] - 0.08 and s.max() <= PE_BAND[1] + 0.08


@pytest.mark.parametrize(
    "variant", VARIANTS[:2] + VARIANTS[3:4], ids=VARIANT_IDS[:2] + VARIANT_IDS[3:4]
)
def test_gram_expert_blocks_are_separate(variant):
    E, out_dim, in_dim = 4, 12, 40
    gen = torch.Generator().manual_seed(24)
    W = torch.randn(E * out_dim, in_dim, generator=gen)
    for e in range(E):
        W[e * out_dim : (e + 1) * out_dim] *= 10.0 ** (e - 1)
    kw = dict(coefficients="polar_express", dtype=torch.float32, **variant)
    fused = orthogonalize_blocks(W, E, **kw)
    coefs = list(NS_COEFFICIENTS["polar_express"])
    for e in range(E):
        block = W[e * out_dim : (e + 1) * out_dim]
        got = fused[e * out_dim : (e + 1) * out_dim]
        torch.testing.assert_close(got, newton_schulz(block, **kw), rtol=1e-5, atol=1e-6)
        assert rel_err(got, ref_ns(block, coefs)) < 2e-4


def test_gram_blocks_that_leave_the_band_are_recomputed(monkeypatch):
    """A Gram output whose largest singular value (Krylov estimate on the output) exceeds the
    method's band by GRAM_SLACK is replaced by the standard iteration, block by block."""
    import importlib

    # (muon/__init__ exports the function newton_schulz, which shadows the module's name)
    ns_module = importlib.import_module("muon.newton_schulz")

    G = torch.randn(4, 16, 48, generator=torch.Generator().manual_seed(25))
    kw = dict(coefficients="polar_express", dtype=torch.float32)
    gram = newton_schulz(G, algorithm="gram", **kw)
    standard = newton_schulz(G, **kw)
    real_gram = ns_module.gram_iteration

    def broken(X, *args):
        out = real_gram(X, *args)
        out[1] *= 100.0  # one block blown up, as bf16 R updates can do
        return out

    monkeypatch.setattr(ns_module, "gram_iteration", broken)
    got = newton_schulz(G, algorithm="gram", **kw)
    torch.testing.assert_close(got[1], standard[1], rtol=0, atol=0)
    for i in (0, 2, 3):
        torch.testing.assert_close(got[i], gram[i], rtol=0, atol=0)
    assert newton_schulz(G[1], algorithm="gram", **kw).equal(standard[1])
