"""Muon's decoupled weight decay on CUDA is the in-place multiply by the Python scalar, bit
for bit, in bfloat16, float16 and float32 (`muon.guard.decay_`). Its factor was a 0-d float64
tensor, which CUDA reads in the parameter's dtype: 0.998 became bfloat16's 0.99609 (twice the
decay) and 0.9999 became 1.0 (none). Skipped where no CUDA device is present."""

import pytest
import torch

from muon import Muon, guard

DECAYS = [1 - 0.02 * 0.1, 1 - 1e-3 * 0.1]  # 0.998 and 0.9999


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("decay", DECAYS)
def test_decay_is_the_python_scalar_multiply(dtype, decay):
    gen = torch.Generator(device="cuda").manual_seed(0)
    X = [torch.randn(64, 48, generator=gen, device="cuda").to(dtype) for _ in range(3)]
    want = [x.clone() for x in X]
    ok = torch.tensor([True, False, True], device="cuda")
    guard.decay_(X, ok, decay)
    want[0].mul_(decay), want[2].mul_(decay)
    for k, (x, w) in enumerate(zip(X, want, strict=True)):
        assert torch.equal(x, w), (k, dtype, decay)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", DECAYS)
def test_a_step_with_zero_gradients_decays_as_the_scalar(dtype, decay):
    """A whole step (two same-shape matrices stacked in one batch, and one alone): zero
    gradients give zero updates, so each parameter is exactly p * decay."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = [(64, 48), (64, 48), (32, 80)]
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, device="cuda").to(dtype)) for s in shapes
    ]
    lr, wd = 0.02, (1 - decay) / 0.02
    opt = Muon(params, lr=lr, weight_decay=wd)
    want = [p.detach().clone().mul_(1 - lr * wd) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    assert not opt.last_step_skipped
    for k, (p, w) in enumerate(zip(params, want, strict=True)):
        assert torch.equal(p.detach(), w), (k, dtype, decay)
