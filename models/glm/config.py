"""GLM-MoE model configuration and named presets.

`GLMConfig` holds the shape and numerics of a GLM-4.5 / GLM-5 style decoder-only MoE model; field
names follow transformers' `Glm4MoeConfig` (models/glm/hf_config.py maps them) except
`n_dense_layers` (HF `first_k_dense_replace`) and `num_mtp_layers` (HF `num_nextn_predict_layers`).
A bad combination fails at construction with a message naming the field and what is allowed.

Multi-token prediction (MTP): `num_mtp_layers` extra MoE decoder layers are *built* (with their
`enorm`/`hnorm`/`eh_proj`/`shared_head.norm` parameters, as in the public GLM checkpoints, where
they are stored as `model.layers.{num_hidden_layers + i}`) so that the Muon planner, parameter
counts and checkpoints see the real layout. `forward`/`loss` do not run them. The GLM-5.2 preset
uses this to reach its 76 expert layers: 78 layers with 3 dense give 75, plus 1 MTP layer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


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
    num_mtp_layers: int = 0  # extra MoE layers built for MTP, not run by forward (see module doc)

    def __post_init__(self) -> None:
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
            if self.hidden_size % nh:
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
        rd = self.rotary_dim
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

    @property
    def head_dim_resolved(self) -> int:
        """The per-head width actually used: head_dim, or hidden_size // num_attention_heads."""
        return (
            self.head_dim
            if self.head_dim is not None
            else self.hidden_size // self.num_attention_heads
        )

    @property
    def rotary_dim(self) -> int:
        """Rotary channels per head (the first ones of each head)."""
        return int(self.head_dim_resolved * self.partial_rotary_factor)

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
        hd, nh, nkv = self.head_dim_resolved, self.num_attention_heads, self.num_key_value_heads
        E, I, F = self.n_routed_experts, self.moe_intermediate_size, self.intermediate_size
        attn = H * nh * hd * 2 + H * nkv * hd * 2
        if self.attention_bias:
            attn += nh * hd + 2 * nkv * hd
        if self.use_qk_norm:
            attn += 2 * hd
        layer_common = attn + 2 * H  # attention + input/post-attention norms
        dense_mlp = 3 * H * F
        moe_mlp = E * H + E * 3 * H * I + 3 * H * I * self.n_shared_experts
        mtp_extra = 2 * H + 2 * H * H + H  # enorm, hnorm, eh_proj [H, 2H], shared_head.norm
        total = V * H * (1 if self.tie_word_embeddings else 2) + H  # embed, head, final norm
        total += self.n_dense_layers * (layer_common + dense_mlp)
        total += (self.num_hidden_layers - self.n_dense_layers) * (layer_common + moe_mlp)
        total += self.num_mtp_layers * (layer_common + moe_mlp + mtp_extra)
        return total


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
    # GLM-5.2-like shapes: 78 layers (3 dense) + 1 MTP layer = 76 MoE layers.
    "glm52": GLMConfig(
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        n_dense_layers=3,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        use_qk_norm=True,
        n_routed_experts=256,
        num_experts_per_tok=8,
        routed_scaling_factor=2.5,
        rope_theta=1000000.0,
        num_mtp_layers=1,
    ),
}


def get_preset(name: str, **overrides) -> GLMConfig:
    """A fresh copy of the named preset ("tiny", "small", "glm45_air", "glm52"), with overrides."""
    if name not in _PRESETS:
        raise ValueError(f"unknown GLM preset {name!r}; choose one of {sorted(_PRESETS)}")
    return replace(_PRESETS[name], **overrides)


PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)
