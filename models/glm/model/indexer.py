"""DeepSeek Sparse Attention (DSA): the lightning indexer that picks the keys each query attends.

The indexer scores every (query s, key t <= s) pair with a few small ReLU heads,
    score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t] / sqrt(C)), w = weights_proj(x) / sqrt(M),
with its own projections (`wq_b` reads the attention's low-rank query, `wk` the layer input, one
key head normalized by a LayerNorm with bias) and interleaved RoPE on the first qk_rope_head_dim
channels; the attention then keeps the top min(index_topk, T) keys per query.

Bounded memory: the scores of all pairs are computed in chunks of queries under no_grad, each
chunk reading the keys up to its last query, and reduced to the chunk's top-k at once (peak
O(chunk x M x S), never [B, T, M, S]); a chunk's size follows from `GLMConfig.dsa_chunk_mib`.
The differentiable scores the KL needs are those of the kept keys only ([B, T, K]), computed
by `_KeptScores`, which gathers the kept keys per chunk in forward and again in backward.

Training (`GLMConfig.indexer_training`):
- "frozen": the indexer runs under no_grad and its parameters have requires_grad False, so they
  get no gradient and no optimizer state (as when fine-tuning a released GLM-5 checkpoint).
- "kl": DeepSeek-V3.2's objective: KL(p_attn || p_index) over the selected keys, p_attn the main
  attention's probabilities summed over heads and L1-normalized (a detached target), p_index the
  softmax of the index scores. The indexer reads detached inputs, so the KL trains the indexer
  only and the main model's gradients are the same as in frozen mode.

Shape legend: B batch, T sequence (queries) and S keys, D hidden, Q low-rank query width,
M indexer heads, C indexer head width, K kept keys, J a chunk of queries.
"""

from __future__ import annotations

import torch
from torch import nn

from models.glm.model.config import GLMConfig
from models.glm.model.execution import work_dtype
from models.glm.model.layers import apply_interleaved_rope
from models.glm.model.sequence import LocalTokens, gathered, query_positions
from models.glm.model.sparse_attention import gather_rows, query_chunk, query_chunks

