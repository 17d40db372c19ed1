"""The loss head: a mean cross-entropy over the vocabulary, `chunk` tokens at a time, and the
check of the labels it scores.

`chunked_cross_entropy` never holds the [T, V] logits: a chunk's [chunk, V] logits exist during
its forward and again during its backward (`_ChunkedCrossEntropySum`), where they turn in place
into the gradient softmax(z) - onehot(y). The lm_head weight's gradient is a sum over every
token; below float32 (bf16, fp16) it accumulates over the chunks in one float32 [V, D] buffer,
each chunk's product computed in float32, and is cast to the weight's dtype once at the end, so
its rounding does not grow with the number of chunks (a compute-dtype accumulator rounds once
per chunk). `check_labels` refuses a label outside [0, V) other than the ignore index (-1 would
otherwise be scored as class 0, and one >= V fails deep inside a gather).

Shape legend: N tokens, C a chunk of tokens, D hidden, V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from models.glm.model.execution import work_dtype

IGNORE_INDEX = -100  # labels of tokens without a target (cross_entropy's default ignore_index)


def check_labels(labels: torch.Tensor, vocab_size: int, what: str = "labels") -> None:
    """Raise ValueError naming the first label outside [0, vocab_size) that is not
    IGNORE_INDEX, its position and the allowed range. Reads the labels on the host (one
    device read when they live on a device)."""
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"{what} must be integer class ids, got dtype {labels.dtype}")
    bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= vocab_size)
    if not bool(bad.any()):
        return
    where = [int(i) for i in bad.nonzero()[0]]
    value = int(labels[tuple(where)])
    raise ValueError(
        f"{what} must lie in [0, {vocab_size}) (the vocabulary) or be {IGNORE_INDEX} (no "
        f"target); got {value} at position {where} ({int(bad.sum())} such labels)"
    )


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Summed cross-entropy of logits h W^T (float32; float64 for a float64 model) over the
    non-ignored rows of h [N, D], `chunk` rows at a time in forward and again in backward,
    where each chunk's gradient softmax(z) - onehot(y) is formed in place; only h, W and the
    labels are saved."""

    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N, chunk: int):
        w = work_dtype(h_ND.dtype)
        total = torch.zeros((), dtype=w, device=h_ND.device)
        for lo in range(0, h_ND.shape[0], chunk):
            z_CV = (h_ND[lo : lo + chunk] @ weight_VD.T).to(w)
            y_C = labels_N[lo : lo + chunk]
            keep_C = y_C != IGNORE_INDEX
            picked_C = z_CV.gather(1, y_C.clamp(min=0)[:, None])[:, 0]
            total += ((torch.logsumexp(z_CV, dim=-1) - picked_C) * keep_C).sum()
            del z_CV  # before the next chunk's logits exist
        ctx.save_for_backward(h_ND, weight_VD, labels_N)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_ND, weight_VD, labels_N = ctx.saved_tensors
        grad_h_ND = torch.empty_like(h_ND) if ctx.needs_input_grad[0] else None
        acc_VD, w = None, work_dtype(h_ND.dtype)
        if ctx.needs_input_grad[1]:  # float32 (or wider): the weight's gradient, cast once
            acc_VD = torch.zeros_like(weight_VD, dtype=work_dtype(weight_VD.dtype))
        for lo in range(0, h_ND.shape[0], ctx.chunk):
            h_CD, y_C = h_ND[lo : lo + ctx.chunk], labels_N[lo : lo + ctx.chunk]
            g_CV = (h_CD @ weight_VD.T).to(w)
            g_CV.sub_(g_CV.amax(dim=-1, keepdim=True)).exp_()  # softmax, in place
            g_CV.div_(g_CV.sum(dim=-1, keepdim=True))
            keep_C = y_C != IGNORE_INDEX
            g_CV.scatter_add_(1, y_C.clamp(min=0)[:, None], -keep_C[:, None].to(g_CV.dtype))
            g_CV.mul_((grad_total * keep_C)[:, None])
            if acc_VD is not None:  # float32 products into the float32 sum
                acc_VD.addmm_(g_CV.T.to(acc_VD.dtype), h_CD.to(acc_VD.dtype))
            if grad_h_ND is not None:
                g_CV = g_CV.to(weight_VD.dtype)
                torch.mm(g_CV, weight_VD, out=grad_h_ND[lo : lo + ctx.chunk])
            del g_CV  # before the next chunk's logits exist
        grad_w_VD = None if acc_VD is None else acc_VD.to(weight_VD.dtype)
        return grad_h_ND, grad_w_VD, None, None


def chunked_cross_entropy(
    head: nn.Module,
    h_BTD: torch.Tensor,
    labels_BT: torch.Tensor,
    chunk_tokens: int,
    *,
    check: bool = True,
    count: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean float32 (float64 for a float64 model) cross-entropy of `head(h)` (the bias-free
    lm_head) against labels [B, T] (-100 ignored; 0 when every label is ignored, the sum over
    no tokens), `chunk_tokens` tokens at a time: a chunk's [chunk, V] logits exist during its
    forward and again during its backward (`_ChunkedCrossEntropySum`), never [B*T, V]. Equal
    to the unchunked cross-entropy up to float32 rounding (tests/unit/test_loss_head.py
    derives the bound). `check`: refuse labels outside [0, V) first (`check_labels`; False
    when the caller has). `count`: divide the sum by this token count instead of the number
    of scored labels (a part of a longer sequence: its share of the full sequence's mean)."""
    if getattr(head, "bias", None) is not None:
        raise ValueError("chunked_cross_entropy needs a head without bias (the lm_head has none)")
    if check:
        check_labels(labels_BT, head.weight.shape[0])
    h_ND = h_BTD.reshape(-1, h_BTD.shape[-1])
    labels_N = labels_BT.reshape(-1)
    total = _ChunkedCrossEntropySum.apply(h_ND, head.weight, labels_N, chunk_tokens)
    if count is None:
        count = (labels_N != IGNORE_INDEX).sum().clamp(min=1)
    return total / count
