"""Single-device building blocks: RMSNorm, partial rotary embedding, GQA attention, SwiGLU MLP.

Shape legend: B batch, T sequence, D hidden size, N heads (query), M kv heads, K head dim,
R rotary dims, F MLP inner size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.glm.model.config import GLMConfig
from models.glm.model.execution import work_dtype
from models.glm.model.qk_clip import MaxLogitRecorder
from models.glm.model.sequence import causal_mask, gathered


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)), the normalization computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = _wide(x)
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    inv_freq_R2: torch.Tensor, rotary_dim: int, theta: float, rs: dict
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones,
    with a linear ramp between the dimensions that turn beta_slow and beta_fast times over the
    original context; plus the cos/sin magnitude factor."""
    factor, original = float(rs["factor"]), float(rs["original_max_position_embeddings"])
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of zero width would divide by zero
    j = torch.arange(rotary_dim // 2, dtype=torch.float32, device=inv_freq_R2.device)
    keep = 1 - ((j - low) / (high - low)).clamp(0, 1)  # 1: extrapolate (keep), 0: interpolate
    inv_freq_R2 = (inv_freq_R2 / factor) * (1 - keep) + inv_freq_R2 * keep
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    return inv_freq_R2, float(attention_factor)


def rope_cos_sin(
    seq_len: int,
    rotary_dim: int,
    theta: float,
    device: torch.device,
    rope_scaling: dict | None = None,
    positions_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [T, R] for positions 0..T-1: angles a[t, j] = t * theta^(-2j/R)
    (YaRN-rescaled frequencies and magnitudes with `rope_scaling`), laid out as cat(a, a).
    With `positions_BT` (per-token positions, e.g. restarting at each packed document) the
    tables are [B, T, R], row (b, t) that of position positions_BT[b, t]."""
    inv_freq_R2 = 1.0 / theta ** (
        torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim
    )
    magnitude = 1.0
    if rope_scaling is not None:
        inv_freq_R2, magnitude = _yarn_inv_freq(inv_freq_R2, rotary_dim, theta, rope_scaling)
    if positions_BT is None:
        pos_T = torch.arange(seq_len, device=device, dtype=torch.float32)
    else:  # integer positions are exact in float32 below 2^24
        pos_T = positions_BT.to(device=device, dtype=torch.float32)
    ang_TR2 = pos_T[..., None] * inv_freq_R2
    ang_TR = torch.cat([ang_TR2, ang_TR2], dim=-1)
    return ang_TR.cos() * magnitude, ang_TR.sin() * magnitude


def _per_token(table_TR: torch.Tensor) -> torch.Tensor:
    """A cos/sin table ([T, R], or [B, T, R] for per-token positions) broadcast over the
    batch and heads of a [B, T, N, R] tensor."""
    return table_TR[None, :, None, :] if table_TR.dim() == 2 else table_TR[:, :, None, :]


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in its work dtype (`work_dtype`)."""
    return x.to(work_dtype(x.dtype))


def apply_interleaved_rope(x_BTNR: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor):
    """DeepSeek's interleaved RoPE on all R channels: pair (x[2j], x[2j+1]) turns by angle j.
    The result holds the rotated even channels, then the rotated odd ones (a fixed permutation
    of the interleaved layout: queries and keys get the same one, so their products do not
    change, and no de-interleaving copy is needed)."""
    half = cos_TR.shape[-1] // 2
    cos, sin = _per_token(cos_TR)[..., :half], _per_token(sin_TR)[..., :half]
    x1, x2 = _wide(x_BTNR[..., 0::2]), _wide(x_BTNR[..., 1::2])
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BTNR.dtype)


def apply_partial_rope(x_BTNK: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor):
    """Rotate the first R channels of each head (half-split "rotate_half" pairing i with i+R/2);
    channels R..K-1 pass through unchanged. The tables are constants (no gradient)."""
    return _PartialRope.apply(x_BTNK, cos_TR, sin_TR)


def _signed(sin_TR: torch.Tensor) -> torch.Tensor:
    """(-sin1, sin2): the sine table with rotate_half's sign on its first half."""
    h = sin_TR.shape[-1] // 2
    return torch.cat([-sin_TR[..., :h], sin_TR[..., h:]], dim=-1)


class _PartialRope(torch.autograd.Function):
    """`apply_partial_rope` with its backward written out: y = x cos + rotate_half(x) sin on the
    first R channels has grad_x = g cos + rotate_half^T(g sin), rotate_half^T(v) = (v2, -v1).
    Autograd through the slices and concatenations forms the same sums (two terms per element,
    so in either order the same bits) from zero-filled full-size gradients, one per slice."""

    @staticmethod
    def forward(ctx, x_BTNK, cos_TR, sin_TR):
        R = cos_TR.shape[-1]
        h = R // 2
        rot, rest = x_BTNK[..., :R], x_BTNK[..., R:]
        # rotate_half(x) sin = (x2, x1) (-sin1, sin2): the sign moves to the [T, R] table
        # (negation is exact: (-a) b == a (-b)), so no [B, T, N, R/2] negation is made.
        swapped = torch.cat([rot[..., h:], rot[..., :h]], dim=-1)
        cos, sin = _per_token(cos_TR), _per_token(_signed(sin_TR))
        out = (_wide(rot) * cos + _wide(swapped) * sin).to(x_BTNK.dtype)
        ctx.save_for_backward(cos_TR, sin_TR)  # the shared tables: nothing per call
        return torch.cat([out, rest], dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_BTNK):
        cos_TR, sin_TR = ctx.saved_tensors
        R, dtype = cos_TR.shape[-1], g_BTNK.dtype
        h = R // 2
        signed_TR = _signed(sin_TR)
        g_wide = _wide(g_BTNK[..., :R])
        g_cos = (g_wide * _per_token(cos_TR)).to(dtype)
        g_sin = (g_wide * _per_token(signed_TR)).to(dtype)  # (-g1 sin1, g2 sin2)
        grad_x1 = g_cos[..., :h] + g_sin[..., h:]
        grad_x2 = g_cos[..., h:] + g_sin[..., :h]
        grad_x = torch.cat([grad_x1, grad_x2, g_BTNK[..., R:]], dim=-1)
        # + 0.0: autograd sums the slices' zero-filled gradients, which turns -0.0 into +0.0
        return grad_x.add_(0.0), None, None


class Attention(MaxLogitRecorder, nn.Module):
    """Causal grouped-query attention with partial RoPE and optional per-head QK RMSNorm.

    With `record_max_logits` on, training forwards keep each head's largest pre-softmax logit in
    `max_logits_N` (`models.glm.model.qk_clip`; `GLMForCausalLM.take_local_max_logits`
    collects them)."""

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        D, K = config.hidden_size, config.head_dim_resolved
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            K,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(D, self.n_heads * K, bias=bias)
        self.k_proj = nn.Linear(D, self.n_kv_heads * K, bias=bias)
        self.v_proj = nn.Linear(D, self.n_kv_heads * K, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * K, D, bias=False)
        # Muon Split (optim.muon_split): each head's rows of q, k and v a block of their own
        self.q_proj.orthogonal_splits = {"weight": (K,) * self.n_heads}
        self.k_proj.orthogonal_splits = {"weight": (K,) * self.n_kv_heads}
        self.v_proj.orthogonal_splits = {"weight": (K,) * self.n_kv_heads}
        if config.use_qk_norm:
            self.q_norm = RMSNorm(K, config.rms_norm_eps)
            self.k_norm = RMSNorm(K, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_TR: torch.Tensor,
        sin_TR: torch.Tensor,
        doc_start_BT=None,
        tokens=None,
    ):
        """Output [B, T, D]; `doc_start_BT` (packed documents: each token's document's first
        position, [B, T]) masks attention to the query's own document, else plain causal.
        `tokens` (`models.glm.model.sequence.LocalTokens`): the queries are these tokens of a
        longer sequence; the keys and values are the whole sequence's (`gather_keys`)."""
        B, T, _ = x_BTD.shape
        q_BTNK = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim)
        k_BTMK = self.k_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        v_BTMK = self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTNK, k_BTMK = self.q_norm(q_BTNK), self.k_norm(k_BTMK)
        q_BTNK = apply_partial_rope(q_BTNK, cos_TR, sin_TR)
        k_BTMK = apply_partial_rope(k_BTMK, cos_TR, sin_TR)
        if tokens is not None:  # one gather of the keys and values of the whole sequence
            kv_BSF = gathered(self, torch.cat([k_BTMK, v_BTMK], -1).flatten(2), tokens)
            k_BTMK, v_BTMK = kv_BSF.unflatten(2, (self.n_kv_heads, -1)).chunk(2, -1)
        # Query head h reads kv head h // (N / M): a blockwise repeat of the kv heads.
        rep = self.n_heads // self.n_kv_heads
        k_BSNK = k_BTMK.repeat_interleave(rep, dim=2)
        v_BSNK = v_BTMK.repeat_interleave(rep, dim=2)
        q_BNTK, k_BNSK = q_BTNK.transpose(1, 2), k_BSNK.transpose(1, 2)
        mask_B1TS = causal_mask(doc_start_BT, tokens, T, x_BTD.device)
        self.record(q_BNTK, k_BNSK, self.head_dim**-0.5, mask_B1TS, tokens)
        o_BNTK = F.scaled_dot_product_attention(
            q_BNTK, k_BNSK, v_BSNK.transpose(1, 2), attn_mask=mask_B1TS, is_causal=mask_B1TS is None
        )
        return self.o_proj(o_BNTK.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); the dense MLP and the shared expert."""

    def __init__(self, hidden_size: int, inner_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.down_proj = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
