"""Mesh, model, optimizer and schedule from a validated config (the glue to models/ and muon/).

The model is built on the meta device, parallelized (EP, activation checkpointing, compile,
FSDP2 with the `train.*` dtypes), materialized on the rank's device and initialized from
`train.seed`: every rank draws only its own shard of the same full weights
(models.glm.infra.init), whatever the world size or ep, so a run is reproducible across layouts.
"""

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from models.glm import GLMConfig, GLMForCausalLM
from models.glm.infra.context_parallel import TRAIN_LAYOUT, apply_context_parallel, context_group
from models.glm.infra.init import init_weights
from models.glm.infra.parallelize import build_meshes, parallelize
from recipes.config.glm_config import model_config as model_config  # re-exported
from recipes.units import GiB


def build_model(cfg: DictConfig, config: GLMConfig, device: torch.device) -> GLMForCausalLM:
    """The sharded, initialized model of `config` (the run's `model_config(cfg)`, built once by
    the caller and passed) on this rank, parallelized by `cfg.mesh` and `cfg.train`."""
    with torch.device("meta"):
        model = GLMForCausalLM(config)
    meshes = build_meshes(dist.get_world_size(), cfg.mesh.ep, device.type)
    param_dtype, reduce_dtype = train_dtypes(cfg, device)
    parallelize(
        model,
        meshes,
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=reduce_dtype,
        activation_checkpointing=str(cfg.train.activation_checkpointing) == "full",
        compile_layers=bool(cfg.train.compile),
    )
    if cfg.mesh.cp > 1:
        group = context_group(dist.get_world_size(), cfg.mesh.cp, device.type)
        apply_context_parallel(model, group, TRAIN_LAYOUT, bool(cfg.model.cp_keep_gathered))
    model.to_empty(device=device)
    init_weights(model, cfg.train.seed)
    return model


def join_fake_world(world_size: int, rank: int = 0) -> bool:
    """Join torch's fake process group of `world_size` ranks as `rank`, for planning (its
    collectives do nothing); False when one of that size is joined already. Any other process
    group is an error: the optimizer would measure its links and check its plan over it."""
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() != world_size:
            raise RuntimeError(
                f"planning needs a fake process group of {world_size} ranks; a "
                f"{dist.get_backend()} group of {dist.get_world_size()} ranks exists"
            )
        return False
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    return True


def planning_model(
    config: GLMConfig, *, ep: int, dtype: torch.dtype | None = None, **parallelize_kw
):
    """(model, meshes): this rank's model of `config` on the meta device (no memory),
    parallelized by the real EP + FSDP2 code over the current world (a fake one:
    `join_fake_world`), for the dry-run planner and the whole-step estimate. `dtype` casts the
    parameters (None: float32 masters); `parallelize_kw` go to `parallelize` (the training
    dtypes, activation checkpointing)."""
    with torch.device("meta"):
        model = GLMForCausalLM(config)
        if dtype is not None:
            model = model.to(dtype)
    meshes = build_meshes(dist.get_world_size(), ep, "cpu")
    parallelize(model, meshes, **parallelize_kw)
    return model, meshes


def train_dtypes(cfg: DictConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) of `train.*` on `device`: `auto` is bfloat16 compute on
    CUDA and float32 elsewhere, and float32 reduction everywhere. Parameters stay float32
    (FSDP2's sharded masters, so optimizer state such as Muon momentum is float32 too)."""
    param = str(cfg.train.param_dtype)
    reduce = str(cfg.train.reduce_dtype)
    if param == "auto":
        param = "bfloat16" if device.type == "cuda" else "float32"
    if reduce == "auto":
        reduce = "float32"
    return getattr(torch, param), getattr(torch, reduce)


def build_optimizer(
    o: DictConfig, model: torch.nn.Module, *, expert_aware: bool = True
) -> torch.optim.Optimizer:
    """`o` is the run's `optim` node. `optim.name=muon`: muon.Muon over muon.param_groups;
    `adamw`: AdamW over everything. `expert_aware=False` (the dry-run planner's comparison)
    exchanges fused experts whole."""
    if o.name == "adamw":
        return torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],  # a frozen indexer: no state
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            foreach=False,  # DTensors of several meshes cannot share a foreach kernel
        )
    from muon import Muon, param_groups

    groups = param_groups(
        model,
        router=str(o.router),
        lr=o.lr,
        weight_decay=o.weight_decay,
        adamw_lr=o.adamw_lr,
        adamw_weight_decay=o.adamw_weight_decay,
        adamw_betas=tuple(o.betas),
        adamw_eps=o.eps,
        muon_split=muon_split_on(str(o.muon_split), model),
    )
    return Muon(groups, **muon_options(o), expert_aware=expert_aware)


#: muon.Muon keywords whose `optim.*` key has another name: the AdamW epsilon is `optim.eps`
#: (AdamW's name, shared with optim=adamw), the budget is in GiB
MUON_RENAMED = {"adamw_eps": "eps", "memory_budget": "memory_budget_gib"}
#: muon.Muon keywords without an `optim.*` key (their muon.options defaults apply): the norm
#: floor of Newton-Schulz, and `expert_aware`, which only the planner's comparison turns off
MUON_UNCONFIGURED = ("eps", "expert_aware")


def muon_options(o: DictConfig) -> dict[str, Any]:
    """The keywords of muon.Muon from an `optim=muon` node: each field of muon.options
    .MuonOptions from the key of its name (or of `MUON_RENAMED`'s), as plain values."""
    from muon.options import OPTION_NAMES

    plain = OmegaConf.to_container(o, enum_to_str=True)
    out = {}
    for name in OPTION_NAMES:
        if name not in MUON_UNCONFIGURED:
            out[name] = plain[MUON_RENAMED.get(name, name)]
    out["betas"] = tuple(out["betas"])
    budget = out["memory_budget"]
    out["memory_budget"] = None if budget is None else int(budget * GiB)
    return out


def records_max_logits(cfg: DictConfig) -> bool:
    """Whether training forwards record attention max logits: for `attn/max_logit`
    (`metrics.attn_max_logit`) or because QK-clip needs them (`optim.qk_clip_tau` set)."""
    return bool(cfg.metrics.attn_max_logit) or cfg.optim.qk_clip_tau is not None


def muon_split_on(choice: str, model: torch.nn.Module) -> bool:
    """`optim.muon_split`: on, off, or auto = on for MLA attention (GLM-5 trains it so) and off
    for GQA (docs/attention_muon.md has the measurement behind that default)."""
    if choice == "auto":
        return getattr(getattr(model, "config", None), "attention", "gqa") == "mla"
    return choice == "on"


def lr_lambda(cfg: DictConfig):
    """Multiplier of every group's peak lr at a step: linear warmup, then the decay."""
    steps, warmup = cfg.train.steps, cfg.train.warmup_steps
    floor, schedule = cfg.train.min_lr_ratio, str(cfg.train.schedule)

    def factor(step: int) -> float:
        # LambdaLR calls this with the number of scheduler steps taken so far (0-based).
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if schedule == "constant" or steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        if schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def describe_model(config: GLMConfig) -> str:
    """A one-line summary of the model shape."""
    keys = ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok")
    fields = dataclasses.asdict(config)
    return ", ".join(f"{k}={fields[k]}" for k in keys) + f", vocab={config.vocab_size}"
