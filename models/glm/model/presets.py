"""Named GLM-MoE presets: toy sizes for CPU runs and tests, and the public GLM-4.5-Air, GLM-5
and GLM-5.2 shapes (docs/models.md compares the last two); `get_preset(name, **overrides)`
gives a fresh `GLMConfig` of one."""

from __future__ import annotations

from dataclasses import replace

from models.glm.model.config import GLMConfig, index_share_types

_GLM5 = GLMConfig(
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,
    moe_intermediate_size=2048,
    num_hidden_layers=78,
    n_dense_layers=3,
    num_attention_heads=64,
    num_key_value_heads=64,
    head_dim=None,
    partial_rotary_factor=1.0,
    attention="mla",
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_n_heads=32,
    index_head_dim=128,
    index_topk=2048,
    n_routed_experts=256,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    max_position_embeddings=202752,
    num_mtp_layers=1,
    bos_token_id=0,
    eos_token_id=1,
)

_PRESETS: dict[str, GLMConfig] = {
    # Byte-level toy: trains on CPU in minutes on a 4-rank gloo world.
    "tiny": GLMConfig(),
    # A step up for single-node smoke runs.
    "small": GLMConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=128,
        num_hidden_layers=6,
        n_dense_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=2,
        topk_group=2,
        use_qk_norm=True,
        routed_scaling_factor=2.5,
    ),
    # Public GLM-4.5-Air shapes (46 layers + the checkpoint's 1 MTP layer).
    "glm45_air": GLMConfig(
        vocab_size=151552,
        hidden_size=4096,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=46,
        n_dense_layers=1,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        attention_bias=True,
        n_routed_experts=128,
        num_experts_per_tok=8,
        routed_scaling_factor=1.0,
        rope_theta=1000000.0,
        num_mtp_layers=1,
    ),
    # Multi-head latent attention + DeepSeek Sparse Attention at toy size: trains on CPU in
    # minutes, and the default seq_len (128) exceeds index_topk, so the attention is sparse.
    "mla_tiny": GLMConfig(
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=None,
        partial_rotary_factor=1.0,
        attention="mla",
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=16,
        indexer_types=["full", "shared", "full"],
        routed_scaling_factor=2.5,
        num_mtp_layers=1,
    ),
    # The public GLM-5 shapes (transformers GlmMoeDsaConfig defaults, its token ids included):
    # 78 layers (3 dense) + the checkpoint's 1 MTP layer = 76 MoE layers, MLA + DSA attention
    # with an indexer in every layer.
    "glm5": _GLM5,
    # GLM-5.2 as InternLM xtuner's public Glm52MoEConfig sets it: GLM-5's shapes with RoPE theta
    # 8e6 over 1,048,576 positions, IndexShare (an indexer in layers 0, 1, 2, 6, 10, ..., 74: 21
    # of 78; the others reuse the nearest one before them; the MTP layer runs its own) and the
    # GLM-5.2 token ids (eos: the list transformers' config.json carries; bos as GLM-5's, the
    # transformers default xtuner's export leaves).
    "glm52": replace(
        _GLM5,
        rope_theta=8_000_000.0,
        max_position_embeddings=1_048_576,
        indexer_types=index_share_types(78, freq=4, offset=3),
        eos_token_id=[154820, 154827, 154829],
        pad_token_id=154820,
    ),
}


def get_preset(name: str, **overrides) -> GLMConfig:
    """A fresh copy of the named preset (see PRESET_NAMES), with overrides."""
    if name not in _PRESETS:
        raise ValueError(f"unknown GLM preset {name!r}; choose one of {sorted(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)


PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