# The indexer key norm's eps is fixed in GLM-5 (transformers hard-codes it too), independent of
# rms_norm_eps.
INDEXER_NORM_EPS = 1e-6
MiB = 1 << 20
#: a kept-key slot holding no key (packed documents: a query with fewer keys in its own
#: document than index_topk); every consumer masks it and gathers row 0 in its place
NO_KEY = -1


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
        self.chunk_bytes = config.dsa_chunk_mib * MiB
        if not self.trained:
            self.requires_grad_(False)

    def _rope_first(self, x_BTNC: torch.Tensor, cos_TR, sin_TR) -> torch.Tensor:
        R = self.rope_dim  # the rotary slice comes first in the indexer (last in the attention)
        rot_BTNR = apply_interleaved_rope(x_BTNC[..., :R], cos_TR, sin_TR)
        return torch.cat([rot_BTNR, x_BTNC[..., R:]], -1)

    def project(self, x_BTD, q_BTQ, cos_TR, sin_TR, tokens: LocalTokens | None = None):
        """float32 (float64 in a float64 model: `work_dtype`) queries [B, T, M, C] scaled by
        C^-0.5, keys [B, S, C] and head weights [B, T, M] of the detached layer input and
        low-rank query; differentiable in "kl".
        Under `tokens` the keys are the full sequence's, gathered in the compute dtype
        (`models.glm.model.sequence.gathered`; S = T otherwise)."""
        B, T, _ = x_BTD.shape
        q_BTMC = self.wq_b(q_BTQ).view(B, T, self.n_heads, self.head_dim)
        k_BT1C = self.k_norm(self.wk(x_BTD)).unsqueeze(2)
        w = work_dtype(x_BTD.dtype)
        q_BTMC = self._rope_first(q_BTMC, cos_TR, sin_TR).to(w) * self.head_dim**-0.5
        k_BTC = self._rope_first(k_BT1C, cos_TR, sin_TR).squeeze(2)
        k_BSC = gathered(self, k_BTC, tokens).to(w)
        # weights_proj computes in float32 (GLM-5 keeps it float32 in bf16 checkpoints).
        # Through __call__: under FSDP2 mixed precision weights_proj is its own float32 unit.
        x_in = x_BTD.to(self.weights_proj.weight.dtype)
        w_BTM = self.weights_proj(x_in).to(w) * self.n_heads**-0.5
        return q_BTMC, k_BSC, w_BTM

    def forward(
        self,
        x_BTD: torch.Tensor,
        q_BTQ: torch.Tensor,
        cos_TR: torch.Tensor,
        sin_TR: torch.Tensor,
        doc_start_BT: torch.Tensor | None = None,
        tokens: LocalTokens | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the kept keys [B, T, K], K = min(index_topk, S), and, in "kl" mode, their float32
        index scores [B, T, K], differentiable in the indexer's parameters). `doc_start_BT`:
        packed documents (`select_topk`); `tokens`: the queries are these tokens of a longer
        sequence (`models.glm.model.sequence`), the keys the whole sequence's."""
        x_BTD, q_BTQ = x_BTD.detach(), q_BTQ.detach()
        with torch.set_grad_enabled(self.trained and torch.is_grad_enabled()):
            q_BTMC, k_BSC, w_BTM = self.project(x_BTD, q_BTQ, cos_TR, sin_TR, tokens)
        B, T, M, C = q_BTMC.shape
        S = k_BSC.shape[1]
        K = min(self.topk, S)
        # A query row's temporaries (float32): scores [M, S] and their head sum [S], the future
        # mask [S], the top-k values and positions [K].
        topk_BTK = select_topk(
            q_BTMC,
            k_BSC,
            w_BTM,
            self.topk,
            self._chunk(B * (S * (4 * M + 5) + 12 * K)),
            doc_start_BT,
            tokens,
        )
        if not self.trained:
            return topk_BTK, None
        # _KeptScores' backward, its larger pass: the flat positions [K] (int64), the gathered
        # keys [K, C] and their gradient, the logits [M, K] and a ReLU'd copy, dq's [M, C].
        chunk = self._chunk(B * (K * (8 + 8 * C + 8 * M) + 4 * M * C))
        return topk_BTK, _KeptScores.apply(q_BTMC, k_BSC, w_BTM, topk_BTK, chunk)

    def _chunk(self, row_bytes: int) -> int:
        return query_chunk(self.chunk_bytes, row_bytes)


def _chunk_scores(q_BJMC, k_BSC, w_BJM) -> torch.Tensor:
    """Index scores [B, J, S] of a chunk of queries over keys k (no causal mask). One batched
    product over [J * M, C] x [C, S]: broadcasting k over the J queries would copy it J times."""
    B, J, M, C = q_BJMC.shape
    relu_BJMS = torch.bmm(q_BJMC.reshape(B, J * M, C), k_BSC.transpose(1, 2)).relu_()
    return torch.matmul(w_BJM[:, :, None], relu_BJMS.view(B, J, M, -1)).squeeze(2)


@torch.no_grad()
def select_topk(
    q_BTMC, k_BSC, w_BTM, topk: int, chunk: int, doc_start_BT=None, tokens=None
) -> torch.Tensor:
    """The kept key positions [B, T, K] (K = min(topk, S)) of each query: the top index scores
    among its causal keys, chunk queries at a time, each chunk scoring only the keys up to its
    last query (no chunk spans two runs of `tokens`). A query s < K keeps all its s + 1 causal
    keys plus later ones, which the attention masks. With packed documents (`doc_start_BT`,
    each query's document's first position) the candidates are the query's own document's
    causal keys, masked before the top-k, and a query with fewer of them than K fills its
    remaining slots with -1 (`NO_KEY`: no key of another document is ever kept, not even a
    masked one). `tokens`: the queries sit at these global positions of the S keys
    (`models.glm.model.sequence`); else S = T."""
    T, S = q_BTMC.shape[1], k_BSC.shape[1]
    B, K = k_BSC.shape[0], min(topk, S)
    out_BTK = torch.empty(B, T, K, dtype=torch.long, device=k_BSC.device)
    keys_S = torch.arange(S, device=k_BSC.device)
    q_T = query_positions(tokens, T, k_BSC.device)
    for t0, t1 in query_chunks(T, chunk, tokens):
        last = t1 if tokens is None else tokens.key_end(t1)
        end = max(last, K)  # at least K candidates per row
        s_BJS = _chunk_scores(q_BTMC[:, t0:t1].detach(), k_BSC[:, :end].detach(), w_BTM[:, t0:t1])
        future_JS = keys_S[None, :end] > q_T[t0:t1, None]
        s_BJS.masked_fill_(future_JS, -torch.inf)
        if doc_start_BT is not None:
            other_BJS = keys_S[None, None, :end] < doc_start_BT[:, t0:t1, None]
            s_BJS.masked_fill_(other_BJS, -torch.inf)
        idx_BJK = top_keys(s_BJS, K, keys_S[:end])
        if doc_start_BT is not None:
            idx_BJK.masked_fill_(s_BJS.gather(-1, idx_BJK) == -torch.inf, NO_KEY)
        out_BTK[:, t0:t1] = idx_BJK
    return out_BTK


def top_keys(s_BJS: torch.Tensor, K: int, keys_S: torch.Tensor) -> torch.Tensor:
    """The positions of the K largest scores of each row [B, J, S], in ascending position,
    ties at the K-th score resolved to the lowest positions: a function of the scores alone
    (`topk` alone picks among equal scores by its kernel's order, which changes with the
    number of candidates; ReLU scores of exactly 0 tie often), so the kept keys do not depend
    on how the queries are chunked or the sequence is split over ranks. Two top-k passes and a
    few elementwise ones over the row."""
    kth_BJ1 = s_BJS.topk(K, dim=-1).values[..., -1:]
    above_BJS = s_BJS > kth_BJ1
    tied_BJS = s_BJS == kth_BJ1
    room_BJ1 = K - above_BJS.sum(-1, keepdim=True, dtype=torch.int32)
    take_BJS = above_BJS | (tied_BJS & (tied_BJS.cumsum(-1, dtype=torch.int32) <= room_BJ1))
    # exactly K positions taken; as distinct scores S - s, top-k returns them in ascending s.
    # int32 (positions < 2^31): with the masks 11 bytes per key, below the 4 M bytes of the
    # chunk's ReLU'd scores (`_chunk_scores`, freed by now) that the chunk's budget counts
    rank_BJS = torch.where(take_BJS, (keys_S.numel() - keys_S).int(), 0)
    return rank_BJS.topk(K, dim=-1).indices


class _KeptScores(torch.autograd.Function):
    """Index scores of the kept keys, [B, T, K] float32, gathered and recomputed per chunk."""

    @staticmethod
    def forward(ctx, q_BTMC, k_BSC, w_BTM, idx_BTK, chunk):
        B, T, M, C = q_BTMC.shape
        base_B11 = (torch.arange(B, device=idx_BTK.device) * k_BSC.shape[1])[:, None, None]
        out_BTK = torch.empty(idx_BTK.shape, dtype=q_BTMC.dtype, device=q_BTMC.device)
        k_F = k_BSC.reshape(-1, C)
        for t0, t1 in query_chunks(T, chunk):
            kg_BJKC = gather_rows(k_F, idx_BTK[:, t0:t1].clamp(min=0) + base_B11)
            relu_BJMK = torch.einsum("bjmc,bjkc->bjmk", q_BTMC[:, t0:t1], kg_BJKC).relu_()
            out_BTK[:, t0:t1] = torch.einsum("bjm,bjmk->bjk", w_BTM[:, t0:t1], relu_BJMK)
        ctx.save_for_backward(q_BTMC, k_BSC, w_BTM, idx_BTK)
        ctx.chunk = chunk
        return out_BTK

    @staticmethod
    def backward(ctx, g_BTK):
        q_BTMC, k_BSC, w_BTM, idx_BTK = ctx.saved_tensors
        B, T, M, C = q_BTMC.shape
        base_B11 = (torch.arange(B, device=idx_BTK.device) * k_BSC.shape[1])[:, None, None]
        k_F = k_BSC.reshape(-1, C)
        dq, dw = torch.empty_like(q_BTMC), torch.empty_like(w_BTM)
        dk_F = torch.zeros_like(k_F)
        for t0, t1 in query_chunks(T, ctx.chunk):
            flat_BJK = idx_BTK[:, t0:t1].clamp(min=0) + base_B11  # NO_KEY: g is 0 there
            kg_BJKC = gather_rows(k_F, flat_BJK)
            q, w, g = q_BTMC[:, t0:t1], w_BTM[:, t0:t1], g_BTK[:, t0:t1]
            logit_BJMK = torch.einsum("bjmc,bjkc->bjmk", q, kg_BJKC)
            dw[:, t0:t1] = torch.einsum("bjk,bjmk->bjm", g, logit_BJMK.relu())
            # In place: 1[logit > 0] w g, the values of (g w) masked (one product either way).
            dl_BJMK = logit_BJMK.gt_(0).mul_(w[..., None]).mul_(g[:, :, None])
            dq[:, t0:t1] = torch.einsum("bjmk,bjkc->bjmc", dl_BJMK, kg_BJKC)
            dkg = torch.einsum("bjmk,bjmc->bjkc", dl_BJMK, q)
            dk_F.index_add_(0, flat_BJK.reshape(-1), dkg.reshape(-1, C))
        return dq, dk_F.view_as(k_BSC), dw, None, None


def kept_mask(topk_BTK: torch.Tensor, tokens: LocalTokens | None = None) -> torch.Tensor:
    """bool [B, T, K]: which kept keys are causal (at or below their query, at its global
    position under `tokens`) and not NO_KEY."""
    rows_T1 = query_positions(tokens, topk_BTK.shape[1], topk_BTK.device)[:, None]
    return (topk_BTK <= rows_T1) & (topk_BTK >= 0)


def sparse_mask(
    topk_BTK: torch.Tensor, seq_len: int, tokens: LocalTokens | None = None
) -> torch.Tensor:
    """bool [B, 1, T, S]: True where a query attends (a kept key, at or below the query's
    position). The masked (reference) attention's mask: O(T x S). NO_KEY slots mark an extra
    column S, dropped."""
    B, T, _ = topk_BTK.shape
    kept_BTS = torch.zeros(B, T, seq_len + 1, dtype=torch.bool, device=topk_BTK.device)
    kept_BTS.scatter_(-1, topk_BTK.masked_fill(topk_BTK < 0, seq_len), True)
    q_T = query_positions(tokens, T, topk_BTK.device)
    causal_TS = torch.arange(seq_len, device=topk_BTK.device)[None, :] <= q_T[:, None]
    return (kept_BTS[..., :seq_len] & causal_TS)[:, None]


def indexer_kl(
    scores_BTK: torch.Tensor,
    attn_probs_BTK: torch.Tensor,
    mask_BTK: torch.Tensor,
    queries: int | None = None,
) -> torch.Tensor:
    """Mean over queries of KL(p_attn || p_index) on the attended keys `mask_BTK` (the kept
    causal keys, [B, T, K]): `attn_probs` is the (detached) head-summed, L1-normalized
    attention on them, p_index the softmax of the index scores over the same keys.
    `queries`: divide the sum by this many queries instead (a part of a longer sequence
    contributes its share of the full sequence's mean)."""
    logq_BTK = torch.log_softmax(scores_BTK.masked_fill(~mask_BTK, float("-inf")), dim=-1)
    p_BTK = attn_probs_BTK
    terms = p_BTK * (torch.log(p_BTK.clamp_min(1e-30)) - logq_BTK)
    # Keys outside the mask have p = 0 and log q = -inf: their term is 0, not 0 * inf.
    per_query_BT = terms.masked_fill(~mask_BTK, 0.0).sum(-1)
    return per_query_BT.mean() if queries is None else per_query_BT.sum() / queries
