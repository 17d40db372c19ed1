"""Export to / import from a Hugging Face style directory for transformers' `Glm4MoeForCausalLM`.

Layout (see /work/shared/docs/hf-glm4moe.md): `config.json` (model_type "glm4_moe") and one
`model.safetensors`. Our keys already follow the transformers names except for
- the fused 2-D experts: our `mlp.experts.gate_up_proj [E*2I, D]` / `down_proj [E*D, I]` are
  written per expert as `mlp.experts.{e}.gate_proj.weight [I, D]`, `.up_proj.weight [I, D]`,
  `.down_proj.weight [D, I]` (section 2b); on import the fused 3-D in-memory layout
  `experts.gate_up_proj [E, 2I, D]` / `experts.down_proj [E, D, I]` (section 2a) is accepted too;
- MTP layers: our `model.mtp_layers.{i}.*` are `model.layers.{num_hidden_layers + i}.*`, as in
  the public GLM checkpoints (transformers ignores them);
- with tied embeddings `lm_head.weight` is left out of the file.
The safetensors format is read and written here with torch and the standard library only.
"""

from __future__ import annotations

import ctypes
import json
import os
import re

import torch

from models.glm.config import GLMConfig

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPES.items()}

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


# ---- safetensors (format: u64 header length, JSON header, raw little-endian bytes) ----


def save_safetensors(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Write CPU tensors to a .safetensors file (metadata {"format": "pt"})."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset, blobs = 0, []
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        blobs.append((t, nbytes))
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # align the data to 8 bytes, as safetensors does
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t, nbytes in blobs:
            if nbytes:
                f.write(ctypes.string_at(t.data_ptr(), nbytes))


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Read every tensor of a .safetensors file (into CPU memory)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    base, out = 8 + n, {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _DTYPES_BY_NAME[info["dtype"]]
        buf = bytearray(data[base + begin : base + end])
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out


# ---- config ----


def config_to_hf(config: GLMConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The config.json dict of `config` for transformers' Glm4MoeConfig."""
    c = config
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


# ---- state dicts ----


def _hf_layer_prefix(key: str, config: GLMConfig) -> str:
    m = re.match(r"model\.mtp_layers\.(\d+)\.(.*)", key)
    return f"model.layers.{config.num_hidden_layers + int(m[1])}.{m[2]}" if m else key


def to_hf_state_dict(state_dict: dict[str, torch.Tensor], config: GLMConfig) -> dict:
    """Our (full, unsharded) state dict -> the per-expert 2-D transformers checkpoint layout."""
    E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        key = _hf_layer_prefix(key, config)
        if key.endswith("mlp.experts.gate_up_proj"):
            w_E2ID = t.reshape(E, 2 * I, D)
            for e in range(E):
                out[f"{key[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = w_E2ID[e, :I].clone()
                out[f"{key[: -len('gate_up_proj')]}{e}.up_proj.weight"] = w_E2ID[e, I:].clone()
        elif key.endswith("mlp.experts.down_proj"):
            w_EDI = t.reshape(E, D, I)
            for e in range(E):
                out[f"{key[: -len('down_proj')]}{e}.down_proj.weight"] = w_EDI[e].clone()
        else:
            out[key] = t
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: GLMConfig) -> dict:
    """A transformers Glm4Moe state dict (per-expert 2-D or fused 3-D experts) -> our keys."""
    E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    N = config.num_hidden_layers
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for key, t in hf.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
        if m and int(m[1]) >= N:
            key = f"model.mtp_layers.{int(m[1]) - N}.{m[2]}"
        m = re.match(r"(.*mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
        if m:
            per_expert.setdefault(m[1], {})[(int(m[2]), m[3])] = t
        elif key.endswith("mlp.experts.gate_up_proj"):
            out[key] = t.reshape(E * 2 * I, D)
        elif key.endswith("mlp.experts.down_proj"):
            out[key] = t.reshape(E * D, I)
        else:
            out[key] = t
    for prefix, parts in per_expert.items():
        missing = [
            f"{prefix}{e}.{p}.weight"
            for e in range(E)
            for p in ("gate_proj", "up_proj", "down_proj")
            if (e, p) not in parts
        ]
        if missing:
            raise ValueError(f"checkpoint lacks expert weights: {missing[:6]}")
        out[prefix + "gate_up_proj"] = torch.cat(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(E)]
        )
        out[prefix + "down_proj"] = torch.cat([parts[(e, "down_proj")] for e in range(E)])
    if config.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def _check_against_model(state_dict: dict, config: GLMConfig) -> None:
    from models.glm.model import GLMForCausalLM

    with torch.device("meta"):
        expected = GLMForCausalLM(config).state_dict()
    for key in [k for k in expected if k.endswith("e_score_correction_bias")]:
        state_dict.setdefault(key, torch.zeros(expected[key].shape))  # as transformers does
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = [
        f"{k}: {tuple(state_dict[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in state_dict and state_dict[k].shape != v.shape
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            f"checkpoint does not match the config: missing {missing[:6]}, unexpected "
            f"{unexpected[:6]}, wrong shapes {wrong[:6]}"
        )


# ---- public API ----


def export_hf(model_or_state_dict, config: GLMConfig, path: str) -> None:
    """Write `config.json` and `model.safetensors` for transformers' Glm4MoeForCausalLM into
    directory `path`. Accepts a GLMForCausalLM or its state dict; DTensor entries (a sharded
    model) are gathered with full_tensor(), a collective every rank must join, and only rank 0
    writes."""
    import torch.distributed as dist

    state = (
        model_or_state_dict.state_dict()
        if hasattr(model_or_state_dict, "state_dict")
        else model_or_state_dict
    )
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
        for k, v in state.items()
    }
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    os.makedirs(path, exist_ok=True)
    hf = to_hf_state_dict(full, config)
    dtype = full["model.embed_tokens.weight"].dtype
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config, dtype), f, indent=2)
    save_safetensors(hf, os.path.join(path, "model.safetensors"))


def import_hf(path: str) -> tuple[GLMConfig, dict[str, torch.Tensor]]:
    """Read a Glm4Moe directory (`config.json` and `model.safetensors`, or a sharded
    `model.safetensors.index.json`) into (GLMConfig, our state dict); fused and per-expert
    layouts both load. Missing or unexpected keys or wrong shapes raise ValueError."""
    with open(os.path.join(path, "config.json")) as f:
        config = config_from_hf(json.load(f))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    hf: dict[str, torch.Tensor] = {}
    for name in files:
        hf.update(load_safetensors(os.path.join(path, name)))
    state_dict = from_hf_state_dict(hf, config)
    _check_against_model(state_dict, config)
    return config, state_dict
