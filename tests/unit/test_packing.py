"""Packed documents: a packed sequence computes what its documents compute one by one.

Two rows of documents (lengths chosen so that, with mla_tiny's index_topk 16 and T = 32, some
documents are longer than the top-k and some shorter) run packed, with position_ids restarting
at each document and doc_ids, and each document runs alone; the logits, every loss term and
every parameter gradient agree, and so do the DSA indexer's kept keys.
"""

import pytest
import torch

from models.glm import GLMForCausalLM, get_preset
from models.glm.model.indexer import NO_KEY
from models.glm.model.packing import ahead_in_document, document_bounds

EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
ROWS = ([20, 3, 9], [7, 25])  # document lengths of the two packed rows, T = 32 each
T = 32
VOCAB = 256


def _model(preset: str, **overrides) -> GLMForCausalLM:
    torch.manual_seed(0)
    model = GLMForCausalLM(get_preset(preset, **overrides)).double()
    model.init_weights(0)
    with torch.no_grad():  # norm weights away from 1, as trained ones are
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def _documents(seed: int):
    """Each row's documents as (ids [L], labels [L]): the next token, -100 after the last."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for lengths in ROWS:
        docs = []
        for n in lengths:
            ids = torch.randint(2, VOCAB, (n + 1,), generator=g)
            labels = ids[1:].clone()
            labels[-1] = -100
            docs.append((ids[:-1], labels))
        rows.append(docs)
    return rows


def _packed(rows):
    """input_ids, labels, position_ids, doc_ids [2, T] of the rows packed."""
    cat = lambda parts: torch.stack([torch.cat(p) for p in parts])  # noqa: E731
    ids = cat([[d[0] for d in docs] for docs in rows])
    labels = cat([[d[1] for d in docs] for docs in rows])
    pos = cat([[torch.arange(len(d[0])) for d in docs] for docs in rows])
    doc = cat([[torch.full((len(d[0]),), i) for i, d in enumerate(docs)] for docs in rows])
    return ids, labels, pos, doc


class _Record:
    """Every head-loss call's token sum (mean x count: linear in the tokens, so the packed
    sum is the documents' sum) and every indexer's kept keys, in call order."""

    def __init__(self, model: GLMForCausalLM) -> None:
        self.sums, self.topk, self.hooks, self.cos = [], [], [], []
        head_loss = model.head_loss

        def counted(h, labels, tokens=None):
            loss = head_loss(h, labels, tokens)
            self.sums.append(loss * (labels != -100).sum())
            return loss

        model.head_loss = counted
        first = model.model.layers[0].self_attn  # the RoPE table it reads, [B, T, R] or [T, R]
        self.hooks.append(first.register_forward_pre_hook(lambda m, a: self.cos.append(a[1])))
        for layer in [*model.model.layers, *model.model.mtp_layers]:
            attn = layer.self_attn
            if getattr(attn, "indexer", None) is not None:
                hook = attn.register_forward_hook(lambda m, a, out: self.topk.append(out[1]))
                self.hooks.append(hook)


def _run(model, ids, labels, **packing):
    """(logits, [per-call token sums], the KL's query sum, gradients, kept keys)."""
    model.zero_grad(set_to_none=True)
    rec = _Record(model)
    with torch.no_grad():
        logits = model(ids, **packing)
    rec.topk.clear()
    terms = model(ids, labels, **packing)
    kl = terms.get("indexer_kl", torch.zeros((), dtype=torch.float64))
    # indexer_kl: the mean over layers of each layer's mean over the B x T queries
    kl_sum = kl * len(rec.topk) * ids.numel()
    (sum(rec.sums) + kl_sum).backward()
    del model.head_loss
    for hook in rec.hooks:
        hook.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    cos = rec.cos[-1].expand(ids.shape[0], *rec.cos[-1].shape[-2:])
    return logits, [s.detach() for s in rec.sums], kl_sum.detach(), grads, rec.topk, cos


def _close(got, want, bound, msg=None):
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=bound, atol=bound * scale, msg=msg)


