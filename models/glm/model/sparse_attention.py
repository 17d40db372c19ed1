"""DSA's main attention at sparse cost: each query reads only its kept keys, gathered per query.

Query t attends the keys `idx[t]` that are at or below it (a top-k over fewer than K causal keys
pads with later positions, or, for packed documents, with -1: both are masked out here).
Forward gathers the kept keys and values of a chunk of queries at a time and saves only its
inputs, the output and the log-sum-exp;
backward gathers them again chunk by chunk and scatter-adds the key/value gradients (the
recomputation flash attention does, over gathered keys). Memory: O(T x K) for the indices and
O(chunk x K x width) per chunk, never a [T, S] tensor. Scores and softmax run in float32
(float64 for a float64 model).

Two layouts of the keys (`k_BSHE`, H = 1 or N):
- H = 1, one key head for every query head (MQA): MLA's absorbed ("latent") form, as
  DeepSeek-V3.2's sparse MLA; with `v_BSHV` None the values are the first `value_dim` key
  channels (the kv latent), so one gather of [chunk, K, E] serves all heads;
- H = N, a key and a value per head (MLA's per-head form): N times the gathered bytes.

Shape legend: B batch, T queries, S keys, N query heads, H key heads, E query/key width,
V value width, K kept keys per query, C a chunk of queries.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from models.glm.model.execution import work_dtype


def query_chunk(budget_bytes: int, row_bytes: int) -> int:
    """Queries per chunk so that one chunk's temporaries (`row_bytes` per query) stay within
    `budget_bytes` (at least one query)."""
    return max(1, budget_bytes // max(1, row_bytes))


def query_chunks(T: int, chunk: int, tokens=None) -> Iterator[tuple[int, int]]:
    """The (first, end) queries of each chunk of `chunk` queries out of T: the one loop every
    chunked DSA function runs (its temporaries live within one step of it). `tokens`
    (`models.glm.model.sequence.LocalTokens`, T of its tokens): no chunk spans two of its runs,
    so a loop that reads the keys up to a chunk's last query never reads a later run's keys
    for an earlier run's queries (head-tail context parallelism's first run would otherwise
    score most of the sequence's keys in its last chunk)."""
    ends = [T] if tokens is None else [*_run_ends(tokens, T)]
    start = 0
    for end in ends:
        for t0 in range(start, end, chunk):
            yield t0, min(end, t0 + chunk)
        start = end


def _run_ends(tokens, T: int) -> Iterator[int]:
    """The local index one past each run of `tokens`."""
    if tokens.count != T:
        raise ValueError(f"query_chunks: {T} queries, but the tokens hold {tokens.count}")
    end = 0
    for _, count in tokens.runs:
        end += count
        yield end


def attention_row_bytes(
    batch: int,
    heads: int,
    key_heads: int,
    key_width: int,
    value_width: int,
    topk: int,
    *,
    separate_values: bool,
    itemsize: int,
) -> int:
    """Bytes one query row of a chunk holds at once in the backward, the larger pass (the
    forward holds a subset): the flat positions [K] (int64) and masks, the gathered keys (and
    values) in their dtype and in float32, their float32 gradients, the [N, K] scores and
    their gradient, the scaled query, the output gradient and dq ([N, E], [N, V]); with a key
    per head, einsum's permuted copy of the gathered keys and values too."""
    N, H, E, V, K = heads, key_heads, key_width, value_width, topk
    gathered = K * H * (E + (V if separate_values else 0))
    cast = itemsize if itemsize < 4 else 0  # the gather in the input dtype, then float32
    row = 10 * K + gathered * (cast + 4) + 4 * K * H * (E + V) + 8 * N * K + 4 * N * (2 * E + V)
    if H > 1:
        row += 4 * gathered
    return batch * row


def gather_rows(x_BSF: torch.Tensor, flat_BCK: torch.Tensor) -> torch.Tensor:
    """Rows of x [B, S, F] (or [B * S, F]) at flat positions b * S + s: [B, C, K, F]
    (index_select: on CPU several times faster than advanced indexing)."""
    rows = torch.index_select(x_BSF.reshape(-1, x_BSF.shape[-1]), 0, flat_BCK.reshape(-1))
    return rows.view(*flat_BCK.shape, x_BSF.shape[-1])


def _subscripts(shared: bool) -> str:
    """The gathered-key subscripts: one key head ([B, C, K, E]) or one per head."""
    return "bck" if shared else "bckn"


