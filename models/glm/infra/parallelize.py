"""Apply expert parallelism (EP) and FSDP2 to a single-device `GLMForCausalLM`.

Meshes (`build_meshes`): every non-expert parameter is fully sharded over all ranks on the 1-D
mesh `dense` (dim "fsdp"); the routed experts live on the 2-D mesh `expert` with dims
("efsdp", "ep"), ep innermost, efsdp = world_size // ep. Each EP rank owns E/ep whole experts
(Shard(0) of the fused weights over "ep"), and FSDP2 shards those again over "efsdp", which gives
FSDP2's strided layout `(_StridedShard(0), Shard(0))` on the 2-D mesh.

Gradient convention: `model.loss` is a mean over a rank's local tokens, and the distributed
gradient is that of the mean loss over the global batch (equal token counts per rank). FSDP2's
default reduce-scatter averages over its mesh, which is right for dense parameters (W ranks).
An expert's gradient, however, already sums the contributions of the tokens of all `ep` ranks of
its EP group (they arrive through the all-to-all's backward), so averaging over the efsdp ranks
only would leave it `ep` times too large. The expert FSDP modules therefore divide by the world
size W instead (`set_gradient_divide_factor(W)`), with sum-only reductions
(`set_force_sum_reduction_for_comms(True)`), because the pre-multiplied sum that a custom factor
otherwise uses is not available on gloo. With efsdp == 1 there is no expert collective: the
division by W is then FSDP2's all-reduce hook, since its own factor would be applied twice
for a reduce dtype other than float32 / bfloat16 (float64, float16) and under force-sum.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.glm.infra.expert_parallel import shard_experts
from models.glm.model.config import GLMConfig
from models.glm.model.model import GLMForCausalLM


@dataclass
class GLMMeshes:
    """The device meshes of one world: `dense` ("fsdp",) of size W and `expert` ("efsdp", "ep")."""

    dense: DeviceMesh
    expert: DeviceMesh

    @property
    def ep(self) -> int:
        """Expert-parallel degree."""
        return self.expert["ep"].size()

    @property
    def efsdp(self) -> int:
        """FSDP degree of the experts (world_size // ep)."""
        return self.expert["efsdp"].size()

    @property
    def world_size(self) -> int:
        """Ranks in the world."""
        return self.dense.size()


def _divide_(grad: torch.Tensor, by: float) -> None:
    grad.div_(by)


def build_meshes(world_size: int, ep: int, device_type: str) -> GLMMeshes:
    """Meshes for `world_size` ranks with expert-parallel degree `ep` (must divide world_size)
    on `device_type` ("cpu", "cuda"). Needs the default process group to be initialized."""
    if ep < 1 or world_size % ep:
        raise ValueError(f"ep ({ep}) must be a positive divisor of world_size ({world_size})")
    dense = init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    expert = init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return GLMMeshes(dense=dense, expert=expert)


def check_layout(config: GLMConfig, *, world_size: int, ep: int) -> None:
    """Raise ValueError, naming the field, when `config` cannot be sharded over `world_size`
    ranks with expert-parallel degree `ep`. Needs no process group and no model."""
    if ep < 1 or world_size % ep:
        raise ValueError(f"ep ({ep}) must be a positive divisor of world_size ({world_size})")
    E = config.n_routed_experts
    if E % ep:
        raise ValueError(
            f"n_routed_experts ({E}) must be divisible by ep ({ep}); allowed ep: "
            f"{[d for d in range(1, E + 1) if E % d == 0 and world_size % d == 0]}"
        )


def parallelize(
    model: GLMForCausalLM,
    meshes: GLMMeshes,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    *,
    activation_checkpointing: bool = False,
    compile_layers: bool = False,
) -> GLMForCausalLM:
    """Shard `model` in place (and return it), per decoder layer in the order EP, activation
    checkpointing, compile, FSDP2: EP for the routed experts; `activation_checkpointing`
    recomputes each decoder layer in backward; `compile_layers` compiles each decoder layer's
    computation (`DecoderLayer.compile_block`: names unchanged, the checkpoint and FSDP2's
    hooks around it stay eager); then FSDP2 per expert block
    (efsdp mesh), per decoder layer and at the root (dense mesh). `param_dtype` /
    `reduce_dtype` set FSDP2 mixed precision over the float32 sharded parameters; with a
    `param_dtype` the routers keep float32 parameters (their own FSDP unit), as GLM checkpoints
    keep `gate.weight` in float32, and so does a DSA indexer's `weights_proj` (GLM-5 keeps it
    float32). The MTP layers are treated like every other decoder layer. The last layer (the
    first of backward) keeps its parameters unsharded from forward to backward."""
    ep, W = meshes.ep, meshes.world_size
    check_layout(model.config, world_size=W, ep=ep)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    router_mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    ep_mesh, efsdp_mesh = meshes.expert["ep"], meshes.expert["efsdp"]

    layers = [*model.model.layers, *model.model.mtp_layers]
    for layer in layers:
        # The layer a training forward runs last is the first that backward runs: resharding
        # its parameters after forward would only all-gather them again at once, so it keeps
        # them (one layer's unsharded parameters, from its forward to its backward).
        reshard = layer is not layers[-1]
        experts = layer.mlp.experts if layer.is_moe else None
        if experts is not None and ep > 1:
            shard_experts(experts, ep_mesh)
        layer.checkpoint_activations = activation_checkpointing
        if compile_layers:
            layer.compile_block()
        if experts is not None:
            fully_shard(experts, mesh=efsdp_mesh, mp_policy=mp, reshard_after_forward=reshard)
            if meshes.efsdp > 1:
                experts.set_gradient_divide_factor(float(W))
                experts.set_force_sum_reduction_for_comms(True)
            else:
                # No expert collective: FSDP2 (torch 2.13) divides a custom factor while
                # copying and again after it for reduce dtypes other than float32 / bfloat16
                # (and a second time under force-sum), so the division by W is a hook of its own
                experts.set_all_reduce_hook(functools.partial(_divide_, by=float(W)))
            if param_dtype is not None:
                fully_shard(layer.mlp.gate, mesh=meshes.dense, mp_policy=router_mp)
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None and param_dtype is not None:
            fully_shard(indexer.weights_proj, mesh=meshes.dense, mp_policy=router_mp)
        fully_shard(layer, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=meshes.dense, mp_policy=mp)
    return model
