"""DSA at sparse cost equals the masked reference: the gathered-key attention (latent and
per-head forms) against dense attention under the kept-key mask, values and gradients, at
T > K and T <= K, in chunks of any size; the chunked indexer against the plain all-pairs
formula ([B, T, M, S] scores, top-k, KL over the masked [B, T, S] rows), its chunks cut at
the runs of local tokens; the whole mla_tiny
model (a shared layer, an MTP layer) under every `dsa_impl`, kl and frozen."""

import inspect

import pytest
import torch

from models.glm import GLMForCausalLM, get_preset
from models.glm.model.indexer import Indexer, MiB, indexer_kl, kept_mask, select_topk, sparse_mask
from models.glm.model.sparse_attention import sparse_attention
from tests.live_bytes import LiveBytes

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7


def _dense_reference(q_BTNE, k_BSHE, v_BSHV, idx_BTK, scale):
    """Softmax attention over all keys with the kept causal keys' mask (plain autograd)."""
    T, N = q_BTNE.shape[1], q_BTNE.shape[2]
    k = k_BSHE.expand(-1, -1, N, -1)
    v = v_BSHV.expand(-1, -1, N, -1)
    s_BNTS = torch.einsum("btne,bsne->bnts", q_BTNE, k) * scale
    s_BNTS = s_BNTS.masked_fill(~sparse_mask(idx_BTK, T), -torch.inf)
    p_BNTS = s_BNTS.softmax(-1)
    total_BTS = p_BNTS.sum(1)
    probs_BTK = (total_BTS / total_BTS.sum(-1, keepdim=True)).gather(-1, idx_BTK)
    return torch.einsum("bnts,bsnv->btnv", p_BNTS, v), probs_BTK * kept_mask(idx_BTK)


def _kept(B, T, K, g):
    """Random distinct kept keys per query: the causal ones first (as a top-k over causal
    scores), then later positions as padding when fewer than K are causal."""
    rows = []
    for t in range(T):
        causal = torch.randperm(t + 1, generator=g)[: min(K, t + 1)]
        pad = torch.arange(t + 1, T)[: K - causal.numel()]
        rows.append(torch.cat([causal, pad]))
    return torch.stack(rows).expand(B, T, K).contiguous()


@pytest.mark.parametrize("shared", [True, False], ids=["latent_mqa", "per_head"])
@pytest.mark.parametrize("T, K", [(24, 8), (8, 8), (6, 8)], ids=["T>K", "T=K", "T<K"])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_sparse_attention_equals_masked_dense(shared, T, K, chunk):
    g = torch.Generator().manual_seed(T * 10 + K + chunk)
    B, N, E, V = 2, 3, 12, 8
    H = 1 if shared else N
    q = torch.randn(B, T, N, E, generator=g, requires_grad=True)
    k = torch.randn(B, T, H, E, generator=g, requires_grad=True)
    v_own = torch.randn(B, T, H, V, generator=g, requires_grad=True)
    idx = _kept(B, T, min(K, T), g)
    scale = E**-0.5
    if shared:  # the latent form: the values are the key's first V channels
        out, probs, max_N = sparse_attention(
            q, k, None, idx, scale, value_dim=V, chunk=chunk, want_probs=True
        )
        ref, ref_probs = _dense_reference(q, k, k[..., :V], idx, scale)
    else:
        out, probs, max_N = sparse_attention(q, k, v_own, idx, scale, chunk=chunk, want_probs=True)
        ref, ref_probs = _dense_reference(q, k, v_own, idx, scale)
    dout = torch.randn(out.shape, generator=g)
    inputs = (q, k) if shared else (q, k, v_own)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    # Tolerance: both are float32 with |q|, |k|, |v| ~ 1 and sums of <= E + K = 20 products
    # in another order (einsum over gathered keys vs over all keys); the difference is a few
    # ulps per term, 20 * 4 * eps ~ 1e-5 at outputs and gradients of order one (a wrong mask
    # or softmax term is off by > 1e-2).
    bound = 20 * 4 * EPS32
    torch.testing.assert_close(out, ref, rtol=bound, atol=bound)
    torch.testing.assert_close(probs, ref_probs, rtol=bound, atol=bound)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=bound, atol=bound)
    # Each head's largest logit over its kept causal keys (QK-clip's recording).
    kk = k.expand(-1, -1, N, -1)
    s = torch.einsum("btne,bsne->bnts", q, kk) * scale
    want_max = s.masked_fill(~sparse_mask(idx, T), -torch.inf).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_N, want_max, rtol=bound, atol=bound)


