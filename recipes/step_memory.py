"""Whole-step per-rank memory estimate of a training step: does this preset fit this mesh?

The estimate reads the rank's real sharded (meta-device) model and optimizer, built with the
recipe's own code on a fake process group of any size, so the shard sizes (EP + FSDP2) and
the optimizer's plans are the ones a real run gets. What it adds up:

- resident: fp32 master parameter shards, optimizer state (Muon momentum, AdamW moments);
- forward/backward peak (at the start of backward, where every activation is still alive):
  activations of all decoder layers and MTP layers (those when train.mtp_loss_weight > 0; an
  MTP layer once per prediction depth it runs) for one micro-batch (or, with activation
  checkpointing, each layer's input plus one recomputed layer), the loss heads (next-token and
  one per MTP depth: what they keep, plus one cross-entropy chunk recomputed in backward,
  never [T, V] logits; checkpointed: the heads' phase or one layer's, the larger one,
  `_checkpointed_peak`), the root's unsharded parameters, two unsharded decoder layers (the
  current one and FSDP2's prefetch), gloo's flat staging copy of an all-gather on CPU, and
  one layer's unsharded gradients before their reduce-scatter;
- optimizer peak: gradient shards plus the optimizer's planned window (`window_peak_bytes`).
The step peak is resident + the larger of the two peaks.

Activation bytes per token are counted op by op from the model code (`recipes.activation_bytes`,
checked against what autograd saves). Under context parallelism (`cp` > 1: `mesh.cp`) a rank's
micro-batch is its T = S / cp tokens of each sequence, and two parts are added
(`recipes.context_memory`): the key side the attention saves for the whole sequence (of every
layer when `keep_gathered` and the layers are not checkpointed, else of one layer: gathered
again in backward, or with the recomputed layer), and one layer's key-side gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.glm import GLMConfig
from muon.batch_cost import window_peak_bytes
from recipes.activation_bytes import (  # noqa: F401 - re-exported: the estimate's terms
    attention_bytes_per_token,
    backward_bytes_per_token,
    head_bytes_per_token,
    indexer_kl_bytes_per_token,
    indexer_layer,
    layer_activation_bytes,
    layer_bytes_per_token,
    loss_head_chunk_bytes,
    mla_bytes_per_token,
    moe_bytes_per_token,
    mtp_input_bytes_per_token,
    norm_bytes_per_token,
)
from recipes.context_memory import LayerRun, LayerShare, cp_choices, layer_share
from recipes.ranks import local_tensor
from recipes.units import GiB


@dataclass
class StepMemory:
    """Per-rank bytes of one training step, by part (see the module docstring)."""

    parts: dict[str, int] = field(default_factory=dict)
    forward_backward: list[str] = field(default_factory=list)  # parts of that peak
    optimizer: list[str] = field(default_factory=list)  # parts of that peak
    resident: list[str] = field(default_factory=list)

    def peak(self, names: list[str]) -> int:
        """Sum of the named parts."""
        return sum(self.parts[n] for n in names)

    @property
    def total(self) -> int:
        """Estimated step peak: resident + the larger of the two phase peaks."""
        return self.peak(self.resident) + max(
            self.peak(self.forward_backward), self.peak(self.optimizer)
        )

    def fits(self, budget_gib: float) -> bool:
        """Whether the step peak as `format` prints it (GiB, 3 decimals) is within the budget."""
        return round(self.total / GiB, 3) <= budget_gib

    def format(self, budget_gib: float | None = None) -> str:
        """A table: one line per part, the phase peaks, the step peak (and the budget)."""
        lines = []
        for phase, names in (
            ("resident", self.resident),
            ("forward/backward", self.forward_backward),
            ("optimizer step", self.optimizer),
        ):
            lines.append(f"  {phase}: {self.peak(names) / GiB:.3f} GiB")
            lines += [f"    {n:<34} {self.parts[n] / GiB:10.3f} GiB" for n in names]
        verdict = ""
        if budget_gib is not None:
            fits = self.fits(budget_gib)
            verdict = f"  {'fits' if fits else 'DOES NOT FIT'} in {budget_gib:g} GiB"
        lines.append(f"  step peak per rank: {self.total / GiB:.3f} GiB{verdict}")
        return "\n".join(lines)


def _local_bytes(params, itemsize: int | None = None) -> int:
    total = 0
    for p in params:
        local = local_tensor(p)
        total += local.numel() * (itemsize or local.element_size())
    return total


def _unsharded_bytes(module: torch.nn.Module, itemsize: int, ep: int) -> int:
    """Bytes of a module's parameters once FSDP2 all-gathers them (experts: the EP shard)."""
    total = 0
    for name, p in module.named_parameters():
        n = p.numel()
        if ".experts." in f".{name}" and ep > 1:
            n //= ep
        size = 4 if name.endswith("gate.weight") else itemsize  # routers stay float32
        total += n * size
    return total


