"""Properties of the default Newton-Schulz (`muon.newton_schulz`, `ns_algorithm="auto"` with
Polar Express coefficients, 5 steps, bf16) on generated blocks: tall, wide and square, 64 to
2048 rows, singular values log-spaced from 1 down to 1 / condition number, condition 1 to 1e4.

Against the exact polar factor U V^T (known by construction): the default's relative error is
at most 1.25x the standard iteration's on the same bf16 input (auto runs Gram on blocks of at
least 256 rows and columns where it is cheaper, the standard iteration elsewhere, and falls
back to it per block when the output leaves the band), and its top singular value lies inside
the documented band: five Polar Express steps map every normalized singular value of [0, 1]
to at most `band_top` (1.1236) in exact arithmetic; bf16 allows 0.04 beyond it (10 roundings
at 2^-8, tests/unit/test_gram_band.py). Sizes are drawn so that a block costs at most
2^27 multiply-adds per matrix product (512 x 512 x 512, 2048 x 256 x 256): ~0.2 s each here.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from muon.coefficients import band_top, resolve_coefficients
from muon.newton_schulz import newton_schulz
from tests.unit.test_gram_band import BF16_SLACK, rel_err, spectrum

STEPS = 5
TOP = band_top(resolve_coefficients("polar_express"), STEPS) + BF16_SLACK
MAX_COST = 2**27  # small^2 * big multiply-adds per product


@st.composite
def blocks(draw):
    small = draw(st.integers(64, 512))
    big = draw(st.integers(small, min(2048, MAX_COST // (small * small))))
    orientation = draw(st.sampled_from(["tall", "wide", "square"]))
    if orientation == "square":
        big = small
    rows, cols = (big, small) if orientation == "tall" else (small, big)
    cond = 10 ** draw(st.floats(0.0, 4.0))
    return rows, cols, cond, draw(st.integers(0, 2**16))


@settings(max_examples=max(4, settings.default.max_examples // 4))
@given(blocks())
@example((256, 768, 1e2, 0))  # Gram's shape (the scaled benchmark's expert blocks)
@example((2048, 64, 1e4, 1))  # the tallest, worst conditioned
@example((64, 64, 1.0, 2))  # the smallest, perfectly conditioned
def test_default_is_as_close_to_the_polar_factor_as_the_standard_iteration(block):
    rows, cols, cond, seed = block
    G, polar = spectrum(rows, cols, cond, seed)
    kw = dict(steps=STEPS, coefficients="polar_express", dtype=torch.bfloat16)
    default = newton_schulz(G, algorithm="auto", **kw)
    standard = newton_schulz(G, algorithm="standard", **kw)
    d_default, d_standard = rel_err(default, polar), rel_err(standard, polar)
    assert d_default <= 1.25 * d_standard, (d_default, d_standard)
    top = torch.linalg.svdvals(default.float()).max().item()  # float32: exact to ~1e-6
    assert top <= TOP, top
