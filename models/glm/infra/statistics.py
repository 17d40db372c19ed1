"""The model's training statistics summed over the ranks: the expert loads that drive the router
bias and the per-head largest attention logits that QK-clip reads.

Each rank's model counts and records on its own tokens only (`GLMForCausalLM.expert_loads`,
`GLMForCausalLM.take_local_max_logits`); when a default process group of more than one rank is
initialized, one all-reduce per statistic over it makes every rank see the same figures (and so
apply the same update). Without one the statistics are the local ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.glm.model.model import GLMForCausalLM


def _across_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


@torch.no_grad()
def update_router_bias(model: GLMForCausalLM, rate) -> torch.Tensor:
    """Aux-loss-free balancing: bias += rate * sign(mean_load - load) per MoE layer, from the
    expert loads counted since the last call, summed over the default process group (one
    all-reduce, none without MoE layers); then reset the counts. Returns the loads used,
    float32 [n_moe_layers, E]."""
    loads_LE = model.expert_loads()
    if model.routers() and _across_ranks():
        dist.all_reduce(loads_LE)
    return model.apply_router_bias_update(loads_LE, rate)


@torch.no_grad()
def take_max_logits(model: GLMForCausalLM) -> torch.Tensor:
    """Each layer's per-head largest pre-softmax logit since the last call, float32 [L, N] (-inf
    for a layer that recorded nothing), the maximum over the default process group (one MAX
    all-reduce: every rank saw other data); then reset."""
    logits_LN = model.take_local_max_logits()
    if _across_ranks():
        dist.all_reduce(logits_LN, op=dist.ReduceOp.MAX)
    return logits_LN