def _check_topk(packed_topk, per_doc_topk, rows):
    """Each query's kept keys: those it keeps in its document alone (its first n slots there:
    the kept keys come in ascending position), the remaining K - n slots NO_KEY."""
    for layer, got_BTK in enumerate(packed_topk):
        K = got_BTK.shape[-1]
        for b, docs in enumerate(rows):
            start = 0
            for d, (ids, _) in enumerate(docs):
                want = per_doc_topk[(b, d)][layer][0]  # [L, min(K, L)]
                for t in range(len(ids)):
                    n = min(K, t + 1)  # its causal keys in the document
                    row = got_BTK[b, start + t]
                    got = sorted(x for x in row.tolist() if x != NO_KEY)
                    assert got == sorted((want[t, :n] + start).tolist()), (layer, b, d, t)
                    assert int((row == NO_KEY).sum()) == K - n, (layer, b, d, t)
                start += len(ids)


CASES = {
    "gqa": ("tiny", {"num_mtp_layers": 1}),
    "mla_dsa": ("mla_tiny", {"mtp_depths": 2, "loss_chunk_tokens": 8}),
    "mla_dsa_masked": ("mla_tiny", {"dsa_impl": "masked", "indexer_training": "frozen"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_documents_equal_documents_run_alone(case):
    preset, overrides = CASES[case]
    model = _model(preset, **overrides)
    rows = _documents(seed=1)
    ids, labels, pos, doc = _packed(rows)
    logits, sums, kl_sum, grads, topk, cos = _run(model, ids, labels, position_ids=pos, doc_ids=doc)
    ref_logits, ref_cos, ref_kl, ref_sums = [], [], 0.0, [0.0] * len(sums)
    ref_grads = {n: torch.zeros_like(g) for n, g in grads.items()}
    per_doc_topk = {}
    for b, docs in enumerate(rows):
        row_logits, row_cos = [], []
        for d, (d_ids, d_labels) in enumerate(docs):
            out = _run(model, d_ids[None], d_labels[None])
            row_logits.append(out[0][0])
            row_cos.append(out[5][0])
            ref_sums = [a + s for a, s in zip(ref_sums, out[1], strict=True)]
            ref_kl = ref_kl + out[2]
            for n, g in out[3].items():
                ref_grads[n] += g
            per_doc_topk[(b, d)] = out[4]
        ref_logits.append(torch.cat(row_logits))
        ref_cos.append(torch.cat(row_cos))
    # RoPE reads each token's position in its document (attention alone cannot tell: RoPE's
    # scores depend on position differences only), the same table rows bit for bit
    assert torch.equal(cos, torch.stack(ref_cos))
    # Tolerance: a float64 model whose runs differ only in reduction order and blocking
    # (~1e-16), except the router, which scores in float32 (`models.glm.model.moe.Router`): a
    # routing weight is a float32 D-term dot product (D = 64: sqrt(64) = 8 terms' worth of
    # random-sign rounding, 4 ulps each) then sigmoid, normalization and scaling (~8 ulps),
    # ~40 eps32 relative; each MoE output carries it and the <= 4 MoE layers (the MTP layer
    # included) add up: 4 * 40 * eps32 = 1.9e-5 relative to the largest entry of each
    # tensor. A key read across a document, or a target taken from the next one, moves
    # them by > 1e-2.
    bound = 4 * 40 * EPS32
    _close(logits, torch.stack(ref_logits), bound)
    for got, want in zip(sums, ref_sums, strict=True):
        _close(got, want, bound)
    _close(kl_sum, torch.as_tensor(ref_kl, dtype=kl_sum.dtype), bound)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        _close(grads[name], g, bound, name)
    if preset == "mla_tiny":
        _check_topk(topk, per_doc_topk, rows)


def test_document_bounds_and_mtp_targets_stay_inside_documents():
    doc = torch.tensor([[0, 0, 0, 1, 2, 2], [5, 5, 5, 5, 5, 5]])
    pos = torch.tensor([[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5]])
    ids = torch.arange(12).view(2, 6) + 10
    start, end = document_bounds(ids, pos, doc)
    assert start.tolist() == [[0, 0, 0, 3, 4, 4], [0] * 6]
    assert end.tolist() == [[2, 2, 2, 3, 5, 5], [5] * 6]
    ahead, target = ahead_in_document(ids, ids + 100, 1, start, end)
    # depth 1 reads the next token of its document, wrapping inside it (as roll does alone)
    assert ahead.tolist() == [[11, 12, 10, 13, 15, 14], [17, 18, 19, 20, 21, 16]]
    assert target.tolist() == [[111, 112, -100, -100, 115, -100], [117, 118, 119, 120, 121, -100]]
    with pytest.raises(ValueError, match="both position_ids and doc_ids"):
        document_bounds(ids, pos, None)
    with pytest.raises(ValueError, match="doc_ids: integer"):
        document_bounds(ids, pos, doc[:, :3])
