"""float16 Newton-Schulz normalizes, in float32, before it casts (muon/newton_schulz.py,
muon/wire.py).

float16 flushes magnitudes below ~6e-8 to zero and overflows above 65504; momentum of either
size must give the same orthogonalized update as at scale 1. Single process, CPU."""

import pytest
import torch
from torch import nn

from muon import Muon, newton_schulz
from muon.wire import wire_dtype

# float16 carries 11 significant bits: each product rounds at 2^-11 ~ 5e-4 relative, and five
# Newton-Schulz steps near the contracting fixed band keep the error within a few roundings;
# 1e-2 absolute on entries of size ~1/sqrt(cols) ~ 0.2 leaves a 4x margin over that budget.
FP16_ATOL = 1e-2


@pytest.mark.parametrize("scale", [3e-8, 1e6], ids=["below-fp16-subnormals", "norm-above-65504"])
def test_float16_newton_schulz_normalizes_in_the_input_dtype(scale):
    G = torch.randn(16, 24, generator=torch.Generator().manual_seed(3))
    # entries ~3e-8 (below float16's smallest subnormal, 6e-8) with a norm above eps = 1e-7
    ref = newton_schulz(G * scale, dtype=torch.float32)
    got = newton_schulz(G * scale, dtype=torch.float16)
    assert torch.isfinite(got).all() and got.abs().amax() > 0.1
    torch.testing.assert_close(got, ref, rtol=0, atol=FP16_ATOL)


@pytest.mark.parametrize("scale", [3e-8, 1e6], ids=["tiny-momentum", "huge-momentum"])
def test_float16_muon_step_is_not_a_no_op(scale):
    """One Muon step with ns_dtype=float16 on a float32 parameter equals the float32 step."""
    G = torch.randn(16, 24, generator=torch.Generator().manual_seed(4)) * scale
    moved = {}
    for dtype in ("float16", "float32"):
        w = nn.Parameter(torch.zeros(16, 24))
        opt = Muon([w], ns_dtype=dtype, lr=0.1)
        w.grad = G.clone()
        opt.step()
        moved[dtype] = w.detach().clone()
    assert moved["float16"].abs().amax() > 0
    torch.testing.assert_close(moved["float16"], moved["float32"], rtol=0, atol=0.1 * FP16_ATOL)


def test_float16_never_travels_for_wider_parameters():
    """Exchanged matrices are unnormalized momentum: float16 on the wire would flush or overflow
    them before Newton-Schulz normalizes, so they travel in the parameter's dtype."""
    assert wire_dtype(torch.float32, torch.float16) == torch.float32
    assert wire_dtype(torch.bfloat16, torch.float16) == torch.bfloat16
    assert wire_dtype(torch.float16, torch.float16) == torch.float16
    assert wire_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
