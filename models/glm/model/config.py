"""GLM-MoE model configuration (the named presets: models/glm/model/presets.py).

`GLMConfig` holds the shape and numerics of a GLM-4.5 / GLM-5 style decoder-only MoE model; field
names follow transformers' `Glm4MoeConfig` (models/glm/hf/config.py maps them) except
`n_dense_layers` (HF `first_k_dense_replace`) and `num_mtp_layers` (HF `num_nextn_predict_layers`).
A bad combination fails at construction with a message naming the field and what is allowed
(the checks: models/glm/model/config_checks.py).

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

from models.glm.model.config_checks import (
    ATTENTION_CHOICES,
    DSA_IMPLS,
    INDEXER_TRAINING_CHOICES,
    INDEXER_TYPES,
    check_config,
    index_share_types,
)

# the allowed values and the IndexShare schedule, defined with the checks
__all__ = [
    "ATTENTION_CHOICES",
    "DSA_IMPLS",
    "INDEXER_TRAINING_CHOICES",
    "INDEXER_TYPES",
    "GLMConfig",
    "index_share_types",
]


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
        check_config(self)

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
