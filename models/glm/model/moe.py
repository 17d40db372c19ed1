"""Mixture-of-experts block: sigmoid router with a score-correction bias, fused routed experts,
and the shared expert.

Routed dispatch (`routed_experts_forward`): every token-expert assignment is sorted by expert,
the sorted rows go to the experts (`FusedExperts.dispatch`: on one device straight to the local
experts), and the outputs are summed back per token with the routing weights. Row gathers are
index_select, whose backward is a plain index_add_ (no sort of the indices).

Shape legend: N tokens, D hidden, E experts, K experts per token, G expert groups,
I expert inner size, L local experts, S rows for the local experts, C rows per
expert slot of the padded batched matmul, A = N*K assignments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm.model.config import GLMConfig
from models.glm.model.execution import eager, is_recomputing
from models.glm.model.layers import MLP


def expert_counts(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of `idx` name each of `num_experts` experts: int64 [num_experts], on
    idx's device. Unlike torch.bincount, whose CUDA kernel reads the ids' min and max on the
    host to size its output, a scatter-add of ones reads nothing."""
    flat = idx.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


@eager
def _count_loads(expert_load: torch.Tensor, idx_NK: torch.Tensor) -> None:
    # Eager even inside a compiled layer: were the recomputation flag read by compiled code,
    # the recomputation would run a differently compiled graph whose saved tensors do not
    # line up with the forward's, and activation checkpointing would use the wrong ones.
    if not is_recomputing():  # the counts feed the load-balancing bias: each token once
        expert_load += expert_counts(idx_NK, expert_load.numel())


