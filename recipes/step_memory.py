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

Activation bytes per token are counted op by op from the model code (what autograd saves:
`tests/unit/test_step_memory.py` checks them against `saved_tensors_hooks` on real layers,
GQA and MLA + DSA under every `dsa_impl`, frozen and KL-trained indexer, MTP). DSA's sparse
paths keep O(index_topk) bytes per token (the kept keys' positions, the KL's kept-key terms);
only the masked reference grows with the sequence (SDPA keeps the [T, S] mask).
Tokens are assumed evenly routed (each rank's experts receive N*K rows on average).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from models.glm import GLMConfig
from muon.batch_cost import window_peak_bytes
from recipes.ranks import local_tensor
from recipes.units import GiB


def attention_bytes_per_token(config: GLMConfig, a: int, seq_len: int) -> int:
    """Saved by input norm + attention of one layer, per token; `a` = compute itemsize."""
    if config.attention == "mla":
        return mla_bytes_per_token(config, a, seq_len)
    D, hd = config.hidden_size, config.head_dim_resolved
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    total = norm_bytes_per_token(D, a) + D * a  # norm; its output, saved by q/k/v
    if config.use_qk_norm:
        total += (nh + nkv) * (hd * (4 + a) + 4)  # per-head norms of q and k
    # SDPA (flash kernels) saves q, the head-repeated k and v, its output and the
    # log-sum-exp; the output's transpose-reshape for o_proj is a view of it.
    total += 4 * nh * hd * a + nh * 4
    return total


def mla_bytes_per_token(config: GLMConfig, a: int, seq_len: int) -> int:
    """Multi-head latent attention (models/glm/model/mla.py), per token: the input norm and its
    output, the query and key/value latents with their norms, then by `dsa_impl`:
    - dense MLA and "masked": kv_b_proj's input, SDPA's q, k (the concatenated nope + rope
      heads), the kv_b output v is a view of, its output and log-sum-exp, and under DSA with
      seq_len > index_topk the sparse mask SDPA keeps in the compute dtype ([T, S]: S per
      token). Counts the fused kernels (the GLM-5 shapes have equal q/k and v widths; CPU
      runs with unequal widths fall back to the math kernel, which keeps [T, S] scores);
    - "per_head": the same without the mask, plus the kept keys' int64 positions (K);
    - "latent": the q_b output q_nope is a view of (read by kv_b_proj's key rows), the latent
      query [N, L + R] and key [L + R], the kept keys' positions, the latent output [N, L]
      and log-sum-exp, and o_proj's input (nothing of size S: the gathered keys are
      recomputed in backward). A "shared" layer counts its kept keys too (a per-layer view
      of one [B, T, K] tensor: an overestimate of K * 8 bytes per token and shared layer)."""
    D, N = config.hidden_size, config.num_attention_heads
    P, R, V, L = (
        config.qk_nope_head_dim,
        config.qk_rope_head_dim,
        config.v_head_dim,
        config.kv_lora_rank,
    )
    total = norm_bytes_per_token(D, a) + D * a
    if config.q_lora_rank is not None:
        total += norm_bytes_per_token(config.q_lora_rank, a) + config.q_lora_rank * a
    total += norm_bytes_per_token(L, a)
    if a == 4:  # the latent norm's float32 input is then a view of the whole kv_a output
        total += R * 4
    impl = config.dsa_impl if config.uses_dsa else "masked"
    if impl == "latent":
        kept = min(config.index_topk, seq_len) * 8
        return (
            total + N * (P + R) * a + (N + 1) * (L + R) * a + kept + N * L * a + N * 4 + N * V * a
        )
    total += L * a + 2 * N * (P + R) * a + N * (P + V) * a + N * V * a + N * 4
    if impl == "per_head":
        return total + min(config.index_topk, seq_len) * 8
    if config.uses_dsa and seq_len > config.index_topk:
        total += seq_len * a
    return total


def indexer_kl_bytes_per_token(config: GLMConfig, a: int, seq_len: int) -> int:
    """What a trained ("kl") indexer of a "full" layer adds, per token: its key norm (input,
    mean, rstd), the float32 scaled query, key and head weights the kept keys' scores are
    recomputed from, and the KL's log-softmax, target and two masks over the K kept keys
    (plus their int64 positions under "masked", whose attention keeps a mask instead). A
    frozen indexer runs under no_grad and saves nothing. Nothing of size S: the all-pairs
    scores are reduced to the top-k chunk by chunk under no_grad."""
    C, M, K = config.index_head_dim, config.index_n_heads, min(config.index_topk, seq_len)
    total = C * a + 2 * a + C * 4 + M * C * 4 + M * 4 + 2 * K + 2 * K * 4
    return total + (K * 8 if config.dsa_impl == "masked" else 0)


def _kl_layer(config: GLMConfig, layer: int) -> bool:
    return (
        config.uses_dsa
        and config.indexer_training == "kl"
        and config.layer_indexer_type(layer) == "full"
    )


def norm_bytes_per_token(dim: int, a: int) -> int:
    """RMSNorm: the float32 input, the normalized value in the compute dtype, the rsqrt."""
    return dim * 4 + dim * a + 4


def mlp_bytes_per_token(inner: int, a: int) -> int:
    """SwiGLU: gate and up outputs, silu(gate), their product (the input is counted by the
    norm that produced it)."""
    return 4 * inner * a


def moe_bytes_per_token(config: GLMConfig, a: int, ep: int) -> int:
    """Router, routed experts (K rows per token, evenly routed) and shared expert."""
    D, E, K = config.hidden_size, config.n_routed_experts, config.num_experts_per_tok
    I = config.moe_intermediate_size
    router = E * 4 + K * 8 + K * 4 + 4  # sigmoid scores, chosen ids, weights and their sum
    if a != 4:
        router += D * 4  # the float32 copy of the input the router's linear saves
    # Dispatch indices (token of each assignment, sort order), the routing weights; with EP the
    # permutation into local-expert order and back.
    routed = K * (8 + 8 + 4) + (K * 16 if ep > 1 else 0)
    # Per row: the gathered input, gate+up output, silu, product; then the expert output the
    # weighted sum saves (its weighted rows are not kept: `_Combine` of models/glm/model/moe.py).
    routed += K * (2 * D + 4 * I) * a
    shared = mlp_bytes_per_token(I * config.n_shared_experts, a)
    return router + routed + shared


def layer_bytes_per_token(
    config: GLMConfig, is_moe: bool, a: int, ep: int, *, seq_len: int = 1, layer: int = 0
) -> int:
    """Activation bytes decoder layer `layer` keeps for backward, per token (`seq_len` matters
    to DSA's masks and a trained indexer only)."""
    D = config.hidden_size
    total = attention_bytes_per_token(config, a, seq_len) + norm_bytes_per_token(D, a) + D * a
    if _kl_layer(config, layer):
        total += indexer_kl_bytes_per_token(config, a, seq_len)
    if is_moe:
        return total + moe_bytes_per_token(config, a, ep)
    return total + mlp_bytes_per_token(config.intermediate_size, a)


def layer_activation_bytes(
    config: GLMConfig, layer: int, is_moe: bool, a: int, ep: int, batch: int, seq_len: int
) -> int:
    """Activation bytes of decoder layer `layer` (an MTP layer when >= num_hidden_layers) for
    a micro-batch of `batch` sequences of `seq_len` tokens."""
    tokens = batch * seq_len
    total = tokens * layer_bytes_per_token(config, is_moe, a, ep, seq_len=seq_len, layer=layer)
    if layer >= config.num_hidden_layers:
        total += tokens * mtp_input_bytes_per_token(config, a)
    if is_moe:  # the grouped expert GEMM's int32 offsets, one per local expert
        total += 4 * (config.n_routed_experts // ep)
    return total


def backward_bytes_per_token(config: GLMConfig, is_moe: bool, a: int) -> int:
    """Activation gradients a layer's MLP backward holds at once, per token: of its output and
    input ([rows, D] each), of gate+up and of their product ([rows, 2I], [rows, I]); K rows a
    token through routed experts (measured: small and mla_tiny steps within 2%)."""
    D = config.hidden_size
    if is_moe:
        return config.num_experts_per_tok * (2 * D + 3 * config.moe_intermediate_size) * a
    return (2 * D + 3 * config.intermediate_size) * a


def mtp_input_bytes_per_token(config: GLMConfig, a: int) -> int:
    """An MTP layer before its decoder block: enorm and hnorm and their concatenation (saved
    by eh_proj); its loss head is counted as the model's (`head_bytes_per_token`)."""
    D = config.hidden_size
    return 2 * norm_bytes_per_token(D, a) + 2 * D * a


def head_bytes_per_token(config: GLMConfig, a: int) -> int:
    """A loss head, per token, kept for backward: the final norm, its output (the checkpointed
    input of the cross-entropy chunks), the target and the token ids. The [T, V] logits are
    never kept: `loss_head_chunk_bytes`."""
    D = config.hidden_size
    return norm_bytes_per_token(D, a) + D * a + 8 + 8


def loss_head_chunk_bytes(config: GLMConfig, a: int, tokens: int) -> int:
    """The loss head's transient: one chunk of `loss_chunk_tokens` tokens (at most `tokens`;
    models/glm/model/model.py `chunked_cross_entropy`), at its peak the chunk's [chunk, V] logits in
    the compute dtype and in float32 (forward, and again in backward, where the float32 copy
    becomes the gradient in place and is cast back to the compute dtype): (a + 4) bytes per
    logit, 4 in float32 compute (no copy); below float32 also the backward's float32 sum of
    the weight's gradient over the chunks ([V, D], cast to the compute dtype once at the
    end, when the chunk is gone)."""
    c = min(config.loss_chunk_tokens, tokens)
    chunk = c * config.vocab_size * (4 + (a if a < 4 else 0))
    return chunk + (4 * config.vocab_size * config.hidden_size if a < 4 else 0)


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
) -> StepMemory:
    """Per-rank memory of one step of `model` (this rank's sharded GLMForCausalLM, on any
    device incl. meta) with optimizer `opt`, for micro-batches of `tokens` tokens per rank
    (sequences of `seq_len`; None: one sequence); `mtp`: whether the MTP layers run and train
    (train.mtp_loss_weight > 0)."""
    config: GLMConfig = model.config
    a = torch.finfo(param_dtype).bits // 8
    seq_len = seq_len or tokens
    batch = max(1, tokens // seq_len)
    # One MTP run per prediction depth (several on one shared layer: GLM-5's training); none
    # with mtp_loss_weight 0.
    mtp_layers = list(model.model.mtp_layers)
    depths = config.mtp_depths_resolved if mtp else 0
    mtp_layers = [mtp_layers[0 if len(mtp_layers) == 1 else k] for k in range(depths)]
    layers = [*model.model.layers, *mtp_layers]
    per_layer = [
        layer_activation_bytes(config, i, x.is_moe, a, ep, batch, seq_len)
        for i, x in enumerate(layers)
    ]
    # Depths >= 2 of one shared MTP layer attend depth 1's kept keys: no indexer, no KL there.
    reuse = len(model.model.mtp_layers) == 1 and config.index_share_for_mtp_iteration
    if reuse and _kl_layer(config, config.num_hidden_layers):
        kl_bytes = tokens * indexer_kl_bytes_per_token(config, a, seq_len)
        for i in range(len(model.model.layers) + 1, len(layers)):
            per_layer[i] -= kl_bytes
    parts: dict[str, int] = {}
    trained = [  # no gradient: a frozen indexer, idle MTP layers
        p
        for n, p in model.named_parameters()
        if p.requires_grad and (mtp or not n.startswith("model.mtp_layers."))
    ]
    parts["master parameters (fp32 shards)"] = _local_bytes(model.parameters())
    state = 0
    for g in opt.param_groups:
        copies = 1 if g.get("algorithm") == "muon" else 2
        state += copies * _local_bytes(g["params"], 4)
    parts["optimizer state"] = state
    head_chunk = loss_head_chunk_bytes(config, a, tokens)
    grads = [tokens * backward_bytes_per_token(config, x.is_moe, a) for x in layers]
    if activation_checkpointing:
        n_main = len(model.model.layers)
        parts.update(_checkpointed_peak(config, a, tokens, n_main, per_layer, grads, head_chunk))
    else:
        parts["activations (all layers)"] = sum(per_layer)
        parts["loss head activations"] = tokens * head_bytes_per_token(config, a) * (1 + depths)
        parts["activation gradients (one layer)"] = max(grads, default=0)
        # One cross-entropy chunk recomputed in backward (the heads run one after another).
        parts["loss head chunk (recomputed)"] = head_chunk
    root = _unsharded_bytes(model.model.embed_tokens, a, ep)
    root += _unsharded_bytes(model.lm_head, a, ep) + _unsharded_bytes(model.model.norm, a, ep)
    parts["root parameters (unsharded)"] = root
    layer_full = max((_unsharded_bytes(x, a, ep) for x in layers), default=0)
    parts["2 decoder layers (unsharded)"] = 2 * layer_full
    parts["all-gather staging (gloo)"] = layer_full if gloo else 0
    # A layer's unsharded gradients (compute dtype) and FSDP2's flat reduce-scatter input.
    reduce_size = torch.finfo(reduce_dtype).bits // 8
    parts["layer gradients (unsharded)"] = layer_full // a * (a + reduce_size)
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


def _checkpointed_peak(config, a, tokens, n_main, per_layer, grads, head_chunk) -> dict:
    """The activation parts at the forward/backward peak with full checkpointing: each layer's
    input (an MTP layer's norms and eh_proj run outside its checkpoint: kept, not recomputed)
    and the larger phase of the backward: the loss heads (next-token, one per MTP depth) with
    one cross-entropy chunk, which exists while no layer is recomputed; or one recomputed layer
    (`per_layer[i]` less its MTP inputs) with its MLP's activation gradients (`grads[i]`) and
    the heads held then: the deepest MTP depth runs first, depth d beside the heads of depths
    < d (the next-token head's at depth 1), a main layer (the first `n_main`) beside none."""
    depths = len(per_layer) - n_main
    head = tokens * head_bytes_per_token(config, a)
    outside = tokens * mtp_input_bytes_per_token(config, a)
    inputs = tokens * config.hidden_size * a * len(per_layer) + outside * depths
    held = [0] * n_main + list(range(1, depths + 1))  # heads alive while layer i runs
    recomputed = [x - (outside if i >= n_main else 0) for i, x in enumerate(per_layer)]
    layer = max(range(len(per_layer)), key=lambda i: held[i] * head + recomputed[i] + grads[i])
    in_layer = held[layer] * head + recomputed[layer] + grads[layer]
    heads_phase = head * (1 + depths) + head_chunk >= in_layer
    return {
        "activations (layer inputs)": inputs,
        "activations (recomputed layer)": 0 if heads_phase else recomputed[layer],
        "loss head activations": head * (1 + depths) if heads_phase else head * held[layer],
        "activation gradients (one layer)": 0 if heads_phase else grads[layer],
        "loss head chunk (recomputed)": head_chunk if heads_phase else 0,
    }


def estimate_for_config(cfg, **where) -> StepMemory:
    """The estimate for `cfg` (a composed training config) `where` `estimate_inputs` says."""
    model, opt, kwargs = estimate_inputs(cfg, **where)
    return estimate_step_memory(model, opt, **kwargs)


def estimate_inputs(cfg, *, world_size: int, rank: int = 0, device_type: str = "cuda"):
    """(model, optimizer, keyword arguments) of `estimate_step_memory` for `cfg`, built in
    torch's fake process group (`recipes.build.join_fake_world`): the model on the meta
    device (`recipes.build.planning_model`), parallelized and given its optimizer by the
    recipe's own code. `device_type` picks the `auto` dtypes and whether gloo's staging copy
    counts. Varying `tokens`, `seq_len`, `activation_checkpointing` needs no rebuild."""
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
