"""GLM-MoE model configuration (the named presets: models/glm/model/presets.py).

`GLMConfig` holds the shape and numerics of a GLM-4.5 / GLM-5 style decoder-only MoE model; field
names follow transformers' `Glm4MoeConfig` (models/glm/hf/config.py maps them) except
`n_dense_layers` (HF `first_k_dense_replace`) and `num_mtp_layers` (HF `num_nextn_predict_layers`).
A bad combination fails at construction with a message naming the field and what is allowed.

Two attention families share the type, chosen by `attention`:
- "gqa": grouped-query attention with partial half-split RoPE (transformers `glm4_moe`, GLM-4.5);
- "mla": multi-head latent attention (transformers `glm_moe_dsa`, GLM-5), whose fields carry
  transformers' `GlmMoeDsaConfig` names (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
  qk_rope_head_dim, v_head_dim); with `index_topk` set it adds DeepSeek Sparse Attention (DSA:
  index_n_heads, index_head_dim, index_topk, indexer_types) and `indexer_training` picks how the
  indexer learns ("kl": DeepSeek-V3.2's KL objective, for pretraining; "frozen": no gradient and
  no optimizer state, for fine-tuning a released checkpoint); `dsa_impl` picks how the sparse
  attention runs (models/glm/model/mla.py: "latent", the absorbed sparse MLA over gathered keys, by
  default; "per_head"; "masked", dense SDPA under the kept-key mask, the reference) and
  `dsa_chunk_mib` bounds one query chunk's temporaries there and in the indexer.
`rope_scaling` (yarn) applies to both: {"rope_type": "yarn", "factor", "original_max_position_
embeddings", optional "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
"truncate"}, transformers' `rope_parameters` without `rope_theta`.

Multi-token prediction (MTP): `num_mtp_layers` DeepSeek-V3-style MTP layers (a MoE decoder layer
plus `enorm`/`hnorm`/`eh_proj`/`shared_head.norm`, stored as `model.layers.{num_hidden_layers + i}`
in the public GLM checkpoints) run in the training forward (`GLMForCausalLM.losses`) over
`mtp_depths` prediction depths: one per layer, or several that reuse one physical layer (GLM-5
trains three depths on its one MTP layer; InternLM xtuner's `MTPConfig.share_weights`).

IndexShare (GLM-5.2): `index_share_types(n, index_topk_freq, index_skip_topk_offset)` gives the
`indexer_types` of transformers' schedule; a "shared" layer reuses the top-k of the nearest
"full" layer before it (`indexer_source_layer`). The two schedule fields are carried to and from
config.json (xtuner's loader reads them); when set, `indexer_types` defaults to their schedule
and must equal it. `index_share_for_mtp_iteration` (xtuner's `Glm52MoEConfig`, default true):
with one MTP layer run at several depths, depths >= 2 attend the keys depth 1 kept.

The token ids (`bos_token_id`, `eos_token_id`: one id or a list, `pad_token_id`) do not change
the math; they are carried so that an export writes what an import read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from models.glm.model.config_types import check_field_types

ATTENTION_CHOICES = ("gqa", "mla")
INDEXER_TYPES = ("full", "shared")
INDEXER_TRAINING_CHOICES = ("kl", "frozen")
DSA_IMPLS = ("latent", "per_head", "masked")
_MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_DSA_FIELDS = ("index_n_heads", "index_head_dim")
_YARN_KEYS = (
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


@dataclass
class GLMConfig:
    """Shape and numerics of a GLM-MoE decoder-only language model."""

    vocab_size: int = 256  # embedding and lm_head rows (V)
    hidden_size: int = 64  # residual width (H)
    intermediate_size: int = 128  # inner size of the dense SwiGLU MLPs (first layers)
    moe_intermediate_size: int = 32  # inner size I of each routed expert (and shared-expert unit)
    num_hidden_layers: int = 3  # decoder layers run by forward
    n_dense_layers: int = 1  # the first layers use a dense MLP (HF first_k_dense_replace)
    num_attention_heads: int = 4  # query heads (nh)
    num_key_value_heads: int = 2  # key/value heads (nkv, GQA); must divide nh
    head_dim: int | None = 16  # per-head width (hd); None means hidden_size // nh
    partial_rotary_factor: float = 0.5  # rotary channels = int(hd * factor), the first of each head
    rope_theta: float = 10000.0  # RoPE base
    attention_bias: bool = False  # biases on q/k/v projections (never on o_proj)
    use_qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE
    n_routed_experts: int = 8  # routed experts per MoE layer (E)
    n_shared_experts: int = 1  # shared expert inner size = moe_intermediate_size * this
    num_experts_per_tok: int = 2  # top-k (K)
    n_group: int = 1  # expert groups for grouped routing (G); must divide E
    topk_group: int = 1  # groups kept per token
    norm_topk_prob: bool = True  # renormalize the K chosen router weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed weights
    rms_norm_eps: float = 1e-5  # eps of every RMSNorm
    tie_word_embeddings: bool = False  # lm_head shares the embedding weight
    initializer_range: float = 0.02  # normal std of init_weights
    max_position_embeddings: int = 131072  # longest sequence forward accepts
    num_mtp_layers: int = 0  # DeepSeek-V3-style MTP layers after the main stack (0: none)
    attention: str = "gqa"  # "gqa" (glm4_moe) or "mla" (glm_moe_dsa; DSA when index_topk is set)
    q_lora_rank: int | None = None  # mla: rank of the low-rank query (None: a full q_proj)
    kv_lora_rank: int | None = None  # mla: rank of the compressed key/value latent
    qk_nope_head_dim: int | None = None  # mla: per-head query/key channels without RoPE
    qk_rope_head_dim: int | None = None  # mla: per-head rotary channels (one shared key head)
    v_head_dim: int | None = None  # mla: per-head value width
    index_n_heads: int | None = None  # dsa: indexer heads
    index_head_dim: int | None = None  # dsa: indexer head width (its first qk_rope channels rotate)
    index_topk: int | None = None  # dsa: keys kept per query (None: dense MLA, no indexer)
    indexer_types: list[str] | None = None  # dsa: "full"/"shared" per layer; None: all "full"
    index_topk_freq: int | None = None  # dsa: IndexShare's schedule (config.json; see below)
    index_skip_topk_offset: int | None = None  # dsa: IndexShare's schedule (config.json)
    index_share_for_mtp_iteration: bool = True  # dsa: MTP depths >= 2 reuse depth 1's top-k
    indexer_training: str = "kl"  # dsa: "kl" (pretraining) or "frozen" (fine-tuning)
    dsa_impl: str = "latent"  # dsa: latent (sparse MLA, absorbed), per_head (sparse), masked (ref.)
    dsa_chunk_mib: int = 64  # dsa: MiB bound of one query chunk's temporaries (attention, indexer)
    rope_scaling: dict[str, Any] | None = None  # yarn RoPE scaling (see module doc); None: none
    mtp_depths: int | None = None  # MTP prediction depths; None: one per MTP layer (see above)
    loss_chunk_tokens: int = 1024  # tokens per cross-entropy chunk (the [chunk, V] logits)
    bos_token_id: int | None = None  # tokenizer ids, carried to and from config.json
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        # Hydra hands lists and dicts over as ListConfig / DictConfig: keep plain data.
        # Anything else keeps its type and fails the type check, naming the field.
        if self.indexer_types is not None and not isinstance(self.indexer_types, str):
            self.indexer_types = list(self.indexer_types)
        if self.rope_scaling is not None and hasattr(self.rope_scaling, "keys"):
            self.rope_scaling = dict(self.rope_scaling)
        if self.eos_token_id is not None and not isinstance(self.eos_token_id, int | str):
            self.eos_token_id = list(self.eos_token_id)
        check_field_types(self)
        self._check_sizes()
        self._check_mtp_and_tokens()
        self._check_attention()
        self._check_index_share()
        self._check_rope_scaling()

    def _check_sizes(self) -> None:
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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GLMConfig.{name} must be a positive int, got {value!r}")
        for name in ("n_dense_layers", "num_mtp_layers"):
            if getattr(self, name) < 0:
                raise ValueError(f"GLMConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.n_dense_layers > self.num_hidden_layers:
            raise ValueError(
                f"GLMConfig.n_dense_layers ({self.n_dense_layers}) must be <= "
                f"num_hidden_layers ({self.num_hidden_layers})"
            )
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        if nh % nkv:
            raise ValueError(
                f"GLMConfig.num_key_value_heads ({nkv}) must divide num_attention_heads ({nh})"
            )
        if self.head_dim is None:
            if self.attention == "gqa" and self.hidden_size % nh:
                raise ValueError(
                    f"GLMConfig.num_attention_heads ({nh}) must divide hidden_size "
                    f"({self.hidden_size}) when head_dim is None; or set head_dim"
                )
        elif self.head_dim < 1:
            raise ValueError(
                f"GLMConfig.head_dim must be a positive int or None, got {self.head_dim}"
            )
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(
                "GLMConfig.partial_rotary_factor must be in (0, 1], "
                f"got {self.partial_rotary_factor}"
            )
        rd = self.rotary_dim if self.attention == "gqa" else 2
        if rd < 2 or rd % 2:
            raise ValueError(
                f"GLMConfig.partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                f"({self.head_dim_resolved}) gives {rd} rotary channels; it must be even and >= 2"
            )
        E, K, G = self.n_routed_experts, self.num_experts_per_tok, self.n_group
        if K > E:
            raise ValueError(
                f"GLMConfig.num_experts_per_tok ({K}) must be <= n_routed_experts ({E})"
            )
        if E % G:
            raise ValueError(f"GLMConfig.n_group ({G}) must divide n_routed_experts ({E})")
        if G > 1 and E // G < 2:
            raise ValueError(
                f"GLMConfig.n_group ({G}) leaves {E // G} expert per group; grouped routing "
                "needs at least 2 experts per group (n_group <= n_routed_experts // 2)"
            )
        if self.topk_group > G:
            raise ValueError(f"GLMConfig.topk_group ({self.topk_group}) must be <= n_group ({G})")
        if self.topk_group * (E // G) < K:
            raise ValueError(
                f"GLMConfig.topk_group ({self.topk_group}) groups of {E // G} experts hold fewer "
                f"than num_experts_per_tok ({K}) experts; raise topk_group"
            )
        for name in ("rms_norm_eps", "initializer_range", "rope_theta", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GLMConfig.{name} must be > 0, got {getattr(self, name)}")

    def _check_mtp_and_tokens(self) -> None:
        _check_positive("loss_chunk_tokens", self.loss_chunk_tokens, "tokens per loss chunk")
        if self.mtp_depths is not None:
            _check_positive("mtp_depths", self.mtp_depths, "or None for one depth per MTP layer")
            if self.num_mtp_layers not in (1, self.mtp_depths):
                raise ValueError(
                    f"GLMConfig.mtp_depths ({self.mtp_depths}) needs num_mtp_layers 1 (every depth "
                    f"reuses the one layer) or {self.mtp_depths} (a layer per depth); got "
                    f"num_mtp_layers {self.num_mtp_layers}"
                )
        eos = self.eos_token_id
        for name, ids in (
            ("bos_token_id", [self.bos_token_id]),
            ("eos_token_id", eos if isinstance(eos, list) else [eos]),
            ("pad_token_id", [self.pad_token_id]),
        ):
            for t in ids:
                if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
                    raise ValueError(
                        f"GLMConfig.{name} must be a token id (an int >= 0), a list of them "
                        f"(eos_token_id only) or None; got {t!r}"
                    )
        if self.pad_token_id is not None and self.pad_token_id >= self.vocab_size:
            raise ValueError(
                f"GLMConfig.pad_token_id ({self.pad_token_id}) must be < vocab_size "
                f"({self.vocab_size}): the embedding's pad row takes no gradient; or set it None"
            )

    def _check_attention(self) -> None:
        if self.attention not in ATTENTION_CHOICES:
            raise ValueError(
                f"GLMConfig.attention must be one of {ATTENTION_CHOICES}, got {self.attention!r}"
            )
        if self.indexer_training not in INDEXER_TRAINING_CHOICES:
            raise ValueError(
                f"GLMConfig.indexer_training must be one of {INDEXER_TRAINING_CHOICES}, "
                f"got {self.indexer_training!r}"
            )
        if self.dsa_impl not in DSA_IMPLS or (self.dsa_impl != "latent" and not self.uses_dsa):
            raise ValueError(
                f"GLMConfig.dsa_impl must be one of {DSA_IMPLS} (a path other than the default "
                f"'latent' needs DSA: index_topk), got {self.dsa_impl!r}"
            )
        _check_positive("dsa_chunk_mib", self.dsa_chunk_mib, "it bounds a query chunk's memory")
        mla_only = ("q_lora_rank", *_MLA_FIELDS, *_DSA_FIELDS, "index_topk", "indexer_types")
        if self.attention == "gqa":
            for name in mla_only:
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"GLMConfig.{name} is a multi-head latent attention field; it needs "
                        f"attention='mla' (attention is 'gqa'), or leave it None"
                    )
            return
        for name in _MLA_FIELDS:
            _check_positive(name, getattr(self, name), "attention='mla' needs it")
        if self.q_lora_rank is not None:
            _check_positive("q_lora_rank", self.q_lora_rank, "or None for a full q_proj")
        if self.qk_rope_head_dim % 2:
            raise ValueError(
                f"GLMConfig.qk_rope_head_dim ({self.qk_rope_head_dim}) must be even (RoPE pairs)"
            )
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        if nkv != nh:
            raise ValueError(
                f"GLMConfig.num_key_value_heads ({nkv}) must equal num_attention_heads ({nh}) "
                "with attention='mla' (every head has its own key and value, as in GLM-5)"
            )
        if self.head_dim is not None and self.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"GLMConfig.head_dim ({self.head_dim}) is the rotary width under attention='mla': "
                f"set it to None or to qk_rope_head_dim ({self.qk_rope_head_dim})"
            )
        if self.partial_rotary_factor != 1.0:
            raise ValueError(
                f"GLMConfig.partial_rotary_factor ({self.partial_rotary_factor}) must be 1.0 with "
                "attention='mla': the rotary channels are the qk_rope_head_dim slice"
            )
        if self.use_qk_norm:
            raise ValueError(
                "GLMConfig.use_qk_norm is a grouped-query attention option; attention='mla' "
                "normalizes its latents (q_a_layernorm, kv_a_layernorm) instead"
            )
        if self.index_topk is None:
            for name in (*_DSA_FIELDS, "indexer_types"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"GLMConfig.{name} is a sparse-attention (DSA) field; it needs "
                        "index_topk, or leave it None"
                    )
            return
        _check_positive("index_topk", self.index_topk, "or None for dense MLA")
        for name in _DSA_FIELDS:
            _check_positive(name, getattr(self, name), "index_topk needs it")
        if self.q_lora_rank is None:
            raise ValueError(
                "GLMConfig.q_lora_rank must be set with index_topk: the indexer reads the "
                "low-rank query"
            )
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                f"GLMConfig.index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer rotates its first qk_rope channels"
            )
        types = self.indexer_types
        if types is not None:
            if len(types) != self.num_hidden_layers:
                raise ValueError(
                    f"GLMConfig.indexer_types has {len(types)} entries; it needs one per layer "
                    f"(num_hidden_layers={self.num_hidden_layers})"
                )
            bad = sorted({t for t in types if t not in INDEXER_TYPES})
            if bad:
                raise ValueError(
                    f"GLMConfig.indexer_types holds {bad}; allowed: {list(INDEXER_TYPES)}"
                )
            if types[0] != "full":
                raise ValueError(
                    "GLMConfig.indexer_types[0] must be 'full': a 'shared' layer reuses the "
                    "previous layer's top-k"
                )

    def _check_index_share(self) -> None:
        freq, offset = self.index_topk_freq, self.index_skip_topk_offset
        if freq is None and offset is None:
            return
        if not self.uses_dsa or freq is None or offset is None:
            raise ValueError(
                "GLMConfig.index_topk_freq and index_skip_topk_offset (IndexShare's schedule) "
                f"go together and need index_topk; got {freq!r}, {offset!r} with index_topk "
                f"{self.index_topk!r}"
            )
        _check_positive("index_topk_freq", freq, "1: every layer runs its indexer")
        if offset < 0:
            raise ValueError(f"GLMConfig.index_skip_topk_offset must be >= 0, got {offset}")
        schedule = index_share_types(self.num_hidden_layers, freq, offset)
        canonical = None if all(t == "full" for t in schedule) else schedule
        if self.indexer_types is None:
            self.indexer_types = canonical
        elif (self.indexer_types if "shared" in self.indexer_types else None) != canonical:
            raise ValueError(
                f"GLMConfig.indexer_types {self.indexer_types} is not the IndexShare schedule "
                f"of index_topk_freq {freq}, index_skip_topk_offset {offset} ({schedule}); "
                "set one or make them agree"
            )

    def _check_rope_scaling(self) -> None:
        rs = self.rope_scaling
        if rs is None:
            return
        unknown = sorted(set(rs) - set(_YARN_KEYS))
        if unknown:
            raise ValueError(
                f"GLMConfig.rope_scaling has unknown keys {unknown}; allowed: {list(_YARN_KEYS)}"
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

    @property
    def head_dim_resolved(self) -> int:
        """The per-head width of the rotary embedding's frame: head_dim, or hidden_size // nh
        (gqa); qk_rope_head_dim (mla, as transformers sets head_dim)."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return (
            self.head_dim
            if self.head_dim is not None
            else self.hidden_size // self.num_attention_heads
        )

    @property
    def rotary_dim(self) -> int:
        """Rotary channels per head (the first ones of each head, or mla's rope slice)."""
        return int(self.head_dim_resolved * self.partial_rotary_factor)

    @property
    def uses_dsa(self) -> bool:
        """Whether the attention is DeepSeek Sparse Attention (mla with an indexer)."""
        return self.attention == "mla" and self.index_topk is not None

    def layer_indexer_type(self, layer: int) -> str:
        """ "full" (own indexer) or "shared" (the previous layer's top-k) for decoder layer
        `layer`; MTP layers (layer >= num_hidden_layers) run their own indexer."""
        if self.indexer_types is None or layer >= self.num_hidden_layers:
            return "full"
        return self.indexer_types[layer]

    def indexer_source_layer(self, layer: int) -> int:
        """The layer whose indexer picks the keys of decoder layer `layer`: itself when "full",
        else the nearest "full" layer before it (MTP layers: their own)."""
        while self.layer_indexer_type(layer) == "shared":
            layer -= 1
        return layer

    @property
    def mtp_depths_resolved(self) -> int:
        """Prediction depths the MTP forward runs (0 without MTP layers)."""
        if not self.num_mtp_layers:
            return 0
        return self.mtp_depths if self.mtp_depths is not None else self.num_mtp_layers

    @property
    def num_moe_layers(self) -> int:
        """MoE layers built: the non-dense decoder layers plus the MTP layers."""
        return self.num_hidden_layers - self.n_dense_layers + self.num_mtp_layers

    def to_dict(self) -> dict:
        """The fields as a plain dict."""
        return asdict(self)

    def expected_num_parameters(self) -> int:
        """Parameter count from the config alone (what `GLMForCausalLM.num_parameters()` gives)."""
        H, V = self.hidden_size, self.vocab_size
        E, I, F = self.n_routed_experts, self.moe_intermediate_size, self.intermediate_size
        dense_mlp = 3 * H * F
        moe_mlp = E * H + E * 3 * H * I + 3 * H * I * self.n_shared_experts
        mtp_extra = 2 * H + 2 * H * H + H  # enorm, hnorm, eh_proj [H, 2H], shared_head.norm
        total = V * H * (1 if self.tie_word_embeddings else 2) + H  # embed, head, final norm
        for layer in range(self.num_hidden_layers + self.num_mtp_layers):
            total += self.attention_num_parameters(layer) + 2 * H  # + input/post-attn norms
            total += dense_mlp if layer < self.n_dense_layers else moe_mlp
            total += mtp_extra if layer >= self.num_hidden_layers else 0
        return total

    def attention_num_parameters(self, layer: int) -> int:
        """Parameters of the attention of decoder layer `layer` (MTP layers follow the stack)."""
        H, nh = self.hidden_size, self.num_attention_heads
        if self.attention == "gqa":
            hd, nkv = self.head_dim_resolved, self.num_key_value_heads
            n = H * nh * hd * 2 + H * nkv * hd * 2
            n += (nh * hd + 2 * nkv * hd) if self.attention_bias else 0
            return n + (2 * hd if self.use_qk_norm else 0)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        r, c, v = self.q_lora_rank, self.kv_lora_rank, self.v_head_dim
        n = (H * r + r + r * nh * qk) if r is not None else H * nh * qk  # q_a, its norm, q_b
        n += H * (c + self.qk_rope_head_dim) + c + c * nh * (self.qk_nope_head_dim + v)
        n += nh * v * H
        if self.attention_bias:  # q_a_proj, kv_a_proj_with_mqa, o_proj (q_proj has none)
            n += (r or 0) + c + self.qk_rope_head_dim + H
        if self.uses_dsa and self.layer_indexer_type(layer) == "full":
            d, m = self.index_head_dim, self.index_n_heads
            n += r * m * d + H * d + 2 * d + H * m  # wq_b, wk, k_norm (w, b), weights_proj
        return n


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
