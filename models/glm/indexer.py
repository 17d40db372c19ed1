"""DeepSeek Sparse Attention (DSA): the lightning indexer that picks the keys each query attends.

The indexer scores every (query s, key t <= s) pair with a few small ReLU heads,
    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] / sqrt(C)), w = weights_proj(x) / sqrt(M),
with its own projections (`wq_b` reads the attention's low-rank query, `wk` the layer input, one
key head normalized by a LayerNorm with bias) and interleaved RoPE on the first qk_rope_head_dim
channels; the attention then keeps the top min(index_topk, T) keys per query.

Training (`GLMConfig.indexer_training`):
- "frozen": the indexer runs under no_grad and its parameters have requires_grad False, so they
  get no gradient and no optimizer state (as when fine-tuning a released GLM-5 checkpoint).
- "kl": DeepSeek-V3.2's objective: KL(p_attn || p_index) over the selected keys, p_attn the main
  attention's probabilities summed over heads and L1-normalized (a detached target), p_index the
  softmax of the index scores. The indexer reads detached inputs, so the KL trains the indexer
  only and the main model's gradients are the same as in frozen mode.

Shape legend: B batch, T sequence (queries) and S keys, D hidden, Q low-rank query width,
M indexer heads, C indexer head width, K kept keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm.config import GLMConfig
from models.glm.layers import apply_interleaved_rope

# The indexer key norm's eps is fixed in GLM-5 (transformers hard-codes it too), independent of
# rms_norm_eps.
INDEXER_NORM_EPS = 1e-6


class Indexer(nn.Module):
    """The lightning indexer of one "full" DSA layer (parameter names as in GLM-5 checkpoints:
    `wq_b`, `wk`, `k_norm` (LayerNorm with bias), `weights_proj`)."""

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        D, Q = config.hidden_size, config.q_lora_rank
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.wq_b = nn.Linear(Q, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(D, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(D, self.n_heads, bias=False)
        self.trained = config.indexer_training == "kl"
        if not self.trained:
            self.requires_grad_(False)

    def _rope_first(self, x_BTNC: torch.Tensor, cos_TR, sin_TR) -> torch.Tensor:
        R = self.rope_dim  # the rotary slice comes first in the indexer (last in the attention)
        rot_BTNR = apply_interleaved_rope(x_BTNC[..., :R], cos_TR, sin_TR)
        return torch.cat([rot_BTNR, x_BTNC[..., R:]], -1)

    def forward(
        self, x_BTD: torch.Tensor, q_BTQ: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor
    ) -> torch.Tensor:
        """float32 index scores [B, T, S=T] of the (detached) layer input and low-rank query,
        -inf above the diagonal; differentiable only in "kl" mode."""
        x_BTD, q_BTQ = x_BTD.detach(), q_BTQ.detach()
        with torch.set_grad_enabled(self.trained and torch.is_grad_enabled()):
            B, T, _ = x_BTD.shape
            q_BTMC = self.wq_b(q_BTQ).view(B, T, self.n_heads, self.head_dim)
            k_BT1C = self.k_norm(self.wk(x_BTD)).unsqueeze(2)
            q_BTMC = self._rope_first(q_BTMC, cos_TR, sin_TR)
            k_BTC = self._rope_first(k_BT1C, cos_TR, sin_TR).squeeze(2)
            logits_BTMS = torch.einsum("btmc,bsc->btms", q_BTMC.float(), k_BTC.float())
            relu_BTMS = F.relu(logits_BTMS * self.head_dim**-0.5)
            # weights_proj computes in float32 (GLM-5 keeps it float32 in bf16 checkpoints).
            # Through __call__: under FSDP2 mixed precision weights_proj is its own float32 unit.
            x_in = x_BTD.to(self.weights_proj.weight.dtype)
            w_BTM = self.weights_proj(x_in).float() * self.n_heads**-0.5
            scores_BTS = torch.einsum("btm,btms->bts", w_BTM, relu_BTMS)
            causal_TS = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril()
            return scores_BTS.masked_fill(~causal_TS, float("-inf"))


def select_topk(scores_BTS: torch.Tensor, topk: int) -> torch.Tensor:
    """The kept key positions [B, T, K] (K = min(topk, S)) of each query: the top index scores.
    A query s < K keeps all its s + 1 causal keys plus masked ones, which the causal mask drops."""
    k = min(topk, scores_BTS.shape[-1])
    return scores_BTS.detach().topk(k, dim=-1).indices


def sparse_mask(topk_BTK: torch.Tensor, seq_len: int) -> torch.Tensor:
    """bool [B, 1, T, S]: True where a query attends (a kept key, at or below the diagonal)."""
    B, T, _ = topk_BTK.shape
    kept_BTS = torch.zeros(B, T, seq_len, dtype=torch.bool, device=topk_BTK.device)
    kept_BTS.scatter_(-1, topk_BTK, True)
    causal_TS = torch.ones(T, seq_len, dtype=torch.bool, device=topk_BTK.device).tril()
    return (kept_BTS & causal_TS)[:, None]


def indexer_kl(
    scores_BTS: torch.Tensor, attn_probs_BTS: torch.Tensor, mask_BTS: torch.Tensor
) -> torch.Tensor:
    """Mean over queries of KL(p_attn || p_index) on the attended keys `mask_BTS`: `attn_probs`
    is the (detached) head-summed, L1-normalized attention, p_index the softmax of the index
    scores over the same keys."""
    logq_BTS = torch.log_softmax(scores_BTS.masked_fill(~mask_BTS, float("-inf")), dim=-1)
    p_BTS = attn_probs_BTS
    terms = p_BTS * (torch.log(p_BTS.clamp_min(1e-30)) - logq_BTS)
    # Keys outside the mask have p = 0 and log q = -inf: their term is 0, not 0 * inf.
    return terms.masked_fill(~mask_BTS, 0.0).sum(-1).mean()