class _SparseAttention(torch.autograd.Function):
    """See `sparse_attention`; tensors saved for backward are the inputs, output and lse."""

    @staticmethod
    def forward(ctx, q_BTNE, k_BSHE, v_BSHV, idx_BTK, scale, value_dim, chunk, want_probs, pos_T):
        B, T, N, E = q_BTNE.shape
        q_T = _positions(pos_T, T, idx_BTK.device)
        S, H = k_BSHE.shape[1], k_BSHE.shape[2]
        K = idx_BTK.shape[-1]
        w = work_dtype(q_BTNE.dtype)
        g = _subscripts(H == 1)
        keys_BSF = k_BSHE.reshape(B, S, H * E)
        vals_BSF = None if v_BSHV is None else v_BSHV.reshape(B, S, -1)
        base_B11 = (torch.arange(B, device=idx_BTK.device) * S)[:, None, None]
        o_BTNV = q_BTNE.new_empty(B, T, N, value_dim)
        lse_BTN = torch.empty(B, T, N, dtype=w, device=q_BTNE.device)
        probs_BTK = torch.empty(B, T, K if want_probs else 0, dtype=w, device=q_BTNE.device)
        max_N = torch.full((N,), -torch.inf, dtype=w, device=q_BTNE.device)
        for t0, t1 in query_chunks(T, chunk):
            kg, vg, keep = _chunk_keys(
                keys_BSF, vals_BSF, idx_BTK, base_B11, q_T, t0, t1, H, value_dim
            )
            q_s = q_BTNE[:, t0:t1].to(w) * scale  # the scale on [C, N, E], not [C, N, K]
            s_BCNK = torch.einsum(f"bcne,{g}e->bcnk", q_s, kg)
            s_BCNK.masked_fill_(~keep[:, :, None], -torch.inf)
            max_N = torch.maximum(max_N, s_BCNK.amax(dim=(0, 1, 3)))
            lse = torch.logsumexp(s_BCNK, -1)
            p_BCNK = s_BCNK.sub_(lse[..., None]).exp_()
            o_BTNV[:, t0:t1] = torch.einsum(f"bcnk,{g}v->bcnv", p_BCNK, vg).to(o_BTNV.dtype)
            lse_BTN[:, t0:t1] = lse
            if want_probs:
                total_BCK = p_BCNK.sum(2)
                probs_BTK[:, t0:t1] = total_BCK / total_BCK.sum(-1, keepdim=True)
        # the given positions (a tensor every layer shares), never a per-layer 0..T-1
        ctx.save_for_backward(q_BTNE, k_BSHE, v_BSHV, idx_BTK, o_BTNV, lse_BTN, pos_T)
        ctx.scale, ctx.value_dim, ctx.chunk = scale, value_dim, chunk
        ctx.mark_non_differentiable(probs_BTK, max_N)
        return o_BTNV, probs_BTK, max_N

    @staticmethod
    def backward(ctx, do_BTNV, _probs, _max):
        q_BTNE, k_BSHE, v_BSHV, idx_BTK, o_BTNV, lse_BTN, pos_T = ctx.saved_tensors
        scale, value_dim, chunk = ctx.scale, ctx.value_dim, ctx.chunk
        B, T, N, E = q_BTNE.shape
        q_T = _positions(pos_T, T, idx_BTK.device)
        S, H = k_BSHE.shape[1], k_BSHE.shape[2]
        w = work_dtype(q_BTNE.dtype)
        g = _subscripts(H == 1)
        keys_BSF = k_BSHE.reshape(B, S, H * E)
        vals_BSF = None if v_BSHV is None else v_BSHV.reshape(B, S, -1)
        base_B11 = (torch.arange(B, device=idx_BTK.device) * S)[:, None, None]
        dq_BTNE = torch.empty(B, T, N, E, dtype=w, device=q_BTNE.device)
        dk_F = torch.zeros(B * S, H * E, dtype=w, device=q_BTNE.device)
        dv_F = None if v_BSHV is None else torch.zeros_like(dk_F[:, : H * value_dim])
        # D = rowsum(dO * O): the softmax backward's per-row term
        delta_BTN = (do_BTNV.to(w) * o_BTNV.to(w)).sum(-1)
        for t0, t1 in query_chunks(T, chunk):
            kg, vg, keep = _chunk_keys(
                keys_BSF, vals_BSF, idx_BTK, base_B11, q_T, t0, t1, H, value_dim
            )
            q_s = q_BTNE[:, t0:t1].to(w) * scale
            do = do_BTNV[:, t0:t1].to(w)
            s_BCNK = torch.einsum(f"bcne,{g}e->bcnk", q_s, kg)
            s_BCNK.masked_fill_(~keep[:, :, None], -torch.inf)
            p_BCNK = s_BCNK.sub_(lse_BTN[:, t0:t1, :, None]).exp_()
            dp_BCNK = torch.einsum(f"bcnv,{g}v->bcnk", do, vg)
            # dS / scale = P * (dP - D): the scale goes on the [C, N, E] results instead
            ds_BCNK = dp_BCNK.sub_(delta_BTN[:, t0:t1, :, None]).mul_(p_BCNK)
            dq_BTNE[:, t0:t1] = torch.einsum(f"bcnk,{g}e->bcne", ds_BCNK, kg).mul_(scale)
            dkg = torch.einsum(f"bcnk,bcne->{g}e", ds_BCNK, q_s)
            dvg = torch.einsum(f"bcnk,bcnv->{g}v", p_BCNK, do)
            flat = (idx_BTK[:, t0:t1].clamp(min=0) + base_B11).reshape(-1)
            if dv_F is None:  # the values are the keys' first value_dim channels
                dkg[..., :value_dim] += dvg
            else:
                dv_F.index_add_(0, flat, dvg.reshape(flat.numel(), -1))
            dk_F.index_add_(0, flat, dkg.reshape(flat.numel(), -1))
        dk = dk_F.view_as(k_BSHE).to(k_BSHE.dtype)
        dv = None if dv_F is None else dv_F.view_as(v_BSHV).to(v_BSHV.dtype)
        return dq_BTNE.to(q_BTNE.dtype), dk, dv, None, None, None, None, None, None


