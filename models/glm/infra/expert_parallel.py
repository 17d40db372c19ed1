"""Token dispatch to routed experts, with or without expert parallelism (EP).

Every token-expert assignment is sorted by expert. Without EP (`group` None or of size 1) the
sorted rows go straight to the local experts. With EP, expert e lives on EP rank e // E_l
(E_l = E / ep experts per rank, contiguous), so the sorted rows are already grouped by
destination rank: one all_to_all_single (uneven splits) sends them, the owner runs its experts,
and a second one brings the outputs back. Both exchanges are differentiable (`all_to_all`):
backward is the same exchange with the splits swapped.

Row gathers are index_select, whose backward is a plain index_add_ (no sort of the indices).

Shape legend: N tokens, K experts per token, D hidden, A = N*K assignments, E experts,
P EP ranks, L local experts (E / P), S rows received by this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.send_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group
        )
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group):
    """Differentiable all_to_all_single of the rows of `x`: send_splits[r] rows go to rank r,
    recv_splits[r] rows arrive from rank r (in rank order)."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


def expert_counts(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `idx` name each of `num_experts` experts: int64 [num_experts], on
    idx's device. Unlike torch.bincount, whose CUDA kernel reads the ids' min and max on the
    host to size its output, a scatter-add of ones reads nothing."""
    flat = idx.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def routed_experts_forward(
    experts,
    x_ND: torch.Tensor,
    idx_NK: torch.Tensor,
    w_NK: torch.Tensor,
    num_experts: int,
    group=None,
) -> torch.Tensor:
    """sum_k w[n,k] * Expert_{idx[n,k]}(x[n]) for every token n, with the experts spread over
    the EP `group` (None: all experts local). `experts(x_SD, counts_L)` runs local expert j on
    the j-th block of counts_L[j] consecutive rows (counts_L a device tensor). Returns [N, D]
    in x's dtype. Host reads: none without EP; with EP one, the split sizes of both exchanges
    (`.tolist()` of one stacked tensor) that all_to_all_single takes as Python ints."""
    N, K = idx_NK.shape
    flat_A = idx_NK.reshape(-1)
    order_A = torch.argsort(flat_A, stable=True)
    token_A = order_A // K  # the token of each expert-sorted assignment
    counts_E = expert_counts(flat_A, num_experts)
    x_AD = x_ND.index_select(0, token_A)

    ep = 1 if group is None else dist.get_world_size(group)
    if ep == 1:
        y_AD = experts(x_AD, counts_E)
    else:
        L = num_experts // ep
        # recv_counts_PL[p, j]: rows that source rank p sends to my local expert j.
        recv_counts_E = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_E, counts_E, group=group)
        recv_counts_PL = recv_counts_E.view(ep, L)
        splits_2P = torch.stack([counts_E.view(ep, L).sum(1), recv_counts_PL.sum(1)])
        send_splits, recv_splits = splits_2P.tolist()  # the one host read of the layer
        x_SD = all_to_all(x_AD, send_splits, recv_splits, group)
        # Received rows are ordered (source, local expert); regroup them by local expert. Row s
        # lies in run r = #(run ends <= s) of the P*L runs, the run of local expert r % L.
        row_S = torch.arange(sum(recv_splits), device=x_ND.device)
        run_S = torch.searchsorted(torch.cumsum(recv_counts_E, 0), row_S, right=True)
        perm_S = torch.argsort(run_S % L, stable=True)
        y_grouped_SD = experts(x_SD.index_select(0, perm_S), recv_counts_PL.sum(0))
        unperm_S = torch.empty_like(perm_S).scatter_(0, perm_S, row_S)  # perm's inverse, no sort
        y_SD = y_grouped_SD.index_select(0, unperm_S)
        y_AD = all_to_all(y_SD, recv_splits, send_splits, group)

    w_A = w_NK.reshape(-1).index_select(0, order_A)
    return _Combine.apply(y_AD, w_A, token_A, x_ND)


class _Combine(torch.autograd.Function):
    """out[n] = sum of w[a] * y[a] over the assignments a of token n (index_add_ into zeros, in
    the order of a), in the dtype of `like_ND`. Its backward forms the gradients autograd would
    (the same products and row sums, bit for bit) with one [A, D] temporary fewer: the gathered
    output gradient is scaled in place once the routing weights' gradient has read it."""

    @staticmethod
    def forward(ctx, y_AD, w_A, token_A, like_ND):
        out_ND = torch.zeros_like(like_ND)
        out_ND.index_add_(0, token_A, (y_AD * w_A[:, None]).to(like_ND.dtype))
        ctx.save_for_backward(y_AD, w_A, token_A)
        return out_ND

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ND):
        y_AD, w_A, token_A = ctx.saved_tensors
        g_AD = g_ND.index_select(0, token_A).to(torch.result_type(y_AD, w_A))
        grad_w = (g_AD * y_AD).sum(-1) if ctx.needs_input_grad[1] else None
        grad_y = g_AD.mul_(w_A[:, None]).to(y_AD.dtype) if ctx.needs_input_grad[0] else None
        return grad_y, grad_w, None, None