def _indexer(seed: int, training: str) -> Indexer:
    config = get_preset("mla_tiny", index_topk=8, index_n_heads=4, indexer_training=training)
    torch.manual_seed(seed)
    indexer = Indexer(config)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.1) + (p.ndim == 1))
    return indexer


def _dense_index_scores(indexer, x, q_lat, cos, sin):
    """The indexer as written over all pairs: [B, T, M, S] logits, -inf above the diagonal."""
    q_BTMC, k_BTC, w_BTM = indexer.project(x, q_lat, cos, sin)
    relu_BTMS = torch.einsum("btmc,bsc->btms", q_BTMC, k_BTC).relu()
    scores_BTS = torch.einsum("btm,btms->bts", w_BTM, relu_BTMS)
    T = x.shape[1]
    return scores_BTS.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)


@pytest.mark.parametrize("T", [20, 8, 5], ids=["T>K", "T=K", "T<K"])
def test_chunked_indexer_equals_all_pairs(T):
    from models.glm.model.layers import rope_cos_sin

    indexer = _indexer(T, "kl")
    config = get_preset("mla_tiny")
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, config.hidden_size, generator=g)
    q_lat = torch.randn(2, T, config.q_lora_rank, generator=g)
    cos, sin = rope_cos_sin(T, config.rotary_dim, config.rope_theta, torch.device("cpu"))
    K = min(indexer.topk, T)
    dense_BTS = _dense_index_scores(indexer, x, q_lat, cos, sin)
    indexer.chunk_bytes = 1  # one query per chunk
    idx_BTK, scores_BTK = indexer(x, q_lat, cos, sin)
    assert idx_BTK.shape == (2, T, K)
    for chunk in (3, T):
        q_BTMC, k_BTC, w_BTM = indexer.project(x, q_lat, cos, sin)
        again = select_topk(q_BTMC, k_BTC, w_BTM, indexer.topk, chunk)
        assert torch.equal(sparse_mask(again, T), sparse_mask(idx_BTK, T))  # the causal ones
    # A valid top-k of the all-pairs scores: the kept causal keys are distinct, the smallest
    # kept score is >= the largest dropped causal one, and a query keeps min(K, t + 1) keys.
    keep = kept_mask(idx_BTK)
    assert torch.equal(keep.sum(-1), torch.arange(T).clamp(max=K - 1).add(1).expand(2, T))
    kept_BTS = sparse_mask(idx_BTK, T)[:, 0]
    low = dense_BTS.masked_fill(~kept_BTS, torch.inf).amin(-1)
    high = dense_BTS.masked_fill(kept_BTS, -torch.inf).amax(-1)
    assert (low >= high).all()
    # Tolerance: the kept scores are the same float32 sums of M * C = 64 products (gathered
    # vs all-pairs einsum), ~64 * 4 * eps relative to scores of order one.
    bound = 64 * 4 * EPS32
    dense_kept = dense_BTS.gather(-1, idx_BTK)
    torch.testing.assert_close(scores_BTK[keep], dense_kept[keep], rtol=bound, atol=bound)
    # The KL on the kept keys equals the KL over the masked [B, T, S] rows, value and gradient.
    target_BTS = torch.rand(2, T, T, generator=g).masked_fill(~kept_BTS, 0.0)
    target_BTS = target_BTS / target_BTS.sum(-1, keepdim=True)
    kl = indexer_kl(scores_BTK, target_BTS.gather(-1, idx_BTK) * keep, keep)
    ref = indexer_kl(dense_BTS, target_BTS, kept_BTS)  # today's formula, on [B, T, S]
    params = list(indexer.parameters())
    grads = torch.autograd.grad(kl, params)
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(kl, ref, rtol=bound, atol=bound)
    for p, got, want in zip(params, grads, ref_grads, strict=True):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=bound, atol=bound * scale, msg=str(p.shape))


