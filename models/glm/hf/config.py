"""transformers' config.json <-> our GLMConfig, for both families:

- `glm4_moe` (`Glm4MoeConfig`, GLM-4.5): grouped-query attention, `attention="gqa"`;
- `glm_moe_dsa` (`GlmMoeDsaConfig`, GLM-5): multi-head latent attention with DeepSeek Sparse
  Attention, `attention="mla"` (transformers always builds the indexer, so `index_topk` is set).

A key missing from a config.json means transformers' default for it, not ours. Fields that only
say how we train (`TRAINING_ONLY`: indexer_training, mtp_depths, loss_chunk_tokens) are not in
config.json: an import keeps our default, a comparison with a run ignores them. Every key of a
config.json is either mapped to a field or listed in `HARMLESS` (bookkeeping that does not
change the model); any other key is refused, naming it. So is a value our model cannot compute
(another activation or router scoring, MLP biases, dropout, non-interleaved MLA RoPE, remote
code through `auto_map`, a dense/sparse pattern that is not "k dense layers first"; an unknown
quantization: models/glm/hf/fp8.py), and a config.json without `model_type`.
"""

from __future__ import annotations

import json

import torch

from models.glm.hf.fp8 import parse_quantization
from models.glm.hf.json_types import RENAMED, check_json_types
from models.glm.model.config import GLMConfig, index_share_types

TRAINING_ONLY = ("indexer_training", "mtp_depths", "loss_chunk_tokens", "dsa_impl", "dsa_chunk_mib")

# Keys that do not change what the model computes: transformers' bookkeeping, inference and
# parallelism hints, and values transformers derives itself (head_dim, qk_head_dim under MLA).
HARMLESS = (
    "_name_or_path",
    "architectures",
    "chunk_size_feed_forward",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "id2label",
    "label2id",
    "is_encoder_decoder",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "problem_type",
    "use_cache",
    "output_router_logits",
    "router_aux_loss_coef",
    "ep_size",
    "pretraining_tp",
    "qk_head_dim",
)
# Keys whose value must be one our model computes: key -> (allowed values, why).
_REQUIRED_VALUES = {
    "hidden_act": (("silu",), "our MLPs are SwiGLU"),
    "mlp_bias": ((False,), "our MLPs have no biases"),
    "scoring_func": (("sigmoid",), "the router scores experts with a sigmoid"),
    "topk_method": (("noaux_tc",), "routing is top-k with the aux-loss-free bias"),
    "moe_layer_freq": ((1,), "every layer after the dense ones is a MoE layer"),
    "attention_dropout": ((0, 0.0), "the model has no dropout"),
}
# Read by config_from_hf (rope and aliases included) or checked below.
_MAPPED = (
    "model_type",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "num_local_experts",
    "num_experts",
    "first_k_dense_replace",
    "head_dim",
    "indexer_types",
    "index_topk_pattern",
    "mlp_layer_types",
    "layer_types",
    "rope_interleave",
    "indexer_rope_interleave",
    "quantization_config",
)

# Defaults common to both transformers configs (where they agree).
_COMMON = dict(
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.02,
    attention_bias=False,
)
# transformers' Glm4MoeConfig defaults: what a glm4_moe config.json without the key means.
_GLM4_MOE_DEFAULTS = dict(
    _COMMON,
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    partial_rotary_factor=0.5,
    use_qk_norm=False,
    n_routed_experts=128,
    num_experts_per_tok=8,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    max_position_embeddings=131072,
    num_nextn_predict_layers=1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
# transformers' GlmMoeDsaConfig defaults (the public GLM-5 shapes). It declares no MTP field:
# a config.json without `num_nextn_predict_layers` has no MTP layer.
_GLM_MOE_DSA_DEFAULTS = dict(
    _COMMON,
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=78,
    num_attention_heads=64,
    num_key_value_heads=64,
    n_routed_experts=256,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    first_k_dense_replace=3,
    max_position_embeddings=202752,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=32,
    num_nextn_predict_layers=0,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=None,
)
_DEFAULT_THETA = 10000.0
_MLA_KEYS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
)
_MODEL_TYPES = ("glm4_moe", "glm_moe_dsa")