def optimizer_transient_bytes(
    opt, *, ns_itemsize: int, nesterov: bool, max_inflight: int, gloo=False
):
    """The step's planned transient on this rank (`muon.batch_cost.window_peak_bytes`: every
    buffer of the runtime's window, NorMuon's when a group has it); 0 without plans (AdamW)."""
    normuon = any(g.get("normuon") for g in opt.param_groups)
    kw = dict(ns_itemsize=ns_itemsize, nesterov=nesterov, max_inflight=max_inflight, gloo=gloo)
    return window_peak_bytes(getattr(opt, "plans", []), normuon=normuon, **kw)


def decoder_layers(model, mtp: bool = True) -> list[torch.nn.Module]:
    """The decoder layers a training forward runs, in order: the main layers, then one MTP run
    per prediction depth (several on one shared layer: GLM-5's training; none when `mtp` is
    off: train.mtp_loss_weight 0)."""
    mtp_layers = list(model.model.mtp_layers)
    depths = model.config.mtp_depths_resolved if mtp else 0
    return [
        *model.model.layers,
        *(mtp_layers[0 if len(mtp_layers) == 1 else k] for k in range(depths)),
    ]


def layer_runs(model, mtp: bool = True) -> list[LayerRun]:
    """`decoder_layers` as `LayerRun`s: depths >= 2 of one shared MTP layer attend depth 1's
    kept keys (index_share_for_mtp_iteration), running no indexer of their own."""
    config, n = model.config, len(model.model.layers)
    reuse = len(model.model.mtp_layers) == 1 and config.index_share_for_mtp_iteration
    return [
        LayerRun(i, x.is_moe, indexer_layer(config, i) and not (reuse and i > n))
        for i, x in enumerate(decoder_layers(model, mtp))
    ]


