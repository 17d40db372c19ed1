"""Multi-head latent attention (MLA, DeepSeek-V2/V3; GLM-5), optionally sparse (DSA).

Per layer, with x the normed layer input:
    q_lat = q_a_layernorm(q_a_proj(x))                       [B, T, Q]   (or q = q_proj(x))
    q     = q_b_proj(q_lat) -> per head (q_nope [P], q_rope [R])
    kv_lat, k_rope = kv_a_proj_with_mqa(x) split [L], [R]     one rotary key head for all heads
    k_nope, v = kv_b_proj(kv_a_layernorm(kv_lat)) -> per head [P], [V]
    softmax scale (P + R)^-0.5, times YaRN's mscale^2 when rope_scaling sets mscale_all_dim
RoPE is interleaved on the R slice. With DSA (`index_topk`) each query attends only the keys its
layer's indexer keeps (a "shared" layer reuses the previous layer's choice); when T <= index_topk
every causal key is kept. `GLMConfig.dsa_impl` picks how:
- "latent" (default): the absorbed form, as DeepSeek-V3.2's sparse MLA. Scores
  q_nope . k_nope = (q_nope W_uk) . kv, so every head reads one key per position, the normed
  kv latent [L] plus the rotary key [R]; the output is W_uv (sum_k p_k kv_k). One gather of
  [T, K, L + R] serves all heads (`models.glm.model.sparse_attention`); kv_b_proj is never applied
  to the keys.
- "per_head": the kept keys and values gathered per head ([T, K, N, P + R] and [T, K, N, V]).
- "masked": dense SDPA under the [T, S] kept-key mask: the reference, O(T^2) memory.
Dense MLA (no index_topk) is causal SDPA. Parameter names are those of the GLM-5 checkpoints
(transformers `GlmMoeDsaAttention`).

Shape legend: B batch, T queries, S keys, D hidden, N heads, Q q_lora_rank, L kv_lora_rank,
P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, K kept keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm.model.config import GLMConfig
from models.glm.model.indexer import Indexer, MiB, indexer_kl, kept_mask, sparse_mask
from models.glm.model.layers import RMSNorm, apply_interleaved_rope, yarn_mscale
from models.glm.model.qk_clip import MaxLogitRecorder
from models.glm.model.sequence import LocalTokens, causal_mask, gathered
from models.glm.model.sparse_attention import attention_row_bytes, query_chunk, sparse_attention

# The latent norms' eps is fixed in GLM-5 (as in transformers), independent of rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# Heads per chunk when the KL target's head-summed attention is computed: bounds the float32
# [B, chunk, T, T] probabilities held at once.
_KL_HEAD_CHUNK = 8


def softmax_scale(config: GLMConfig) -> float:
    """(P + R)^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN scaling (DeepSeek-V3)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rs = config.rope_scaling
    if rs is not None and rs.get("mscale_all_dim"):
        m = yarn_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLAttention(MaxLogitRecorder, nn.Module):
    """Causal multi-head latent attention of decoder layer `layer`, with the DSA indexer when
    the config sets index_topk (none on "shared" layers). Records max logits for QK-clip as
    `Attention` does (`models.glm.model.qk_clip`)."""

    def __init__(self, config: GLMConfig, layer: int) -> None:
        super().__init__()
        D, N = config.hidden_size, config.num_attention_heads
        self.n_heads = N
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_rank = config.v_head_dim, config.kv_lora_rank
        qk, bias = self.nope + self.rope, config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, N * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, N * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, N * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(N * self.v_dim, D, bias=bias)
        # Muon Split (optim.muon_split, GLM-5): the row blocks orthogonalized on their own
        q = self.q_proj if config.q_lora_rank is None else self.q_b_proj
        q.orthogonal_splits = {"weight": (self.nope, self.rope) * N}
        self.kv_a_proj_with_mqa.orthogonal_splits = {"weight": (self.kv_rank, self.rope)}
        self.kv_b_proj.orthogonal_splits = {"weight": (self.nope, self.v_dim) * N}
        self.scale = softmax_scale(config)
        self.sparse = config.uses_dsa
        self.topk = config.index_topk
        self.dsa_impl, self.chunk_bytes = config.dsa_impl, config.dsa_chunk_mib * MiB
        full = self.sparse and config.layer_indexer_type(layer) == "full"
        self.indexer = Indexer(config) if full else None

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_TR: torch.Tensor,
        sin_TR: torch.Tensor,
        topk_BTK: torch.Tensor | None = None,
        with_kl: bool = False,
        doc_start_BT: torch.Tensor | None = None,
        tokens: LocalTokens | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(output [B, T, D], the kept keys [B, T, K] for a following "shared" layer (None when
        dense), the indexer's KL loss when `with_kl` and this layer ran a trained indexer).
        `topk_BTK`: kept keys to attend instead of running the indexer, or None.
        `doc_start_BT`: packed documents (each token's document's first position, [B, T]):
        the indexer keeps, and the attention reads, keys of the query's own document only.
        `tokens`: the queries are these tokens of a longer sequence
        (`models.glm.model.sequence`); the key side (the normed latent and the rotary key, the
        indexer's keys) is the whole sequence's, through `gather_keys`."""
        B, T, _ = x_BTD.shape
        N, P, R = self.n_heads, self.nope, self.rope
        if hasattr(self, "q_proj"):
            q_lat_BTQ, q_BTNH = None, self.q_proj(x_BTD)
        else:
            q_lat_BTQ = self.q_a_layernorm(self.q_a_proj(x_BTD))
            q_BTNH = self.q_b_proj(q_lat_BTQ)
        q_BTNH = q_BTNH.view(B, T, N, P + R)
        kv_lat_BTL, k_rope_BTR = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_rank, R], -1)
        kv_BTL = self.kv_a_layernorm(kv_lat_BTL)
        q_rope_BTNR = apply_interleaved_rope(q_BTNH[..., P:], cos_TR, sin_TR)
        k_rope_BT1R = apply_interleaved_rope(k_rope_BTR.unsqueeze(2), cos_TR, sin_TR)
        kv_BSL, k_rope_BS1R, side_BSE = kv_BTL, k_rope_BT1R, None
        if tokens is not None:  # one gather of the key side: L + R values per token
            side_BSE = gathered(self, torch.cat([kv_BTL, k_rope_BT1R.squeeze(2)], -1), tokens)
            kv_BSL, k_rope_BSR = side_BSE.split([self.kv_rank, R], -1)
            k_rope_BS1R = k_rope_BSR.unsqueeze(2)
        S = kv_BSL.shape[1]
        topk_BTK, kept_scores_BTK = self._kept_keys(
            x_BTD, q_lat_BTQ, cos_TR, sin_TR, topk_BTK, doc_start_BT, tokens
        )
        want_kl = with_kl and kept_scores_BTK is not None
        if self.sparse and self.dsa_impl == "latent":  # kv_b_proj applied inside, per head
            if side_BSE is None:  # the one key head: the normed latent and the rotary key
                side_BSE = torch.cat([kv_BSL, k_rope_BS1R.squeeze(2)], -1)
            o_BTNV, probs_BTK = self._latent(
                q_BTNH[..., :P], q_rope_BTNR, side_BSE, topk_BTK, want_kl, tokens
            )
        else:
            kv_BSNW = self.kv_b_proj(kv_BSL).view(B, S, N, P + self.v_dim)
            k_nope_BSNP, v_BSNV = kv_BSNW.split([P, self.v_dim], -1)
            q_BTNE = torch.cat([q_BTNH[..., :P], q_rope_BTNR], -1)
            k_BSNE = torch.cat([k_nope_BSNP, k_rope_BS1R.expand(B, S, N, R)], -1)
            if self.sparse and self.dsa_impl == "per_head":
                o_BTNV, probs_BTK = self._per_head(
                    q_BTNE, k_BSNE, v_BSNV, topk_BTK, want_kl, tokens
                )
            else:
                o_BNTV, probs_BTK = self._masked(
                    q_BTNE.transpose(1, 2),
                    k_BSNE.transpose(1, 2),
                    v_BSNV.transpose(1, 2),
                    topk_BTK,
                    want_kl,
                    doc_start_BT,
                    tokens,
                )
                o_BTNV = o_BNTV.transpose(1, 2)
        kl = None
        if want_kl:
            queries = None if tokens is None else B * tokens.seq_len
            kl = indexer_kl(kept_scores_BTK, probs_BTK, kept_mask(topk_BTK, tokens), queries)
        out_BTD = self.o_proj(o_BTNV.reshape(B, T, N * self.v_dim))
        return out_BTD, (topk_BTK if self.sparse else None), kl

    def _kept_keys(self, x_BTD, q_lat_BTQ, cos_TR, sin_TR, topk_BTK, doc_start_BT, tokens):
        """(kept keys [B, T, K] or None when dense, their index scores in "kl" mode or None):
        `topk_BTK` when given (a "shared" layer, or an MTP depth reusing depth 1's keys), else
        this layer's indexer's."""
        if self.indexer is not None and topk_BTK is None:
            return self.indexer(x_BTD, q_lat_BTQ, cos_TR, sin_TR, doc_start_BT, tokens)
        if self.sparse and topk_BTK is None:
            raise ValueError("a 'shared' DSA layer needs the kept keys of a previous layer")
        return topk_BTK, None

    def _masked(self, q_BNTH, k_BNSH, v_BNSV, topk_BTK, want_kl, doc_start_BT, tokens):
        """Dense SDPA, masked to the kept keys under DSA (the reference; O(T x S) memory), to
        the query's own document with `doc_start_BT` and to the causal keys of its global
        position under `tokens`: (output [B, N, T, V], the KL target on the kept keys
        [B, T, K] when `want_kl`)."""
        T, S = q_BNTH.shape[2], k_BNSH.shape[2]
        mask_B1TS = sparse_mask(topk_BTK, S, tokens) if self.sparse and self.topk < S else None
        base_B1TS = causal_mask(doc_start_BT, tokens, T, q_BNTH.device)
        if base_B1TS is not None:
            mask_B1TS = base_B1TS if mask_B1TS is None else mask_B1TS & base_B1TS
        if mask_B1TS is not None:
            o_BNTV = F.scaled_dot_product_attention(
                q_BNTH, k_BNSH, v_BNSV, attn_mask=mask_B1TS, scale=self.scale
            )
        else:  # every causal key is kept: plain causal attention
            o_BNTV = F.scaled_dot_product_attention(
                q_BNTH, k_BNSH, v_BNSV, is_causal=True, scale=self.scale
            )
        self.record(q_BNTH, k_BNSH, self.scale, mask_B1TS, tokens)  # QK-clip's max logits
        if not want_kl:
            return o_BNTV, None
        if mask_B1TS is None:
            causal_TS = torch.ones(T, T, dtype=torch.bool, device=q_BNTH.device).tril()
            mask_B1TS = causal_TS[None, None]
        probs_BTS = self._head_summed_probs(q_BNTH, k_BNSH, mask_B1TS)
        kept_BTK = kept_mask(topk_BTK, tokens)
        return o_BNTV, probs_BTS.gather(-1, topk_BTK.clamp(min=0)) * kept_BTK

    def _latent(self, q_nope_BTNP, q_rope_BTNR, key_BSE, topk_BTK, want_kl, tokens):
        """Sparse attention in MLA's absorbed form (DeepSeek-V3.2's sparse MLA): one key head
        of width L + R (the normed kv latent and the rotary key) whose first L channels are the
        values; queries enter the latent through kv_b_proj's key rows, outputs leave it through
        its value rows. (output [B, T, N, V], the KL target [B, T, K] or None)."""
        N, P, V, L = self.n_heads, self.nope, self.v_dim, self.kv_rank
        w_NWL = self.kv_b_proj.weight.view(N, P + V, L)
        q_lat_BTNL = torch.einsum("btnp,npl->btnl", q_nope_BTNP, w_NWL[:, :P])
        q_BTNE = torch.cat([q_lat_BTNL, q_rope_BTNR], -1)
        o_BTNL, probs_BTK = self._sparse(
            q_BTNE, key_BSE.unsqueeze(2), None, L, topk_BTK, want_kl, tokens
        )
        return torch.einsum("btnl,nvl->btnv", o_BTNL, w_NWL[:, P:]), probs_BTK

    def _per_head(self, q_BTNE, k_BSNE, v_BSNV, topk_BTK, want_kl, tokens):
        """Sparse attention gathering each head's own key and value (N x the latent form's
        gathered bytes): (output [B, T, N, V], the KL target [B, T, K] or None)."""
        return self._sparse(q_BTNE, k_BSNE, v_BSNV, v_BSNV.shape[-1], topk_BTK, want_kl, tokens)

    def _sparse(self, q_BTNE, k_BSHE, v_BSHV, value_dim, topk_BTK, want_kl, tokens):
        """`sparse_attention` over the kept keys in query chunks that `dsa_chunk_mib` bounds,
        recording each head's largest logit: (output [B, T, N, value_dim], the KL target
        [B, T, K] or None). `k_BSHE`: one key head or one per query head; `v_BSHV` None: the
        values are the keys' first `value_dim` channels."""
        rows = attention_row_bytes(
            q_BTNE.shape[0],
            q_BTNE.shape[2],
            k_BSHE.shape[2],
            k_BSHE.shape[-1],
            value_dim,
            topk_BTK.shape[-1],
            separate_values=v_BSHV is not None,
            itemsize=q_BTNE.element_size(),
        )
        o_BTNV, probs_BTK, max_N = sparse_attention(
            q_BTNE,
            k_BSHE,
            v_BSHV,
            topk_BTK,
            self.scale,
            value_dim=value_dim,
            chunk=query_chunk(self.chunk_bytes, rows),
            want_probs=want_kl,
            positions_T=None if tokens is None else tokens.positions_T,
        )
        self.record_max(max_N)
        return o_BTNV, (probs_BTK if want_kl else None)

    @torch.no_grad()
    def _head_summed_probs(self, q_BNTH, k_BNSH, mask_B1TS) -> torch.Tensor:
        """The KL target: float32 attention probabilities summed over heads, L1-normalized."""
        B, N, T, _ = q_BNTH.shape
        S = k_BNSH.shape[2]
        total_BTS = torch.zeros(B, T, S, dtype=torch.float32, device=q_BNTH.device)
        for h in range(0, N, _KL_HEAD_CHUNK):
            logits = q_BNTH[:, h : h + _KL_HEAD_CHUNK].float() @ k_BNSH[
                :, h : h + _KL_HEAD_CHUNK
            ].float().transpose(-1, -2)
            logits = (logits * self.scale).masked_fill(~mask_B1TS, float("-inf"))
            total_BTS += logits.softmax(-1).sum(1)
        return total_BTS / total_BTS.sum(-1, keepdim=True)
