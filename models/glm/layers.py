"""Single-device building blocks: RMSNorm, partial rotary embedding, GQA attention, SwiGLU MLP.

Shape legend: B batch, T sequence, D hidden size, N heads (query), M kv heads, K head dim,
R rotary dims, F MLP inner size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm.config import GLMConfig
from models.glm.qk_clip import head_max_logits
from models.glm.recompute import is_recomputing


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)), the normalization computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rope_cos_sin(
    seq_len: int, rotary_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [T, R] for positions 0..T-1: angles a[t, j] = t * theta^(-2j/R),
    laid out as cat(a, a) for the half-split rotation."""
    inv_freq_R2 = theta ** (
        -torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim
    )
    pos_T = torch.arange(seq_len, device=device, dtype=torch.float32)
    ang_TR2 = pos_T[:, None] * inv_freq_R2[None, :]
    ang_TR = torch.cat([ang_TR2, ang_TR2], dim=-1)
    return ang_TR.cos(), ang_TR.sin()


def apply_partial_rope(x_BTNK: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor):
    """Rotate the first R channels of each head (half-split "rotate_half" pairing i with i+R/2);
    channels R..K-1 pass through unchanged."""
    R = cos_TR.shape[-1]
    rot, rest = x_BTNK[..., :R], x_BTNK[..., R:]
    x1, x2 = rot[..., : R // 2], rot[..., R // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    cos, sin = cos_TR[None, :, None, :], sin_TR[None, :, None, :]
    out = (rot.float() * cos + rotated.float() * sin).to(x_BTNK.dtype)
    return torch.cat([out, rest], dim=-1)


class Attention(nn.Module):
    """Causal grouped-query attention with partial RoPE and optional per-head QK RMSNorm.

    With `record_max_logits` on, training forwards keep each head's largest pre-softmax logit in
    `max_logits_N` (`models.glm.qk_clip`; `GLMForCausalLM.take_max_logits` collects them)."""

    record_max_logits = False

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
        if config.use_qk_norm:
            self.q_norm = RMSNorm(K, config.rms_norm_eps)
            self.k_norm = RMSNorm(K, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.max_logits_N: torch.Tensor | None = None  # not a buffer: never checkpointed

    def forward(self, x_BTD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor):
        B, T, _ = x_BTD.shape
        q_BTNK = self.q_proj(x_BTD).view(B, T, self.n_heads, self.head_dim)
        k_BTMK = self.k_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        v_BTMK = self.v_proj(x_BTD).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTNK, k_BTMK = self.q_norm(q_BTNK), self.k_norm(k_BTMK)
        q_BTNK = apply_partial_rope(q_BTNK, cos_TR, sin_TR)
        k_BTMK = apply_partial_rope(k_BTMK, cos_TR, sin_TR)
        # Query head h reads kv head h // (N / M): a blockwise repeat of the kv heads.
        rep = self.n_heads // self.n_kv_heads
        k_BTNK = k_BTMK.repeat_interleave(rep, dim=2)
        v_BTNK = v_BTMK.repeat_interleave(rep, dim=2)
        q_BNTK, k_BNTK = q_BTNK.transpose(1, 2), k_BTNK.transpose(1, 2)
        if self.record_max_logits:
            self._record(q_BNTK, k_BNTK)
        o_BNTK = F.scaled_dot_product_attention(
            q_BNTK, k_BNTK, v_BTNK.transpose(1, 2), is_causal=True
        )
        return self.o_proj(o_BNTK.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    @torch.compiler.disable
    def _record(self, q_BNTK: torch.Tensor, k_BNTK: torch.Tensor) -> None:
        # eager, as the router's load counts: the recomputation flag must not be traced
        if not torch.is_grad_enabled() or is_recomputing():
            return
        best = head_max_logits(q_BNTK.detach(), k_BNTK.detach(), self.head_dim**-0.5)
        prev = self.max_logits_N
        self.max_logits_N = best if prev is None else torch.maximum(prev, best)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); the dense MLP and the shared expert."""

    def __init__(self, hidden_size: int, inner_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inner_size, bias=False)
        self.down_proj = nn.Linear(inner_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