def _positions(pos_T: torch.Tensor | None, T: int, device) -> torch.Tensor:
    """The queries' positions among the keys: `pos_T`, or 0..T-1 when None."""
    return torch.arange(T, device=device) if pos_T is None else pos_T


def _chunk_keys(keys_BSF, vals_BSF, idx_BTK, base_B11, q_T, t0, t1, H, value_dim):
    """float32 gathered keys and values of queries t0..t1 ([B, C, K, E] for one key head,
    else [B, C, K, N, E]) and which of the kept keys are causal ([B, C, K]: at or below the
    query's position `q_T`). A negative index (no key: a packed document shorter than K) is
    masked; row 0 is gathered for it."""
    idx_BCK = idx_BTK[:, t0:t1]
    flat_BCK = idx_BCK.clamp(min=0) + base_B11
    kg = gather_rows(keys_BSF, flat_BCK).to(work_dtype(keys_BSF.dtype))
    if H > 1:
        kg = kg.unflatten(-1, (H, -1))
    if vals_BSF is None:
        vg = kg[..., :value_dim]
    else:
        vg = gather_rows(vals_BSF, flat_BCK).to(work_dtype(vals_BSF.dtype))
        vg = vg.unflatten(-1, (H, -1)) if H > 1 else vg
    rows_C = q_T[t0:t1]
    return kg, vg, (idx_BCK <= rows_C[None, :, None]) & (idx_BCK >= 0)


def sparse_attention(
    q_BTNE: torch.Tensor,
    k_BSHE: torch.Tensor,
    v_BSHV: torch.Tensor | None,
    idx_BTK: torch.Tensor,
    scale: float,
    *,
    value_dim: int | None = None,
    chunk: int,
    want_probs: bool = False,
    positions_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each query over its kept causal keys `idx_BTK` (int64 positions < S):
    (output [B, T, N, V], the head-summed L1-normalized float32 probabilities on the kept keys
    [B, T, K] when `want_probs` (DSA's KL target; else empty), each head's largest logit [N]).
    `v_BSHV` None: the values are `k_BSHE[..., :value_dim]` (one key head only). `chunk`:
    queries per chunk; `positions_T`: each query's position among the S keys (0..T-1 when
    None). Differentiable in q, k and v; the probabilities and maxima are not."""
    H = k_BSHE.shape[2]
    if H not in (1, q_BTNE.shape[2]):
        raise ValueError(f"sparse_attention: key heads must be 1 or {q_BTNE.shape[2]}, got {H}")
    if v_BSHV is None:
        if H != 1 or value_dim is None:
            raise ValueError(
                "sparse_attention: values from the keys need one key head and value_dim"
            )
    else:
        value_dim = v_BSHV.shape[-1]
    return _SparseAttention.apply(
        q_BTNE, k_BSHE, v_BSHV, idx_BTK, scale, value_dim, chunk, want_probs, positions_T
    )
