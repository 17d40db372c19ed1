"""The chunked loss head (`models.glm.model.chunked_cross_entropy`): the loss and gradients of
the unchunked cross-entropy within a bound derived from float32 rounding, never a [T, V]
tensor, and the whole-step planner's count of its memory."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from models.glm import get_preset
from models.glm.model import IGNORE_INDEX, chunked_cross_entropy
from recipes.step_memory import loss_head_chunk_bytes

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


class _Tracker(TorchDispatchMode):
    """Every tensor an op produces: the largest element count, and the peak of the bytes
    alive at once (a storage counts once, however many views or detached aliases share it,
    and is freed with the last of them)."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.largest = self.live = self.peak = 0
        self.refs: dict[int, int] = {}
        # Views of tensors made before (inputs, weights) add no bytes.
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    def _release(self, ptr, n):
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor) or not t.untyped_storage().nbytes():
                continue
            ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if ptr in self.existing:
                continue
            self.largest = max(self.largest, t.numel())
            if ptr not in self.refs:
                self.live += n
                self.peak = max(self.peak, self.live)
            self.refs[ptr] = self.refs.get(ptr, 0) + 1
            weakref.finalize(t, self._release, ptr, n)
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_full_logits_and_planner_counts_the_chunk(dtype):
    """Forward and backward of a 512-token head in 64-token chunks: no op output reaches
    [512, V]; the peak of the bytes alive at once is the planner's `loss_head_chunk_bytes`
    plus the gradients and inputs named below."""
    T, D, V, chunk = 512, 32, 1000, 64
    head = nn.Linear(D, V, bias=False).to(dtype)
    h = torch.randn(1, T, D, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, V, (1, T))
    tracker = _Tracker(h, labels, head.weight)
    with tracker:
        out = chunked_cross_entropy(head, h, labels, chunk)
        out.backward()
    assert tracker.largest <= chunk * V < T * V
    config = get_preset("tiny", vocab_size=V, hidden_size=D, loss_chunk_tokens=chunk)
    planned = loss_head_chunk_bytes(config, dtype.itemsize, T)
    # Alive next to the chunk and not the planner's loss-head part: the gradients of the weight
    # (V D) and of h (T D), the parameter's and the activation's own.
    other = V * D * dtype.itemsize + T * D * dtype.itemsize
    # Exact up to a chunk's row vectors (the clamped labels and their gather index, int64, the
    # keep mask, a float32 row) and 0-d scalars.
    slack = chunk * (8 + 8 + 1 + 4) + 64
    assert 0 <= tracker.peak - (planned + other) <= slack, (tracker.peak, planned, other)
