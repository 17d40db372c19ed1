"""Mixture-of-experts block: sigmoid router with a score-correction bias, fused routed experts,
and the shared expert.

Shape legend: N tokens, D hidden, E experts, K experts per token, G expert groups,
I expert inner size, L local experts, S rows for the local experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.glm.config import GLMConfig
from models.glm.expert_parallel import routed_experts_forward
from models.glm.layers import MLP
from models.glm.recompute import is_recomputing


@torch.compiler.disable
def _count_loads(expert_load: torch.Tensor, idx_NK: torch.Tensor) -> None:
    # Eager even inside a compiled layer: were the recomputation flag read by compiled code,
    # the recomputation would run a differently compiled graph whose saved tensors do not
    # line up with the forward's, and activation checkpointing would use the wrong ones.
    if not is_recomputing():  # the counts feed the load-balancing bias: each token once
        expert_load += torch.bincount(idx_NK.reshape(-1), minlength=expert_load.numel())


class Router(nn.Module):
    """Sigmoid top-k router with auxiliary-loss-free load balancing.

    The score-correction bias (a buffer, never trained by backprop) only chooses experts; the
    weights are the bias-free sigmoid scores of the chosen experts, optionally renormalized, times
    routed_scaling_factor. Every forward adds the chosen-expert counts to `expert_load`, which
    `GLMForCausalLM.update_router_bias` consumes.
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


class FusedExperts(nn.Module):
    """E SwiGLU experts stored as two fused 2-D weights.

    gate_up_proj [E*2I, D]: expert e owns rows e*2I .. (e+1)*2I-1, gate rows first, then up.
    down_proj    [E*D, I]:  expert e owns rows e*D .. (e+1)*D-1.
    `orthogonal_blocks` tells Muon how many independent matrices each weight stacks (2E and E).
    Under expert parallelism the weights are DTensors sharded on dim 0 over the EP mesh (whole
    experts per rank); `ep_group` is then the EP process group (set by parallelize).
    """

    def __init__(self, config: GLMConfig) -> None:
        super().__init__()
        E, D, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.hidden_size, self.inner_size = E, D, I
        self.gate_up_proj = nn.Parameter(torch.empty(E * 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E * D, I))
        self.orthogonal_blocks = {"gate_up_proj": 2 * E, "down_proj": E}
        self.ep_group = None

    def forward(self, x_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run local expert j on the j-th run of counts[j] rows of x_SD (rows grouped by expert)."""
        w_gu, w_down = self.gate_up_proj, self.down_proj
        if hasattr(w_gu, "to_local"):  # an EP-sharded DTensor: compute on the local experts
            w_gu, w_down = w_gu.to_local(), w_down.to_local()
        D, I = self.hidden_size, self.inner_size
        w_gu_L2ID = w_gu.view(-1, 2 * I, D)
        w_down_LDI = w_down.view(-1, D, I)
        assert len(counts) == w_gu_L2ID.shape[0], (len(counts), w_gu_L2ID.shape)
        outs = []
        for j, x_jD in enumerate(torch.split(x_SD, counts)):
            gate, up = (x_jD @ w_gu_L2ID[j].T).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ w_down_LDI[j].T)
        return torch.cat(outs)


# Data-dependent dispatch (expert counts read on the host, uneven all-to-alls) runs eagerly
# under torch.compile: compiled, it would break the graph and recompile for every new set of
# counts. The rest of the layer (attention, norms, router, shared expert) compiles.
_routed = torch.compiler.disable(routed_experts_forward, recursive=True)


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
        routed_ND = _routed(
            self.experts, x_ND, idx_NK, w_NK, self.gate.num_experts, self.experts.ep_group
        )
        return (routed_ND + self.shared_experts(x_ND)).view_as(x_BTD)
