"""The hand-written backwards and reorderings of the train step give autograd's plain
formulation bit for bit (docs/models.md, "Work the train step leaves out"): partial RoPE, the
routed outputs' weighted sum, and QK-clip's recorded maxima scaled after the maximum.

Bit for bit: every compared tensor is viewed as integers of its width, so even a zero's sign
or a NaN's payload would count; the plain formulations are written out here as the code had
them."""

import pytest
import torch

from models.glm.model.layers import apply_partial_rope, rope_cos_sin
from models.glm.model.moe import _Combine
from models.glm.model.qk_clip import head_max_logits

DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(_BITS[a.dtype]), b.view(_BITS[b.dtype]))


def _wide(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _plain_rope(x, cos_TR, sin_TR):
    R = cos_TR.shape[-1]
    rot, rest = x[..., :R], x[..., R:]
    x1, x2 = rot[..., : R // 2], rot[..., R // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_TR[None, :, None, :], sin_TR[None, :, None, :]
    out = (_wide(rot) * cos + _wide(rotated) * sin).to(x.dtype)
    return torch.cat([out, rest], dim=-1)


def _plain_combine(y_AD, w_A, token_A, like_ND):
    out = torch.zeros_like(like_ND)
    out.index_add_(0, token_A, (y_AD * w_A[:, None]).to(like_ND.dtype))
    return out


def _with_zeros(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Some exact zeros of both signs: where a sum of zeros could tell the orders apart."""
    pick = torch.rand(t.shape, generator=gen) < 0.1
    signs = torch.where(torch.rand(t.shape, generator=gen) < 0.5, -1.0, 1.0).to(t.dtype)
    return torch.where(pick, signs * 0.0, t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("K", "R"), [(32, 16), (16, 16), (64, 8)])
def test_partial_rope_forward_and_backward_are_autograds(dtype, K, R):
    gen = torch.Generator().manual_seed(K + R)
    cos, sin = rope_cos_sin(37, R, 10000.0, torch.device("cpu"))
    x = _with_zeros(torch.randn(2, 37, 3, K, generator=gen).to(dtype), gen)
    g = _with_zeros(torch.randn(2, 37, 3, K, generator=gen).to(dtype), gen)
    got = []
    for rope in (_plain_rope, apply_partial_rope):
        xx = x.clone().requires_grad_()
        y = rope(xx, cos, sin)
        y.backward(g)
        got.append((y.detach(), xx.grad))
    for want, mine in zip(*got, strict=True):
        assert _same_bits(want, mine)


@pytest.mark.parametrize("dtype", DTYPES)
def test_routed_weighted_sum_forward_and_backward_are_autograds(dtype):
    gen = torch.Generator().manual_seed(3)
    N, K, D, E = 41, 4, 24, 16
    experts_NK = torch.rand(N, E, generator=gen).topk(K, dim=-1).indices
    token_A = torch.argsort(experts_NK.reshape(-1), stable=True) // K  # expert-sorted
    weight_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    y = _with_zeros(torch.randn(N * K, D, generator=gen).to(dtype), gen)
    w = torch.rand(N * K, generator=gen).to(weight_dtype)
    like = torch.empty(N, D, dtype=dtype)
    g = _with_zeros(torch.randn(N, D, generator=gen).to(dtype), gen)
    got = []
    for combine in (_plain_combine, _Combine.apply):
        yy, ww = y.clone().requires_grad_(), w.clone().requires_grad_()
        out = combine(yy, ww, token_A, like)
        out.backward(g)
        got.append((out.detach(), yy.grad, ww.grad))
    for want, mine in zip(*got, strict=True):
        assert _same_bits(want, mine)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sparse", [False, True])
def test_max_logits_scaled_after_the_maximum_are_those_of_scaled_logits(dtype, sparse):
    gen = torch.Generator().manual_seed(5)
    B, N, T, Kd = 2, 3, 150, 16  # two query chunks
    q = torch.randn(B, N, T, Kd, generator=gen).to(dtype) * 20
    k = torch.randn(B, N, T, Kd, generator=gen).to(dtype)
    q[0, 0, 7, 0], k[1, 2, 0, 1] = float("inf"), float("nan")
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    keep = (torch.rand(B, 1, T, T, generator=gen) > 0.3) & causal if sparse else None
    for scale in (32**-0.5, 0.3, 1.7):
        work = torch.promote_types(dtype, torch.float32)
        s = torch.matmul(q.to(work), k.to(work).transpose(-1, -2)) * scale
        s = s.masked_fill(~(causal if keep is None else keep), -torch.inf)
        want = s.amax(dim=(0, 2, 3))
        assert _same_bits(want, head_max_logits(q, k, scale, keep))


def test_max_logits_refuse_a_scale_that_is_not_positive():
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="scale"):
        head_max_logits(q, q, 0.0)