def _rope_parameters(c: GLMConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    if c.attention == "gqa":
        rope["partial_rotary_factor"] = c.partial_rotary_factor
    return rope


def config_to_hf(config: GLMConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json dict of `config`: a Glm4MoeConfig ("gqa") or a GlmMoeDsaConfig ("mla";
    it needs the sparse attention: transformers has no dense-MLA GLM)."""
    c = config
    out = {
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "rope_parameters": _rope_parameters(c),
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": c.n_shared_experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_group": c.n_group,
        "topk_group": c.topk_group,
        "norm_topk_prob": c.norm_topk_prob,
        "routed_scaling_factor": c.routed_scaling_factor,
        "first_k_dense_replace": c.n_dense_layers,
        "rms_norm_eps": c.rms_norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "hidden_act": "silu",
        "initializer_range": c.initializer_range,
        "max_position_embeddings": c.max_position_embeddings,
        "num_nextn_predict_layers": c.num_mtp_layers,
        "output_router_logits": False,
        "use_cache": True,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }
    if c.attention == "gqa":
        out.update(
            architectures=["Glm4MoeForCausalLM"],
            model_type="glm4_moe",
            partial_rotary_factor=c.partial_rotary_factor,
            rope_theta=c.rope_theta,
            use_qk_norm=c.use_qk_norm,
        )
        if c.head_dim is not None:  # absent means hidden_size // num_attention_heads, as in HF
            out["head_dim"] = c.head_dim
        return out
    if not c.uses_dsa:
        raise ValueError(
            "GLMConfig.index_topk is None (dense multi-head latent attention): transformers' "
            "glm_moe_dsa always runs the sparse-attention indexer, so this model has no "
            "transformers layout; set index_topk (with index_n_heads, index_head_dim)"
        )
    n = c.num_hidden_layers
    types = [c.layer_indexer_type(i) for i in range(n)]
    freq, offset = _index_share_keys(c, types)
    out.update(
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        **{k: getattr(c, k) for k in _MLA_KEYS},
        head_dim=c.qk_rope_head_dim,  # transformers sets it to the rotary width
        qk_head_dim=c.qk_nope_head_dim + c.qk_rope_head_dim,
        indexer_types=types,
        # What xtuner's Glm52MoEConfig.from_hf reads besides (it fails without them).
        index_topk_freq=freq,
        index_skip_topk_offset=offset,
        index_topk_pattern=None,  # indexer_types, read first, carries the schedule
        index_share_for_mtp_iteration=c.index_share_for_mtp_iteration,
        layer_types=["indexed_attention"] * n,
        mlp_layer_types=["dense"] * c.n_dense_layers + ["sparse"] * (n - c.n_dense_layers),
        mlp_bias=False,
        moe_layer_freq=1,
        rope_interleave=True,
        indexer_rope_interleave=True,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        ep_size=1,
        pretraining_tp=1,
    )
    return out


def _index_share_keys(c: GLMConfig, types: list[str]) -> tuple[int | None, int | None]:
    """(index_topk_freq, index_skip_topk_offset) for config.json: the config's own, else
    `schedule_of(types)`."""
    if c.index_topk_freq is not None:
        return c.index_topk_freq, c.index_skip_topk_offset
    return schedule_of(types)


def schedule_of(types: list[str]) -> tuple[int | None, int | None]:
    """The first IndexShare (freq, offset) whose schedule is `types` (transformers' defaults
    1, 2 when every layer is full), else (None, None): no schedule gives them, and
    indexer_types alone says what runs. An import keeps a config.json's own pair only when it
    is not this one, so a round trip writes back what it read."""
    if "shared" not in types:
        return 1, 2
    n = len(types)
    for freq in range(2, n + 1):
        for offset in range(n + 1):
            if index_share_types(n, freq, offset) == types:
                return freq, offset
    return None, None


def _indexer_types(hf: dict, n: int) -> list[str]:
    """`indexer_types`, or the pattern transformers derives without it (index_topk_pattern,
    else IndexShare's schedule: `index_share_types` of index_topk_freq and
    index_skip_topk_offset)."""
    if hf.get("indexer_types") is not None:
        return [str(t) for t in hf["indexer_types"]]
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return [letters[p] for p in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = hf.get("index_topk_freq"), hf.get("index_skip_topk_offset")
    return index_share_types(n, 1 if freq is None else freq, 2 if offset is None else offset)


def _refuse_unsupported(hf: dict, model_type: str) -> None:
    known = {*GLMConfig.__dataclass_fields__, *HARMLESS, *_REQUIRED_VALUES, *_MAPPED}
    known -= {*TRAINING_ONLY, "attention", "n_dense_layers", "indexer_training"}
    unknown = sorted(set(hf) - known - {"auto_map"})
    if unknown:
        raise ValueError(
            f"config.json has keys this importer does not know: {unknown}; they may change the "
            f"model, so it refuses them (known: the GLMConfig fields, {list(_MAPPED)}, "
            f"{list(_REQUIRED_VALUES)} and the harmless {list(HARMLESS)})"
        )
    if "auto_map" in hf:
        raise ValueError(
            f"config.json auto_map ({hf['auto_map']!r}) names remote modeling code; the "
            "model it builds is not the transformers GLM this importer reads"
        )
    for key, (allowed, why) in _REQUIRED_VALUES.items():
        if key in hf and hf[key] not in allowed:
            want = repr(allowed[0]) if isinstance(allowed[0], str) else json.dumps(allowed[0])
            raise ValueError(f"config.json {key} must be {want} ({why}), got {hf[key]!r}")
    if model_type == "glm_moe_dsa":
        for key in ("rope_interleave", "indexer_rope_interleave"):
            if hf.get(key, True) is not True:
                raise ValueError(
                    f"config.json {key} must be true: GLM-5's attention and indexer rotate "
                    f"interleaved pairs, got {hf[key]!r}"
                )
        kinds = hf.get("layer_types")
        if kinds is not None and set(kinds) - {"indexed_attention"}:
            raise ValueError(
                f"config.json layer_types {sorted(set(kinds))}: only 'indexed_attention' layers"
            )
    else:
        for key in ("rope_interleave", "indexer_rope_interleave", "layer_types"):
            if hf.get(key):
                raise ValueError(f"config.json {key} ({hf[key]!r}) is not a glm4_moe key")
    parse_quantization(hf, "config.json")  # an unknown format is refused, naming it


def config_from_hf(hf: dict) -> GLMConfig:
    """A GLMConfig from a glm4_moe or glm_moe_dsa config.json dict (missing keys take
    transformers' defaults of that model type)."""
    if "model_type" not in hf:
        raise ValueError(
            f"config.json has no model_type; it must be one of {_MODEL_TYPES} (glm4_moe: "
            "GLM-4.5, glm_moe_dsa: GLM-5)"
        )
    model_type = hf["model_type"]
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"config.json model_type must be one of {_MODEL_TYPES}, got {model_type!r}"
        )
    check_json_types(hf)
    _refuse_unsupported(hf, model_type)
    dsa = model_type == "glm_moe_dsa"
    defaults = _GLM_MOE_DSA_DEFAULTS if dsa else _GLM4_MOE_DEFAULTS
    hf = dict(hf)
    # transformers 5 keeps theta (and glm4_moe's partial factor) in rope_parameters; older
    # config.json files have them as top-level keys, and scaling as `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    hf["rope_theta"] = rope.pop("rope_theta", hf.get("rope_theta", _DEFAULT_THETA))
    if "partial_rotary_factor" in rope:
        hf["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    if "num_mtp_layers" in hf and "num_nextn_predict_layers" not in hf:
        hf["num_nextn_predict_layers"] = hf["num_mtp_layers"]
    for alias in ("num_local_experts", "num_experts"):
        if alias in hf and "n_routed_experts" not in hf:
            hf["n_routed_experts"] = hf[alias]
    kwargs = {}
    for name in GLMConfig.__dataclass_fields__:
        key = RENAMED.get(name, name)
        if name in TRAINING_ONLY or name in ("attention", "rope_scaling", "indexer_types"):
            continue
        if key in hf:
            kwargs[name] = hf[key]
        elif key in defaults:
            kwargs[name] = defaults[key]
    kwargs["rope_scaling"] = scaling
    if not dsa:
        kwargs.setdefault("head_dim", None)
        return GLMConfig(**kwargs)
    n = kwargs["num_hidden_layers"]
    kinds = hf.get("mlp_layer_types")
    if kinds is not None:
        dense = kinds.count("dense")
        if list(kinds) != ["dense"] * dense + ["sparse"] * (n - dense):
            raise ValueError(
                f"config.json mlp_layer_types {kinds}: only the first layers may be 'dense' "
                f"(then 'sparse', {n} entries)"
            )
        kwargs["n_dense_layers"] = dense
    for key, allowed, why in (
        ("partial_rotary_factor", 1.0, "the rotary channels are the qk_rope_head_dim slice"),
        ("use_qk_norm", False, "GLM-5 normalizes its latents instead"),
    ):
        if kwargs.get(key, allowed) != allowed:
            raise ValueError(
                f"config.json {key} must be {json.dumps(allowed)} for glm_moe_dsa ({why}), "
                f"got {kwargs[key]!r}"
            )
    types = _indexer_types(hf, n)
    if (kwargs.get("index_topk_freq"), kwargs.get("index_skip_topk_offset")) in (
        (None, None),
        schedule_of(types),
    ):  # nothing indexer_types does not say: the config does not carry them
        kwargs.update(index_topk_freq=None, index_skip_topk_offset=None)
    kwargs.update(
        attention="mla",
        head_dim=None,  # transformers' head_dim is the rotary width, qk_rope_head_dim
        partial_rotary_factor=1.0,
        use_qk_norm=False,
        indexer_types=canonical_indexer_types(types),
    )
    return GLMConfig(**kwargs)


def canonical_indexer_types(types: list[str] | None) -> list[str] | None:
    """None for "every layer runs its own indexer" (GLMConfig's default), else `types`: the
    one spelling configs are compared in."""
    return None if types is None or all(t == "full" for t in types) else list(types)
