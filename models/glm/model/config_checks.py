"""The construction-time checks of a `GLMConfig` (models/glm/model/config.py): plain functions
of the config, each raising ValueError with a message naming the field and what is allowed;
`check_config` runs them in order. The IndexShare schedule (`index_share_types`) and the
allowed values live here too; models/glm/model/config.py exports them."""

from __future__ import annotations

from typing import Any

from models.glm.model.config_types import check_field_types

ATTENTION_CHOICES = ("gqa", "mla")
INDEXER_TYPES = ("full", "shared")
INDEXER_TRAINING_CHOICES = ("kl", "frozen")
DSA_IMPLS = ("latent", "per_head", "masked")
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
DSA_FIELDS = ("index_n_heads", "index_head_dim")
YARN_KEYS = (
    "rope_type",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def check_config(config: Any) -> None:
    """Every check of a GLMConfig, in order (the field types first); the IndexShare check
    also fills `indexer_types` from its schedule when unset."""
    check_field_types(config)
    check_sizes(config)
    check_mtp_and_tokens(config)
    check_attention(config)
    check_index_share(config)
    check_rope_scaling(config)


def check_sizes(config: Any) -> None:
    positive = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "max_position_embeddings",
    )
    for name in positive:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"GLMConfig.{name} must be a positive int, got {value!r}")
    for name in ("n_dense_layers", "num_mtp_layers"):
        if getattr(config, name) < 0:
            raise ValueError(f"GLMConfig.{name} must be >= 0, got {getattr(config, name)}")
    if config.n_dense_layers > config.num_hidden_layers:
        raise ValueError(
            f"GLMConfig.n_dense_layers ({config.n_dense_layers}) must be <= "
            f"num_hidden_layers ({config.num_hidden_layers})"
        )
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    if nh % nkv:
        raise ValueError(
            f"GLMConfig.num_key_value_heads ({nkv}) must divide num_attention_heads ({nh})"
        )
    if config.head_dim is None:
        if config.attention == "gqa" and config.hidden_size % nh:
            raise ValueError(
                f"GLMConfig.num_attention_heads ({nh}) must divide hidden_size "
                f"({config.hidden_size}) when head_dim is None; or set head_dim"
            )
    elif config.head_dim < 1:
        raise ValueError(
            f"GLMConfig.head_dim must be a positive int or None, got {config.head_dim}"
        )
    if not 0.0 < config.partial_rotary_factor <= 1.0:
        raise ValueError(
            f"GLMConfig.partial_rotary_factor must be in (0, 1], got {config.partial_rotary_factor}"
        )
    rd = config.rotary_dim if config.attention == "gqa" else 2
    if rd < 2 or rd % 2:
        raise ValueError(
            f"GLMConfig.partial_rotary_factor ({config.partial_rotary_factor}) x head_dim "
            f"({config.head_dim_resolved}) gives {rd} rotary channels; it must be even and >= 2"
        )
    E, K, G = config.n_routed_experts, config.num_experts_per_tok, config.n_group
    if K > E:
        raise ValueError(f"GLMConfig.num_experts_per_tok ({K}) must be <= n_routed_experts ({E})")
    if E % G:
        raise ValueError(f"GLMConfig.n_group ({G}) must divide n_routed_experts ({E})")
    if G > 1 and E // G < 2:
        raise ValueError(
            f"GLMConfig.n_group ({G}) leaves {E // G} expert per group; grouped routing "
            "needs at least 2 experts per group (n_group <= n_routed_experts // 2)"
        )
    if config.topk_group > G:
        raise ValueError(f"GLMConfig.topk_group ({config.topk_group}) must be <= n_group ({G})")
    if config.topk_group * (E // G) < K:
        raise ValueError(
            f"GLMConfig.topk_group ({config.topk_group}) groups of {E // G} experts hold fewer "
            f"than num_experts_per_tok ({K}) experts; raise topk_group"
        )
    for name in ("rms_norm_eps", "initializer_range", "rope_theta", "routed_scaling_factor"):
        if not getattr(config, name) > 0:
            raise ValueError(f"GLMConfig.{name} must be > 0, got {getattr(config, name)}")


def check_mtp_and_tokens(config: Any) -> None:
    _check_positive("loss_chunk_tokens", config.loss_chunk_tokens, "tokens per loss chunk")
    if config.mtp_depths is not None:
        _check_positive("mtp_depths", config.mtp_depths, "or None for one depth per MTP layer")
        if config.num_mtp_layers not in (1, config.mtp_depths):
            raise ValueError(
                f"GLMConfig.mtp_depths ({config.mtp_depths}) needs num_mtp_layers 1 (every depth "
                f"reuses the one layer) or {config.mtp_depths} (a layer per depth); got "
                f"num_mtp_layers {config.num_mtp_layers}"
            )
    eos = config.eos_token_id
    for name, ids in (
        ("bos_token_id", [config.bos_token_id]),
        ("eos_token_id", eos if isinstance(eos, list) else [eos]),
        ("pad_token_id", [config.pad_token_id]),
    ):
        for t in ids:
            if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
                raise ValueError(
                    f"GLMConfig.{name} must be a token id (an int >= 0), a list of them "
                    f"(eos_token_id only) or None; got {t!r}"
                )
    if config.pad_token_id is not None and config.pad_token_id >= config.vocab_size:
        raise ValueError(
            f"GLMConfig.pad_token_id ({config.pad_token_id}) must be < vocab_size "
            f"({config.vocab_size}): the embedding's pad row takes no gradient; or set it None"
        )


def check_attention(config: Any) -> None:
    """The attention family and its fields: gqa leaves the mla ones unset; mla checks its
    shape, then DSA (index_topk) its indexer."""
    _check_attention_choices(config)
    mla_only = ("q_lora_rank", *MLA_FIELDS, *DSA_FIELDS, "index_topk", "indexer_types")
    if config.attention == "gqa":
        for name in mla_only:
            if getattr(config, name) is not None:
                raise ValueError(
                    f"GLMConfig.{name} is a multi-head latent attention field; it needs "
                    f"attention='mla' (attention is 'gqa'), or leave it None"
                )
        return
    _check_mla(config)
    if config.index_topk is None:
        for name in (*DSA_FIELDS, "indexer_types"):
            if getattr(config, name) is not None:
                raise ValueError(
                    f"GLMConfig.{name} is a sparse-attention (DSA) field; it needs "
                    "index_topk, or leave it None"
                )
        return
    _check_dsa(config)


def _check_attention_choices(config: Any) -> None:
    if config.attention not in ATTENTION_CHOICES:
        raise ValueError(
            f"GLMConfig.attention must be one of {ATTENTION_CHOICES}, got {config.attention!r}"
        )
    if config.indexer_training not in INDEXER_TRAINING_CHOICES:
        raise ValueError(
            f"GLMConfig.indexer_training must be one of {INDEXER_TRAINING_CHOICES}, "
            f"got {config.indexer_training!r}"
        )
    if config.dsa_impl not in DSA_IMPLS or (config.dsa_impl != "latent" and not config.uses_dsa):
        raise ValueError(
            f"GLMConfig.dsa_impl must be one of {DSA_IMPLS} (a path other than the default "
            f"'latent' needs DSA: index_topk), got {config.dsa_impl!r}"
        )
    _check_positive("dsa_chunk_mib", config.dsa_chunk_mib, "it bounds a query chunk's memory")


def _check_mla(config: Any) -> None:
    for name in MLA_FIELDS:
        _check_positive(name, getattr(config, name), "attention='mla' needs it")
    if config.q_lora_rank is not None:
        _check_positive("q_lora_rank", config.q_lora_rank, "or None for a full q_proj")
    if config.qk_rope_head_dim % 2:
        raise ValueError(
            f"GLMConfig.qk_rope_head_dim ({config.qk_rope_head_dim}) must be even (RoPE pairs)"
        )
    nh, nkv = config.num_attention_heads, config.num_key_value_heads
    if nkv != nh:
        raise ValueError(
            f"GLMConfig.num_key_value_heads ({nkv}) must equal num_attention_heads ({nh}) "
            "with attention='mla' (every head has its own key and value, as in GLM-5)"
        )
    if config.head_dim is not None and config.head_dim != config.qk_rope_head_dim:
        raise ValueError(
            f"GLMConfig.head_dim ({config.head_dim}) is the rotary width under attention='mla': "
            f"set it to None or to qk_rope_head_dim ({config.qk_rope_head_dim})"
        )
    if config.partial_rotary_factor != 1.0:
        raise ValueError(
            f"GLMConfig.partial_rotary_factor ({config.partial_rotary_factor}) must be 1.0 with "
            "attention='mla': the rotary channels are the qk_rope_head_dim slice"
        )
    if config.use_qk_norm:
        raise ValueError(
            "GLMConfig.use_qk_norm is a grouped-query attention option; attention='mla' "
            "normalizes its latents (q_a_layernorm, kv_a_layernorm) instead"
        )


def _check_dsa(config: Any) -> None:
    _check_positive("index_topk", config.index_topk, "or None for dense MLA")
    for name in DSA_FIELDS:
        _check_positive(name, getattr(config, name), "index_topk needs it")
    if config.q_lora_rank is None:
        raise ValueError(
            "GLMConfig.q_lora_rank must be set with index_topk: the indexer reads the "
            "low-rank query"
        )
    if config.index_head_dim < config.qk_rope_head_dim:
        raise ValueError(
            f"GLMConfig.index_head_dim ({config.index_head_dim}) must be >= qk_rope_head_dim "
            f"({config.qk_rope_head_dim}): the indexer rotates its first qk_rope channels"
        )
    types = config.indexer_types
    if types is not None:
        if len(types) != config.num_hidden_layers:
            raise ValueError(
                f"GLMConfig.indexer_types has {len(types)} entries; it needs one per layer "
                f"(num_hidden_layers={config.num_hidden_layers})"
            )
        bad = sorted({t for t in types if t not in INDEXER_TYPES})
        if bad:
            raise ValueError(f"GLMConfig.indexer_types holds {bad}; allowed: {list(INDEXER_TYPES)}")
        if types[0] != "full":
            raise ValueError(
                "GLMConfig.indexer_types[0] must be 'full': a 'shared' layer reuses the "
                "previous layer's top-k"
            )


def check_index_share(config: Any) -> None:
    freq, offset = config.index_topk_freq, config.index_skip_topk_offset
    if freq is None and offset is None:
        return
    if not config.uses_dsa or freq is None or offset is None:
        raise ValueError(
            "GLMConfig.index_topk_freq and index_skip_topk_offset (IndexShare's schedule) "
            f"go together and need index_topk; got {freq!r}, {offset!r} with index_topk "
            f"{config.index_topk!r}"
        )
    _check_positive("index_topk_freq", freq, "1: every layer runs its indexer")
    if offset < 0:
        raise ValueError(f"GLMConfig.index_skip_topk_offset must be >= 0, got {offset}")
    schedule = index_share_types(config.num_hidden_layers, freq, offset)
    canonical = None if all(t == "full" for t in schedule) else schedule
    if config.indexer_types is None:
        config.indexer_types = canonical
    elif (config.indexer_types if "shared" in config.indexer_types else None) != canonical:
        raise ValueError(
            f"GLMConfig.indexer_types {config.indexer_types} is not the IndexShare schedule "
            f"of index_topk_freq {freq}, index_skip_topk_offset {offset} ({schedule}); "
            "set one or make them agree"
        )


def check_rope_scaling(config: Any) -> None:
    rs = config.rope_scaling
    if rs is None:
        return
    unknown = sorted(set(rs) - set(YARN_KEYS))
    if unknown:
        raise ValueError(
            f"GLMConfig.rope_scaling has unknown keys {unknown}; allowed: {list(YARN_KEYS)}"
        )
    if rs.get("rope_type") != "yarn":
        raise ValueError(
            f"GLMConfig.rope_scaling.rope_type must be 'yarn', got {rs.get('rope_type')!r}"
        )
    for key in ("factor", "original_max_position_embeddings"):
        if not isinstance(rs.get(key), int | float) or not rs[key] > 0:
            raise ValueError(
                f"GLMConfig.rope_scaling.{key} must be a positive number, got {rs.get(key)!r}"
            )


def index_share_types(num_layers: int, freq: int, offset: int) -> list[str]:
    """transformers' GlmMoeDsaConfig schedule (and InternLM xtuner's `dsa_topk_source_layer`):
    layer i runs its own indexer ("full") when max(i - offset + 1, 0) is a multiple of `freq`,
    else it reuses the top-k of the nearest full layer before it ("shared"). freq <= 1: all
    full. GLM-5.2's freq 4, offset 3: layers 0, 1, 2, 6, 10, ... are full."""
    freq = max(int(freq), 1)
    return [
        "full" if max(i - int(offset) + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
    ]


def _check_positive(name: str, value: Any, hint: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GLMConfig.{name} must be a positive int ({hint}), got {value!r}")