def test_indexer_chunks_stop_at_the_runs_of_local_tokens():
    """Queries at head-tail positions (cp rank 0 of 2 over 40 tokens: runs 0-9 and 30-39):
    no query chunk spans the two runs, so the first run's chunks score keys up to position 10
    only, and the kept keys equal the whole sequence's rows at those positions."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.glm.infra.context_parallel import local_tokens
    from models.glm.model.sparse_attention import query_chunks

    tokens = local_tokens("head_tail", 2, 0, 40).on(torch.device("cpu"))
    assert list(query_chunks(20, 4, tokens)) == [
        *[(0, 4), (4, 8), (8, 10)],
        *[(10, 14), (14, 18), (18, 20)],
    ]
    assert list(query_chunks(10, 4)) == [(0, 4), (4, 8), (8, 10)]
    with pytest.raises(ValueError, match="21 queries, but the tokens hold 20"):
        list(query_chunks(21, 4, tokens))
    g = torch.Generator().manual_seed(5)
    q_BSMC, k_BSC, w_BSM = (torch.randn(1, 40, *d, generator=g) for d in ((4, 16), (16,), (4,)))
    full = select_topk(q_BSMC, k_BSC, w_BSM, 8, 4)
    with FlopCounterMode(display=False) as flops:
        local = select_topk(tokens.take(q_BSMC), k_BSC, tokens.take(w_BSM), 8, 4, tokens=tokens)
    # A chunk of J queries scoring the first `keys` keys: [J M, C] x [C, keys] and the head sum
    # [J, M] x [M, keys], 2 J M (C + 1) keys FLOPs. The first run's chunks of 4, 4 and 2
    # queries score 8 (K), 8 and 10 keys; the second run's 34, 38 and 40.
    scored = 4 * 8 + 4 * 8 + 2 * 10 + 4 * 34 + 4 * 38 + 2 * 40
    assert flops.get_total_flops() == 2 * 4 * 17 * scored
    assert torch.equal(local, tokens.take(full))


def test_frozen_indexer_returns_no_scores():
    indexer = _indexer(0, "frozen")
    from models.glm.model.layers import rope_cos_sin

    config = get_preset("mla_tiny")
    x = torch.randn(1, 12, config.hidden_size)
    q_lat = torch.randn(1, 12, config.q_lora_rank)
    cos_sin = rope_cos_sin(12, config.rotary_dim, config.rope_theta, torch.device("cpu"))
    idx, scores = indexer(x, q_lat, *cos_sin)
    assert scores is None and not idx.requires_grad and idx.shape == (1, 12, 8)


def _tiny(impl: str, training: str) -> GLMForCausalLM:
    """mla_tiny: layers full, shared, full, an MTP layer; index_topk 16."""
    model = GLMForCausalLM(get_preset("mla_tiny", dsa_impl=impl, indexer_training=training))
    model.init_weights(0)
    return model


def _terms_and_grads(model, ids, attention_chunk_bytes):
    for m in model.modules():  # several query chunks per layer
        if isinstance(m, Indexer):  # the same chunks as the reference's: the same top-k ties
            m.chunk_bytes = 8192
        elif hasattr(m, "chunk_bytes"):
            m.chunk_bytes = attention_chunk_bytes
    terms = model(ids[:, :-1], ids[:, 1:])
    total = terms["loss"] + 0.3 * terms["mtp_loss"] + terms.get("indexer_kl", 0.0)
    total.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in terms.items()}, grads


@pytest.mark.parametrize("training", ["kl", "frozen"])
@pytest.mark.parametrize("seq", [40, 12], ids=["T>K", "T<K"])
@pytest.mark.parametrize("impl", ["latent", "per_head"])
def test_model_sparse_equals_masked(impl, seq, training):
    ids = torch.randint(0, 256, (2, seq + 1), generator=torch.Generator().manual_seed(seq))
    ref_model = _tiny("masked", training)
    model = _tiny(impl, training)
    model.load_state_dict(ref_model.state_dict())
    ref_terms, ref_grads = _terms_and_grads(ref_model, ids, 1 << 20)
    terms, grads = _terms_and_grads(model, ids, 4096)
    assert set(terms) == set(ref_terms) and ("indexer_kl" in terms) == (training == "kl")
    assert set(grads) == set(ref_grads)
    assert any(".indexer." in n for n in grads) == (training == "kl")
    # Tolerance: float32 forwards that differ in summation order (the latent form also
    # reassociates q_nope . (W_uk kv) as (q_nope W_uk) . kv, ~L * P = 256 products): a few
    # ulps per stage, ~40 stages of <= 256-term sums with random signs (sqrt(256) = 16x)
    # give ~40 * 16 * 4 * eps = 3e-4 relative, on losses and on each gradient tensor
    # relative to its largest entry. A wrong kept key or mask moves them by > 1e-2.
    bound = 40 * 16 * 4 * EPS32
    for k, v in ref_terms.items():
        torch.testing.assert_close(terms[k], v, rtol=bound, atol=bound, msg=k)
    for name, g in ref_grads.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(grads[name], g, rtol=bound, atol=bound * scale, msg=name)


class _ChunkPeaks(LiveBytes):
    """The bytes each step of every chunk loop (`query_chunks`) makes and holds at once, by
    the loop's site: op outputs counted once per storage until freed, from the step's start
    (what it writes into buffers made before the loop adds nothing)."""

    def __init__(self):
        super().__init__()
        self.peaks: dict[str, int] = {}

    def chunks(self, original):
        def counted(T, chunk, tokens=None):
            caller = inspect.currentframe().f_back.f_code
            site = f"{caller.co_filename.rsplit('/', 1)[-1]}:{caller.co_name}"
            for t0, t1 in original(T, chunk, tokens):
                start = self.peak = self.live
                yield t0, t1
                self.peaks[site] = max(self.peaks.get(site, 0), self.peak - start)

        return counted


@pytest.mark.parametrize("impl", ["latent", "per_head"])
def test_chunk_peaks_stay_within_dsa_chunk_mib(impl, monkeypatch):
    """dsa_chunk_mib 1 at T = 256 (each loop runs several chunks): the measured peak of one
    chunk's temporaries in every loop, forward and backward (the indexer's top-k and kept
    scores, the sparse attention), is within 1.25x of the budget."""
    import models.glm.model.indexer as indexer_mod
    import models.glm.model.sparse_attention as sparse_mod

    peaks = _ChunkPeaks()
    wrapped = peaks.chunks(sparse_mod.query_chunks)
    monkeypatch.setattr(sparse_mod, "query_chunks", wrapped)
    monkeypatch.setattr(indexer_mod, "query_chunks", wrapped)
    config = get_preset(
        "mla_tiny",
        dsa_impl=impl,
        dsa_chunk_mib=1,
        index_topk=64,
        num_mtp_layers=0,
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        kv_lora_rank=64,
        q_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        index_n_heads=8,
        index_head_dim=32,
    )
    model = GLMForCausalLM(config)
    model.init_weights(0)
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))
    with peaks:
        terms = model(ids, ids.roll(-1, 1))
        (terms["loss"] + terms["indexer_kl"]).backward()
    sites = {"indexer.py:select_topk", "indexer.py:forward", "indexer.py:backward"}
    sites |= {"sparse_attention.py:forward", "sparse_attention.py:backward"}
    assert set(peaks.peaks) == sites
    for site, peak in peaks.peaks.items():
        assert peak <= 1.25 * MiB, (site, peak / MiB)