def estimate_step_memory(
    model,
    opt,
    *,
    tokens: int,
    ep: int,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    activation_checkpointing: bool,
    ns_itemsize: int,
    nesterov: bool,
    max_inflight: int,
    gloo: bool,
    seq_len: int | None = None,
    mtp: bool = True,
    cp: int = 1,
    keep_gathered: bool = False,
) -> StepMemory:
    """Per-rank memory of one step of `model` (this rank's sharded GLMForCausalLM, on any
    device incl. meta) with optimizer `opt`, for micro-batches of `tokens` tokens per rank
    (sequences of `seq_len`; None: one sequence); `mtp`: whether the MTP layers run and train
    (train.mtp_loss_weight > 0). `cp`: the context-parallel degree (the rank computes
    tokens / cp of them); `keep_gathered`: model.cp_keep_gathered."""
    config: GLMConfig = model.config
    a = torch.finfo(param_dtype).bits // 8
    seq_len = seq_len or tokens
    batch, local = max(1, tokens // seq_len), tokens // cp
    runs = layer_runs(model, mtp)
    shares = [layer_share(config, run, a, ep, batch, seq_len, cp) for run in runs]
    grads = [local * backward_bytes_per_token(config, run.is_moe, a) for run in runs]
    head_chunk = loss_head_chunk_bytes(config, a, local)
    parts = {
        "master parameters (fp32 shards)": _local_bytes(model.parameters()),
        "optimizer state": _state_bytes(opt),
    }
    n_main = len(model.model.layers)
    if activation_checkpointing:
        parts.update(_checkpointed_peak(config, a, local, n_main, shares, grads, head_chunk, cp))
    else:
        keep = keep_gathered if cp > 1 else None
        parts.update(
            _uncheckpointed_peak(config, a, local, n_main, shares, grads, head_chunk, keep)
        )
    parts.update(_fsdp_parts(model, decoder_layers(model, mtp), a, ep, reduce_dtype, gloo))
    trained = [  # no gradient: a frozen indexer, idle MTP layers
        p
        for n, p in model.named_parameters()
        if p.requires_grad and (mtp or not n.startswith("model.mtp_layers."))
    ]
    parts["gradient shards"] = _local_bytes(trained, 4)
    parts["optimizer transient (plans)"] = optimizer_transient_bytes(
        opt, ns_itemsize=ns_itemsize, nesterov=nesterov, max_inflight=max_inflight, gloo=gloo
    )
    resident = ["master parameters (fp32 shards)", "optimizer state"]
    optimizer = ["gradient shards", "optimizer transient (plans)"]
    return StepMemory(
        parts=parts,
        resident=resident,
        forward_backward=[n for n in parts if n not in resident + optimizer],
        optimizer=optimizer,
    )


def _state_bytes(opt) -> int:
    """Optimizer state: Muon's momentum, AdamW's two moments, float32 shards."""
    state = 0
    for g in opt.param_groups:
        copies = 1 if g.get("algorithm") == "muon" else 2
        state += copies * _local_bytes(g["params"], 4)
    return state


def _fsdp_parts(model, layers, a: int, ep: int, reduce_dtype: torch.dtype, gloo: bool) -> dict:
    """FSDP2's unsharded parameters (the root's, two decoder layers: the current one and the
    prefetch), gloo's staging copy, a layer's unsharded gradients and FSDP2's flat
    reduce-scatter input."""
    root = _unsharded_bytes(model.model.embed_tokens, a, ep)
    root += _unsharded_bytes(model.lm_head, a, ep) + _unsharded_bytes(model.model.norm, a, ep)
    layer_full = max((_unsharded_bytes(x, a, ep) for x in layers), default=0)
    reduce_size = torch.finfo(reduce_dtype).bits // 8
    return {
        "root parameters (unsharded)": root,
        "2 decoder layers (unsharded)": 2 * layer_full,
        "all-gather staging (gloo)": layer_full if gloo else 0,
        "layer gradients (unsharded)": layer_full // a * (a + reduce_size),
    }


def _uncheckpointed_peak(config, a, tokens, n_main, shares, grads, head_chunk, keep) -> dict:
    """The activation parts at the start of backward without checkpointing: every layer's
    activations, the loss heads (next-token, one per MTP depth) with one cross-entropy chunk,
    one layer's activation gradients; under context parallelism (`keep` not None) the key
    side of every layer (`keep`) or of the one layer gathered again, and one layer's key-side
    gradients."""
    depths = len(shares) - n_main
    parts = {"activations (all layers)": sum(s.local for s in shares)}
    if keep is not None:
        keys = [s.keys for s in shares]
        if keep:
            parts["gathered key side (all layers)"] = sum(keys)
        else:
            parts["gathered key side (one layer)"] = max(keys, default=0)
    parts["loss head activations"] = tokens * head_bytes_per_token(config, a) * (1 + depths)
    parts["activation gradients (one layer)"] = max(grads, default=0)
    if keep is not None:
        parts["key-side gradients (one layer)"] = max((s.key_grads for s in shares), default=0)
    # One cross-entropy chunk recomputed in backward (the heads run one after another).
    parts["loss head chunk (recomputed)"] = head_chunk
    return parts


def _checkpointed_peak(
    config, a, tokens, n_main, shares: list[LayerShare], grads, head_chunk, cp: int = 1
) -> dict:
    """The activation parts at the forward/backward peak with full checkpointing: each layer's
    input (an MTP layer's norms and eh_proj run outside its checkpoint: kept, not recomputed)
    and the larger phase of the backward: the loss heads (next-token, one per MTP depth) with
    one cross-entropy chunk, which exists while no layer is recomputed; or one recomputed layer
    (its activations less its MTP inputs, with its key side under context parallelism: the
    gather runs again with the layer) with its MLP's activation gradients (`grads[i]`, and its
    key-side gradients) and the heads held then: the deepest MTP depth runs first, depth d
    beside the heads of depths < d (the next-token head's at depth 1), a main layer (the first
    `n_main`) beside none."""
    depths = len(shares) - n_main
    head = tokens * head_bytes_per_token(config, a)
    outside = tokens * mtp_input_bytes_per_token(config, a)
    inputs = tokens * config.hidden_size * a * len(shares) + outside * depths
    held = [0] * n_main + list(range(1, depths + 1))  # heads alive while layer i runs
    recomputed = [s.local - (outside if i >= n_main else 0) for i, s in enumerate(shares)]
    cost = [
        held[i] * head + recomputed[i] + s.keys + grads[i] + s.key_grads
        for i, s in enumerate(shares)
    ]
    layer = max(range(len(shares)), key=cost.__getitem__)
    heads_phase = head * (1 + depths) + head_chunk >= cost[layer]
    rows = [
        ("activations (layer inputs)", inputs, True),
        ("activations (recomputed layer)", 0 if heads_phase else recomputed[layer], True),
        ("gathered key side (recomputed)", 0 if heads_phase else shares[layer].keys, cp > 1),
        ("loss head activations", head * (1 + depths) if heads_phase else head * held[layer], True),
        ("activation gradients (one layer)", 0 if heads_phase else grads[layer], True),
        ("key-side gradients (one layer)", 0 if heads_phase else shares[layer].key_grads, cp > 1),
        ("loss head chunk (recomputed)", head_chunk if heads_phase else 0, True),
    ]
    return {name: n for name, n, shown in rows if shown}


def smallest_fitting_cp(
    model, opt, kw: dict, world_size: int, budget_gib: float
) -> tuple[int, StepMemory] | None:
    """The smallest cp of `recipes.context_memory.cp_choices` (this world, kw's sequences)
    whose step estimate (`estimate_step_memory(model, opt, **kw)` at that cp) fits
    `budget_gib`, with its estimate; None when none does."""
    for cp in cp_choices(world_size, kw.get("seq_len") or kw["tokens"]):
        est = estimate_step_memory(model, opt, **{**kw, "cp": cp})
        if est.fits(budget_gib):
            return cp, est
    return None


def estimate_for_config(cfg, **where) -> StepMemory:
    """The estimate for `cfg` (a composed training config) `where` `estimate_inputs` says."""
    model, opt, kwargs = estimate_inputs(cfg, **where)
    return estimate_step_memory(model, opt, **kwargs)


def estimate_inputs(cfg, *, world_size: int, rank: int = 0, device_type: str = "cuda"):
    """(model, optimizer, keyword arguments) of `estimate_step_memory` for `cfg`, built in
    torch's fake process group (`recipes.build.join_fake_world`): the model on the meta
    device (`recipes.build.planning_model`), parallelized and given its optimizer by the
    recipe's own code. `device_type` picks the `auto` dtypes and whether gloo's staging copy
    counts. Varying `tokens`, `seq_len`, `activation_checkpointing`, `cp`, `keep_gathered`
    needs no rebuild (parameters are sharded over the whole world whatever the cp)."""
    from recipes import build

    build.join_fake_world(world_size, rank)
    param_dtype, reduce_dtype = build.train_dtypes(cfg, torch.device(device_type))
    checkpointing = str(cfg.train.activation_checkpointing) == "full"
    model, _ = build.planning_model(
        build.model_config(cfg),
        ep=cfg.mesh.ep,
        param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reduce_dtype=reduce_dtype,
        activation_checkpointing=checkpointing,
    )
    opt = build.build_optimizer(cfg.optim, model)
    o = cfg.optim  # AdamW has no Newton-Schulz, momentum or batches in flight
    return (
        model,
        opt,
        dict(
            tokens=cfg.data.batch_size * cfg.data.seq_len,
            seq_len=cfg.data.seq_len,
            mtp=float(cfg.train.mtp_loss_weight) > 0,
            ep=cfg.mesh.ep,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            activation_checkpointing=checkpointing,
            ns_itemsize=torch.finfo(getattr(torch, str(o.get("ns_dtype", "float32")))).bits // 8,
            nesterov=bool(o.get("nesterov", False)),
            max_inflight=int(o.get("max_inflight", 1)),
            gloo=device_type == "cpu",
            cp=int(cfg.mesh.cp),
            keep_gathered=bool(cfg.model.get("cp_keep_gathered", False)),
        ),
    )


def compose_train_config(overrides: list[str]):
    """The config `python train.py <overrides>` composes (conf/ next to this package)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir

    import recipes.config  # noqa: F401 - registers the schema the defaults list names

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(str(conf), version_base=None):
        return compose("train", overrides=overrides)
