"""The chunked loss head (`models.glm.model.model.chunked_cross_entropy`): the loss and gradients of
the unchunked cross-entropy within a bound derived from float32 rounding, never a [T, V]
tensor, and the whole-step planner's count of its memory."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.glm import get_preset
from models.glm.model.model import IGNORE_INDEX, chunked_cross_entropy
from recipes.step_memory import loss_head_chunk_bytes
from tests.live_bytes import LiveBytes

U = 2.0**-24  # float32 unit roundoff


def _problem(seed=0, B=2, T=37, D=16, V=50):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX
    return head, h, labels


@pytest.mark.parametrize("chunk", [1, 7, 37, 74, 1000])
def test_chunked_loss_and_gradients_equal_unchunked(chunk):
    head, h, labels = _problem()
    W = head.weight
    ref = F.cross_entropy(head(h).reshape(-1, W.shape[0]), labels.reshape(-1))
    g_h_ref, g_w_ref = torch.autograd.grad(ref, (h, W))
    out = chunked_cross_entropy(head, h, labels, chunk)
    g_h, g_w = torch.autograd.grad(out, (h, W))
    # The bound: a logit is a D-term dot product; two summation orders differ by at most
    # delta = 2 D u max(|h| |W|^T). A token's loss lse(z) - z_y moves by <= 2 delta, and the
    # mean adds N terms (<= N u max loss each way). Softmax moves by sum|dp| <= 2 delta, so a
    # gradient row (p - y) W / N moves by (2 delta + 4 V u) max|W| / N (the product's own
    # rounding over V terms with sum|p - y| <= 2), and the weight gradient, N rows of
    # (p - y)^T h / N summed, by (2 delta + 4 N u) max|h|.
    N, D, V = labels.numel(), h.shape[-1], W.shape[0]
    n_valid = int((labels != IGNORE_INDEX).sum())
    delta = 2 * D * U * (h.detach().abs().reshape(-1, D) @ W.detach().abs().T).max().item()
    token_losses = F.cross_entropy(head(h).reshape(-1, V), labels.reshape(-1), reduction="none")
    tol_loss = 2 * delta + 2 * (N + 8) * U * token_losses.max().item()
    assert abs(out.item() - ref.item()) <= tol_loss, (out.item(), ref.item(), tol_loss)
    tol_h = (2 * delta + 4 * V * U + 8 * U) * W.abs().max().item() / n_valid
    tol_w = (2 * delta + 4 * N * U + 8 * U) * h.detach().abs().max().item()
    assert (g_h - g_h_ref).abs().max().item() <= tol_h
    assert (g_w - g_w_ref).abs().max().item() <= tol_w


def test_all_ignored_is_zero_with_zero_gradients():
    head, h, labels = _problem()
    labels.fill_(IGNORE_INDEX)
    out = chunked_cross_entropy(head, h, labels, 8)
    (g_h,) = torch.autograd.grad(out, (h,))
    assert out.item() == 0.0 and torch.count_nonzero(g_h) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_full_logits_and_planner_counts_the_chunk(dtype):
    """Forward and backward of a 512-token head in 64-token chunks: no op output reaches
    [512, V]; the peak of the bytes alive at once is the planner's `loss_head_chunk_bytes`
    plus the gradients and inputs named below."""
    T, D, V, chunk = 512, 32, 1000, 64
    head = nn.Linear(D, V, bias=False).to(dtype)
    h = torch.randn(1, T, D, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (1, T))
    tracker = LiveBytes(h, labels, head.weight)
    with tracker:
        out = chunked_cross_entropy(head, h, labels, chunk)
        out.backward()
    assert tracker.largest <= chunk * V < T * V
    config = get_preset("tiny", vocab_size=V, hidden_size=D, loss_chunk_tokens=chunk)
    planned = loss_head_chunk_bytes(config, dtype.itemsize, T)
    # Alive next to the chunk and not the planner's loss-head part: the gradient of h (T D),
    # and in float32 the weight's (V D), which is the sum itself (below float32 the planner
    # counts that float32 sum; the weight's own-dtype gradient is made once it is complete,
    # when the chunk's logits are gone).
    a = dtype.itemsize
    other = T * D * a + (V * D * a if a == 4 else 0)
    # Exact up to a chunk's row vectors (the clamped labels and their gather index, int64, the
    # keep mask, a float32 row) and 0-d scalars.
    slack = chunk * (8 + 8 + 1 + 4) + 64
    assert 0 <= tracker.peak - (planned + other) <= slack, (tracker.peak, planned, other)


def test_bf16_weight_gradient_does_not_drift_with_the_chunk_count():
    """bf16 head, 4096 tokens: the weight's gradient summed in float32 over 4, 16 and 64
    chunks and cast once equals the unchunked one (one chunk) within one bf16 rounding. The
    two are one bf16 rounding each of float32 sums of the same N = 4096 products per entry in
    another order, so they differ by at most one bf16 ulp (<= 2^-7 of the value) plus the
    float32 reordering bound 2 N 2^-24 sum_t |g_t h_t| (Higham's gamma_N, each way). A
    bf16 accumulator instead rounds once per chunk, ~2^-9 of the running sum each time."""
    g = torch.Generator().manual_seed(0)
    T, D, V = 4096, 64, 512
    head = nn.Linear(D, V, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    h = torch.randn(1, T, D, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, V, (1, T), generator=g)
    grads = {}
    for chunk in (T, T // 4, T // 16, T // 64):
        (grads[chunk],) = torch.autograd.grad(
            chunked_cross_entropy(head, h, labels, chunk), (head.weight,)
        )
    ref = grads[T].double()
    # sum_t |g_t h_t| per entry, from the float32 softmax gradient (float64 products).
    with torch.no_grad():
        z = (h[0].double() @ head.weight.double().T).softmax(-1)
        z[torch.arange(T), labels[0]] -= 1
        abs_sum = (z.abs() / T).T @ h[0].double().abs()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    bound = ulp + 2 * T * 2.0**-24 * abs_sum
    for chunk, grad in grads.items():
        assert ((grad.double() - ref).abs() <= bound).all(), chunk


@pytest.mark.parametrize("bad", [-1, -2, 50, 51])
def test_labels_outside_the_vocabulary_are_refused(bad):
    head, h, labels = _problem()
    labels[1, 4] = bad
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, 50\).*got {bad} at "):
        chunked_cross_entropy(head, h, labels, 8)


@pytest.mark.parametrize("chunk_tokens", [8, 4096])
def test_model_refuses_bad_labels_before_any_layer(chunk_tokens):
    """Chunked and unchunked (one chunk holds every token), with the MTP depths: the label -1
    (torch's cross-entropy would raise; a clamp would score it as class 0) and one >= V are
    refused by name before the first layer runs; -100 is the ignore index."""
    from models.glm import GLMForCausalLM

    model = GLMForCausalLM(get_preset("mla_tiny", mtp_depths=2, loss_chunk_tokens=chunk_tokens))
    model.init_weights(0)
    ran = []
    model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(1))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.roll(-1, dims=1)
    for bad in (-1, 256):
        wrong = labels.clone()
        wrong[0, 20] = bad
        with pytest.raises(ValueError, match=rf"\[0, 256\).*got {bad} at position \[0, 20\]"):
            model(ids, wrong)
    assert not ran
    labels[:, :3] = IGNORE_INDEX
    assert set(model(ids, labels)) >= {"loss", "mtp_loss"}