class Router(nn.Module):
    """Sigmoid top-k router with auxiliary-loss-free load balancing.

    The score-correction bias (a buffer, never trained by backprop) only chooses experts; the
    weights are the bias-free sigmoid scores of the chosen experts, optionally renormalized, times
    routed_scaling_factor. Every forward adds the chosen-expert counts to `expert_load`, which
    `GLMForCausalLM.expert_loads` reads and `GLMForCausalLM.apply_router_bias_update` resets.
    """

    param_roles = {"weight": "router"}

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        E = config.n_routed_experts
        self.num_experts, self.top_k = E, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.register_buffer("expert_load", torch.zeros(E, dtype=torch.long), persistent=False)

    def forward(self, x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (chosen expert ids [N, K], float32 routing weights [N, K])."""
        logits_NE = F.linear(x_ND.float(), self.weight.float())
        scores_NE = torch.sigmoid(logits_NE)
        with torch.no_grad():
            choice_NE = scores_NE + self.e_score_correction_bias.float()
            if self.n_group > 1:
                N = choice_NE.shape[0]
                choice_NGe = choice_NE.view(N, self.n_group, -1)
                group_score_NG = choice_NGe.topk(2, dim=-1).values.sum(-1)
                keep_NG = torch.zeros_like(group_score_NG, dtype=torch.bool)
                keep_NG.scatter_(1, group_score_NG.topk(self.topk_group, dim=-1).indices, True)
                choice_NE = choice_NGe.masked_fill(~keep_NG[..., None], float("-inf")).view(N, -1)
            idx_NK = choice_NE.topk(self.top_k, dim=-1, sorted=False).indices
            _count_loads(self.expert_load, idx_NK)
        w_NK = scores_NE.gather(1, idx_NK)
        if self.norm_topk_prob:
            w_NK = w_NK / (w_NK.sum(-1, keepdim=True) + 1e-20)
        return idx_NK, w_NK * self.routed_scaling_factor


#: How FusedExperts runs its local experts: one grouped matmul, one padded batched matmul, or a
#: Python loop of per-expert matmuls (the reference); "auto" picks by `expert_kernel`.
EXPERT_KERNELS = ("auto", "grouped_mm", "padded_bmm", "loop")


def expert_kernel(x_SD: torch.Tensor, *weights: torch.Tensor) -> str:
    """The kernel "auto" runs: "grouped_mm" where `torch._grouped_mm` has a native kernel for
    these operands, else "padded_bmm".

    torch._grouped_mm takes float32, bfloat16 and float16 operands whose row strides are
    multiples of 16 bytes (hidden and inner size times the element size). On CPU it then runs
    (a loop of matmuls inside one op, reading the offsets directly). On CUDA its native kernel
    needs bf16 on compute capability 9.x or 10.x (Hopper, Blackwell), fewer than 1024 groups and
    16-byte aligned data; anything else would take torch's own fallback, which copies the
    offsets to the host on every call (six blocking reads per layer, forward and backward). The
    kernel checks group sizes on the device: any size, zero included, passes with row-major
    rows and row-major output gradients (the weight gradients contract a column-major x^T with
    a row-major gradient), which `_grouped_mm` below keeps. The padded bmm needs one host read
    per forward and runs on every device and dtype (float64 included).
    """
    dtype, device = x_SD.dtype, x_SD.device
    operands = (x_SD, *weights)
    rows_aligned = all(t.stride(-2) * t.element_size() % 16 == 0 for t in operands)
    if device.type == "cpu":
        native = dtype in (torch.float32, torch.bfloat16, torch.float16)
    elif device.type == "cuda":
        native = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)
        native = native and all(w.shape[0] < 1024 for w in weights if w.dim() == 3)
        rows_aligned = rows_aligned and all(t.data_ptr() % 16 == 0 for t in operands)
    else:
        native = False
    return "grouped_mm" if native and rows_aligned else "padded_bmm"


def _row_major(grad_SD: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's backward takes row-major gradients only; that of .sum() is broadcast
    # (strides 0, which even an empty gradient may keep through .contiguous()).
    if grad_SD.stride() == (grad_SD.shape[1], 1):
        return grad_SD
    return grad_SD.clone(memory_format=torch.contiguous_format)


def _grouped_mm(x_SD, w_gu_L2ID, w_down_LDI, counts_L):
    ends_L = torch.cumsum(counts_L, 0, dtype=torch.int32)  # group j: rows ends[j-1]..ends[j]-1
    gate_SI, up_SI = torch._grouped_mm(x_SD, w_gu_L2ID.transpose(1, 2), offs=ends_L).chunk(2, -1)
    y_SD = torch._grouped_mm(F.silu(gate_SI) * up_SI, w_down_LDI.transpose(1, 2), offs=ends_L)
    if y_SD.requires_grad:
        y_SD.register_hook(_row_major)
    return y_SD


def _padded_bmm(x_SD, w_gu_L2ID, w_down_LDI, counts_L):
    # Each expert's rows go to a [C, D] slot of zeros (C: the largest count, this kernel's one
    # host read); a zero row yields a zero output and zero gradients, so padding changes nothing.
    S, D, L = x_SD.shape[0], x_SD.shape[1], counts_L.numel()
    C = int(counts_L.max()) if S else 0
    ends_L = torch.cumsum(counts_L, 0)
    row_S = torch.arange(S, device=x_SD.device)
    expert_S = torch.searchsorted(ends_L, row_S, right=True)
    start_S = (ends_L - counts_L).index_select(0, expert_S)
    flat_S = expert_S * C + row_S - start_S  # row s goes to slot (expert, row - its start)
    x_LCD = x_SD.new_zeros(L * C, D).index_copy(0, flat_S, x_SD).view(L, C, D)
    gate_LCI, up_LCI = torch.bmm(x_LCD, w_gu_L2ID.transpose(1, 2)).chunk(2, -1)
    y_LCD = torch.bmm(F.silu(gate_LCI) * up_LCI, w_down_LDI.transpose(1, 2))
    return y_LCD.view(L * C, D).index_select(0, flat_S)


def _loop(x_SD, w_gu_L2ID, w_down_LDI, counts_L):
    outs = []  # one host read (the counts), three matmul-sized ops per expert
    for j, x_jD in enumerate(torch.split(x_SD, counts_L.tolist())):
        gate, up = (x_jD @ w_gu_L2ID[j].T).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ w_down_LDI[j].T)
    return torch.cat(outs)


_KERNELS = {"grouped_mm": _grouped_mm, "padded_bmm": _padded_bmm, "loop": _loop}


class FusedExperts(nn.Module):
    """E SwiGLU experts stored as two fused 2-D weights.

    gate_up_proj [E*2I, D]: expert e owns rows e*2I .. (e+1)*2I-1, gate rows first, then up.
    down_proj    [E*D, I]:  expert e owns rows e*D .. (e+1)*D-1.
    `orthogonal_blocks` tells Muon how many independent matrices each weight stacks (2E and E).
    The forward views the weights (`expert_weights`) as [L, 2I, D] and [L, D, I] stacks (the
    stored layout stays) and runs `kernel` (one of EXPERT_KERNELS; "auto" by default, see
    `expert_kernel`). Every expert is local (L = E); `models.glm.infra.expert_parallel` swaps in
    the subclass whose `dispatch` and `expert_weights` spread the experts over ranks.
    """

    def __init__(self, config: GLMConfig, kernel: str = "auto") -> None:
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden_size, self.inner_size = E, D, I
        self.gate_up_proj = nn.Parameter(torch.empty(E * 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E * D, I))
        self.orthogonal_blocks = {"gate_up_proj": 2 * E, "down_proj": E}
        self.kernel = kernel

    @property
    def kernel(self) -> str:
        """The expert kernel the forward runs (one of EXPERT_KERNELS)."""
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: str) -> None:
        if kernel not in EXPERT_KERNELS:
            raise ValueError(f"FusedExperts kernel {kernel!r} is not one of {EXPERT_KERNELS}")
        self._kernel = kernel

    def forward(self, x_SD: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
        """Run local expert j on the j-th run of counts_L[j] rows of x_SD (rows grouped by
        expert); counts_L is an integer tensor on x's device, never read on the host by the
        grouped matmul."""
        w_gu, w_down = self.expert_weights()
        D, I = self.hidden_size, self.inner_size
        w_gu_L2ID = w_gu.view(-1, 2 * I, D)
        w_down_LDI = w_down.view(-1, D, I)
        if counts_L.shape != (w_gu_L2ID.shape[0],):
            raise ValueError(
                f"counts_L has shape {tuple(counts_L.shape)}; expected one count per local "
                f"expert, ({w_gu_L2ID.shape[0]},)"
            )
        kernel = self.kernel
        if kernel == "auto":
            kernel = expert_kernel(x_SD, w_gu_L2ID, w_down_LDI)
        return _KERNELS[kernel](x_SD, w_gu_L2ID, w_down_LDI, counts_L)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) of the local experts, in the stored fused layout."""
        return self.gate_up_proj, self.down_proj

    def dispatch(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts' outputs [A, D] for rows sorted by expert (counts_E[e] consecutive rows
        for expert e, every one of the E experts), in the same order: on one device the local
        experts run them directly."""
        return self(x_AD, counts_E)


def routed_experts_forward(
    experts: FusedExperts,
    x_ND: torch.Tensor,
    idx_NK: torch.Tensor,
    w_NK: torch.Tensor,
    num_experts: int,
) -> torch.Tensor:
    """sum_k w[n,k] * Expert_{idx[n,k]}(x[n]) for every token n: the assignments sorted by
    expert go through `experts.dispatch`. Returns [N, D] in x's dtype. Host reads: none of its
    own (those of the kernel and of the dispatch)."""
    N, K = idx_NK.shape
    flat_A = idx_NK.reshape(-1)
    order_A = torch.argsort(flat_A, stable=True)
    token_A = order_A // K  # the token of each expert-sorted assignment
    counts_E = expert_counts(flat_A, num_experts)
    x_AD = x_ND.index_select(0, token_A)
    y_AD = experts.dispatch(x_AD, counts_E)
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


# Data-dependent dispatch (with expert parallelism the split sizes read on the host and uneven
# exchanges) runs eagerly under torch.compile: compiled, it would break the graph and recompile
# for every new set of splits. The rest of the layer (attention, norms, router, shared expert)
# compiles.
_routed = eager(routed_experts_forward)


class MoE(nn.Module):
    """Routed experts (top-k of E, sigmoid router) plus one always-on shared expert."""

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = FusedExperts(config)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        )

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        idx_NK, w_NK = self.gate(x_ND)
        routed_ND = _routed(self.experts, x_ND, idx_NK, w_NK, self.gate.num_experts)
        return (routed_ND + self.shared_experts(x_ND)).view_as(x_BTD)
