"""transformers' `Glm4MoeConfig` (config.json of a Glm4Moe directory) <-> our GLMConfig.

A key missing from a config.json means transformers' default for it, not ours.
"""

from __future__ import annotations

import torch

from models.glm.config import GLMConfig

# transformers' Glm4MoeConfig defaults: what a config.json without the key means.
_HF_DEFAULTS = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    partial_rotary_factor=0.5,
    rope_theta=10000.0,
    attention_bias=False,
    use_qk_norm=False,
    n_routed_experts=128,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    initializer_range=0.02,
    max_position_embeddings=131072,
    num_nextn_predict_layers=1,
)
_RENAMED = {"n_dense_layers": "first_k_dense_replace", "num_mtp_layers": "num_nextn_predict_layers"}


def config_to_hf(config: GLMConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json dict of `config` for transformers' Glm4MoeConfig."""
    c = config
    if c.attention != "gqa":
        raise ValueError(
            f"GLMConfig.attention={c.attention!r}: the transformers export writes the Glm4Moe "
            "(attention='gqa') layout only; the glm_moe_dsa layout is not written yet"
        )
    out = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "dtype": str(dtype).removeprefix("torch."),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "partial_rotary_factor": c.partial_rotary_factor,
        "rope_theta": c.rope_theta,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.partial_rotary_factor,
        },
        "attention_bias": c.attention_bias,
        "attention_dropout": 0.0,
        "use_qk_norm": c.use_qk_norm,
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
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if c.head_dim is not None:  # absent means hidden_size // num_attention_heads, as in HF
        out["head_dim"] = c.head_dim
    return out


def config_from_hf(hf: dict) -> GLMConfig:
    """A GLMConfig from a Glm4Moe config.json dict (missing keys take transformers' defaults)."""
    if hf.get("model_type", "glm4_moe") != "glm4_moe":
        raise ValueError(f"config.json model_type must be 'glm4_moe', got {hf['model_type']!r}")
    hf = dict(hf)
    rope = hf.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key in rope:
            hf[key] = rope[key]
    if "num_mtp_layers" in hf and "num_nextn_predict_layers" not in hf:
        hf["num_nextn_predict_layers"] = hf["num_mtp_layers"]
    if "num_local_experts" in hf and "n_routed_experts" not in hf:
        hf["n_routed_experts"] = hf["num_local_experts"]
    kwargs = {}
    for name in GLMConfig.__dataclass_fields__:
        key = _RENAMED.get(name, name)
        if key in hf:
            kwargs[name] = hf[key]
        elif key in _HF_DEFAULTS:
            kwargs[name] = _HF_DEFAULTS[key]
    kwargs.setdefault("head_dim", None)
    return GLMConfig(**kwargs)
