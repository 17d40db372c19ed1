"""The JSON type of every config.json key the importer reads (models/glm/hf/config.py).

JSON has its own types, and a config.json written by hand or by another tool may carry the
wrong one: `"tie_word_embeddings": "false"` is a non-empty string, which Python reads as true;
`"eos_token_id": "154820"` iterates as six digits. `check_json_types` refuses every value whose
JSON type is not its key's, naming the key, before any value is used. GLMConfig fields (under
their config.json names) take their annotation's type; the keys below are config.json's own.
"""

from __future__ import annotations

from dataclasses import fields

from models.glm.model.config import GLMConfig
from models.glm.model.config_types import describe_annotation, fits_annotation

# config.json key -> its type, written as a GLMConfig annotation ("int | None", ...).
JSON_TYPES = {
    "model_type": "str",
    "hidden_act": "str",
    "scoring_func": "str",
    "topk_method": "str",
    "first_k_dense_replace": "int",
    "num_nextn_predict_layers": "int | None",
    "num_local_experts": "int",
    "num_experts": "int | None",
    "moe_layer_freq": "int",
    "ep_size": "int",
    "pretraining_tp": "int",
    "qk_head_dim": "int | None",
    "head_dim": "int | None",
    "chunk_size_feed_forward": "int",
    "rope_theta": "float",
    "partial_rotary_factor": "float",
    "attention_dropout": "float",
    "router_aux_loss_coef": "float",
    "mlp_bias": "bool",
    "rope_interleave": "bool",
    "indexer_rope_interleave": "bool",
    "use_cache": "bool",
    "output_router_logits": "bool",
    "is_encoder_decoder": "bool",
    "output_attentions": "bool",
    "output_hidden_states": "bool",
    "return_dict": "bool",
    "mlp_layer_types": "list[str] | None",
    "layer_types": "list[str] | None",
    "index_topk_pattern": "str | list[str] | None",
    "rope_parameters": "dict[str, Any] | None",
    "rope_scaling": "dict[str, Any] | None",
    "quantization_config": "dict[str, Any] | None",
    "auto_map": "dict[str, Any]",
}
# GLMConfig fields config.json spells otherwise.
RENAMED = {"n_dense_layers": "first_k_dense_replace", "num_mtp_layers": "num_nextn_predict_layers"}


def key_types() -> dict[str, str]:
    """Every typed config.json key and its annotation."""
    out = {RENAMED.get(f.name, f.name): str(f.type) for f in fields(GLMConfig)}
    return {**out, **JSON_TYPES}


def check_json_types(hf: dict, where: str = "config.json") -> None:
    """Raise ValueError naming the first key of `hf` whose value's JSON type is not the key's
    (unknown keys are left to the importer, which refuses them by name)."""
    types = key_types()
    for key, value in hf.items():
        annotation = types.get(key)
        if annotation is not None and not fits_annotation(value, annotation):
            kind = "null" if value is None else type(value).__name__
            want = describe_annotation(annotation, none="null")
            raise ValueError(f"{where} {key} must be {want}, got {value!r} ({kind})")
