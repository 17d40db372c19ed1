"""Single-device GLM-MoE model: formula parity with transformers' Glm4Moe forward, config
validation, presets on the meta device, router bias balancing, Muon metadata."""

import math

import pytest
import torch
import torch.nn.functional as F

from models.glm import GLMConfig, GLMForCausalLM, get_preset
from models.glm.model.layers import apply_partial_rope, rope_cos_sin
from tests.models import TINY_GLM

CFG_KW = dict(
    TINY_GLM,
    head_dim=12,
    partial_rotary_factor=0.5,
    num_experts_per_tok=3,
    n_shared_experts=2,
    rms_norm_eps=1e-5,
)


def _randomized(cfg: GLMConfig, seed: int = 0) -> GLMForCausalLM:
    """A model whose norms, biases and correction biases are far from their defaults."""
    torch.manual_seed(seed)
    model = GLMForCausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.5 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        for r in model.routers():
            r.e_score_correction_bias.copy_(0.3 * torch.randn_like(r.e_score_correction_bias))
    return model


# ---- an independent, plain transcription of transformers' Glm4Moe forward math ----


def _ref_rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _ref_rope(x, rd, theta):  # x [T, heads, hd]; explicit per-channel pairing i <-> i + rd/2
    T = x.shape[0]
    out = x.clone()
    half = rd // 2
    for j in range(half):
        inv = theta ** (-(2 * j) / rd)
        a = torch.arange(T, dtype=torch.float32) * inv
        c, s = a.cos()[:, None], a.sin()[:, None]
        out[:, :, j] = x[:, :, j] * c - x[:, :, j + half] * s
        out[:, :, j + half] = x[:, :, j + half] * c + x[:, :, j] * s
    return out


def _ref_swiglu(x, g, u, d):
    return (F.silu(x @ g.T) * (x @ u.T)) @ d.T


def _ref_forward(sd, cfg: GLMConfig, ids):  # one sequence ids [T] -> logits [T, V]
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    hd, rd, E, I = (
        cfg.head_dim_resolved,
        cfg.rotary_dim,
        cfg.n_routed_experts,
        cfg.moe_intermediate_size,
    )
    T = ids.shape[0]
    h = sd["model.embed_tokens.weight"][ids]
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = _ref_rms(h, sd[p + "input_layernorm.weight"], eps)

        def proj(name, x=x, p=p):
            y = x @ sd[p + f"self_attn.{name}.weight"].T
            b = sd.get(p + f"self_attn.{name}.bias")
            return y if b is None else y + b

        q, k, v = proj("q_proj").view(T, nh, hd), proj("k_proj").view(T, nkv, hd), proj("v_proj")
        v = v.view(T, nkv, hd)
        if cfg.use_qk_norm:
            q = _ref_rms(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = _ref_rms(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = _ref_rope(q, rd, cfg.rope_theta), _ref_rope(k, rd, cfg.rope_theta)
        heads = []
        for hh in range(nh):
            kv = hh // (nh // nkv)
            scores = (q[:, hh] @ k[:, kv].T) * hd**-0.5
            scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            heads.append(torch.softmax(scores.float(), -1) @ v[:, kv])
        h = h + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        x = _ref_rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        if layer < cfg.n_dense_layers:
            m = p + "mlp."
            y = _ref_swiglu(
                x, sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"], sd[m + "down_proj.weight"]
            )
        else:
            m = p + "mlp."
            s = torch.sigmoid(x.float() @ sd[m + "gate.weight"].float().T)
            c = s + sd[m + "gate.e_score_correction_bias"]
            G = cfg.n_group
            if G > 1:
                cg = c.view(T, G, E // G)
                gs = cg.topk(2, -1).values.sum(-1)
                keep = torch.zeros(T, G, dtype=torch.bool)
                keep.scatter_(1, gs.topk(cfg.topk_group, -1).indices, True)
                c = cg.masked_fill(~keep[..., None], float("-inf")).view(T, E)
            idx = c.topk(cfg.num_experts_per_tok, -1).indices
            w = s.gather(1, idx)
            if cfg.norm_topk_prob:
                w = w / (w.sum(-1, keepdim=True) + 1e-20)
            w = w * cfg.routed_scaling_factor
            gu = sd[m + "experts.gate_up_proj"].view(E, 2 * I, -1)
            dn = sd[m + "experts.down_proj"].view(E, -1, I)
            y = torch.zeros_like(x)
            for t in range(T):
                for kk in range(idx.shape[1]):
                    e = idx[t, kk]
                    y[t] += w[t, kk] * _ref_swiglu(x[t], gu[e, :I], gu[e, I:], dn[e])
            y = y + _ref_swiglu(
                x,
                sd[m + "shared_experts.gate_proj.weight"],
                sd[m + "shared_experts.up_proj.weight"],
                sd[m + "shared_experts.down_proj.weight"],
            )
        h = h + y
    return _ref_rms(h, sd["model.norm.weight"], eps) @ sd["lm_head.weight"].T


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(attention_bias=True, use_qk_norm=True, n_group=4, topk_group=2, norm_topk_prob=False),
        dict(tie_word_embeddings=True, head_dim=None, partial_rotary_factor=0.25, n_dense_layers=0),
    ],
)
def test_forward_matches_reference_formulas(overrides):
    cfg = GLMConfig(**{**CFG_KW, **overrides})
    model = _randomized(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids)
        sd = model.state_dict()
        ref = torch.stack([_ref_forward(sd, cfg, ids[b]) for b in range(2)])
    assert logits.shape == (2, 7, cfg.vocab_size)
    assert 0.3 < logits.abs().mean() < 30  # logits O(1): the comparison is meaningful
    # float32 in both, other kernels and summation orders: a few 2^-24 ulps per op on O(1)
    # logits, through a handful of layers: 1e-5 relative, 2e-5 absolute leave a wide margin.
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=2e-5)


def test_rope_half_split_on_first_channels_only():
    T, hd, rd = 5, 8, 4
    x = torch.randn(1, T, 3, hd)
    cos, sin = rope_cos_sin(T, rd, 10000.0, torch.device("cpu"))
    out = apply_partial_rope(x, cos, sin)
    torch.testing.assert_close(out[..., rd:], x[..., rd:], rtol=0, atol=0)
    torch.testing.assert_close(out[0], _ref_rope(x[0], rd, 10000.0))
    torch.testing.assert_close(out[:, 0], x[:, 0])  # position 0 is not rotated


def test_router_sigmoid_bias_only_selects_and_scaled_weights():
    cfg = GLMConfig(**CFG_KW)
    model = _randomized(cfg)
    router = model.routers()[0]
    x = torch.randn(6, cfg.hidden_size)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[5] = 100.0  # expert 5 always chosen, weight unbiased
        idx, w = router(x)
    s = torch.sigmoid(x @ router.weight.T)
    assert (idx == 5).any(-1).all()
    raw = s.gather(1, idx)
    torch.testing.assert_close(w, raw / raw.sum(-1, keepdim=True) * 2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((6,), 2.5))
    assert w.dtype == torch.float32
    assert router.expert_load.sum() == 6 * cfg.num_experts_per_tok
    assert router.expert_load[5] == 6


def test_router_bias_update_moves_load_toward_balance():
    cfg = GLMConfig(**CFG_KW)
    model = _randomized(cfg)
    with torch.no_grad():
        for r in model.routers():
            r.e_score_correction_bias.zero_()
            r.e_score_correction_bias[:3] = 0.5  # skew: experts 0..2 take most tokens
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(2))

    def imbalance():
        with torch.no_grad():
            model(ids)
        # counts only (rate 0 leaves the bias unchanged)
        return model.apply_router_bias_update(model.expert_loads(), 0.0)

    def spread(loads):
        return (loads.max(-1).values / loads.mean(-1)).mean().item()

    before = spread(imbalance())
    for _ in range(40):
        with torch.no_grad():
            model(ids)
        loads = model.apply_router_bias_update(model.expert_loads(), 0.02)
        assert all(r.expert_load.sum() == 0 for r in model.routers())  # counts were reset
    after = spread(imbalance())
    assert before > 2.2, before
    assert after < 1.3, (before, after)
    # The rule itself: underloaded experts go up by rate, overloaded down.
    r = model.routers()[0]
    bias0 = r.e_score_correction_bias.clone()
    with torch.no_grad():
        model(ids)
    loads = model.apply_router_bias_update(model.expert_loads(), 0.01)
    expected = 0.01 * torch.sign(loads[0].mean() - loads[0])
    torch.testing.assert_close(r.e_score_correction_bias - bias0, expected)
    assert r.e_score_correction_bias.grad is None and not r.e_score_correction_bias.requires_grad


def test_muon_metadata_and_init_determinism():
    cfg = get_preset("tiny")
    model = GLMForCausalLM(cfg)
    E = cfg.n_routed_experts
    moe = model.model.layers[1].mlp
    assert moe.experts.orthogonal_blocks == {"gate_up_proj": 2 * E, "down_proj": E}
    assert moe.experts.gate_up_proj.shape == (E * 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert moe.experts.down_proj.shape == (E * cfg.hidden_size, cfg.moe_intermediate_size)
    assert moe.gate.param_roles == {"weight": "router"}
    assert model.lm_head.param_roles == {"weight": "head"}
    model.init_weights(3)
    other = GLMForCausalLM(cfg)
    other.init_weights(3)
    for (n, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    w = moe.experts.gate_up_proj
    assert abs(w.std().item() - cfg.initializer_range) < 2e-3
    assert torch.equal(model.model.norm.weight, torch.ones(cfg.hidden_size))


def test_tiny_preset_shape():
    cfg = get_preset("tiny")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.n_dense_layers) == (
        256,
        64,
        3,
        1,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok) == (8, 32, 2)
    assert (cfg.n_shared_experts, cfg.intermediate_size, cfg.n_group) == (1, 128, 1)


@pytest.mark.parametrize("name", ["tiny", "small", "glm45_air", "glm5", "glm52"])
def test_presets_build_on_meta_with_formula_param_count(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = GLMForCausalLM(cfg)
    model.init_weights(0)  # a no-op on meta, must not fail
    assert model.num_parameters() == cfg.expected_num_parameters()
    n_moe = sum(1 for m in model.modules() if hasattr(m, "orthogonal_blocks"))
    assert n_moe == cfg.num_moe_layers


def test_glm5_preset_shapes_and_count():
    cfg = get_preset("glm5")
    with torch.device("meta"):
        model = GLMForCausalLM(cfg)
    experts = [m for m in model.modules() if hasattr(m, "orthogonal_blocks")]
    assert len(experts) == 76  # 78 layers - 3 dense + 1 MTP layer
    assert experts[0].gate_up_proj.shape == (1048576, 6144)
    assert experts[0].down_proj.shape == (1572864, 2048)
    assert model.model.layers[3].mlp.gate.weight.shape == (256, 6144)
    n = model.num_parameters()
    # Dominated by 76 layers x 256 experts x 3 x 6144 x 2048.
    assert 76 * 256 * 3 * 6144 * 2048 < n < 7.8e11
    assert 6.5e11 < n < 8e11
    # 743_911_199_232 without the MTP layer: the count of transformers'
    # GlmMoeDsaForCausalLM(GlmMoeDsaConfig()) (the public GLM-5 shapes) built on meta.
    assert cfg.expected_num_parameters() == n == 753_864_119_552
    attn = model.model.layers[0].self_attn
    assert attn.q_b_proj.weight.shape == (64 * 256, 2048)
    assert attn.kv_b_proj.weight.shape == (64 * 448, 512)
    assert attn.indexer.wq_b.weight.shape == (32 * 128, 2048)


def test_glm52_preset_is_glm5_with_index_share_rope_and_token_ids():
    """GLM-5.2 (InternLM xtuner's Glm52MoEConfig): the GLM-5 fields but RoPE theta, positions,
    IndexShare and the token ids; layer i's keys come from the nearest full layer <= i."""
    glm5, glm52 = get_preset("glm5").to_dict(), get_preset("glm52").to_dict()
    differ = {k for k in glm5 if glm5[k] != glm52[k]}
    assert differ == {
        "rope_theta",
        "max_position_embeddings",
        "indexer_types",
        "eos_token_id",
        "pad_token_id",
    }
    cfg = get_preset("glm52")
    assert (cfg.rope_theta, cfg.max_position_embeddings) == (8e6, 1_048_576)
    assert (cfg.eos_token_id, cfg.pad_token_id) == ([154820, 154827, 154829], 154820)
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert full == [0, 1, 2, *range(6, 78, 4)] and len(full) == 21
    # xtuner's dsa_topk_source_layer: walk down while max(i + 1 - offset, 0) % freq != 0.
    for i in range(78):
        src = i
        while max(src + 1 - 3, 0) % 4:
            src -= 1
        assert cfg.indexer_source_layer(i) == src, i
    assert cfg.indexer_source_layer(78) == 78  # the MTP layer runs its own indexer
    with torch.device("meta"):
        model = GLMForCausalLM(cfg)
    assert [i for i, x in enumerate(model.model.layers) if x.self_attn.indexer] == full
    # 743_377_000_704 without the MTP layer: transformers' GlmMoeDsaForCausalLM of
    # GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3) built on meta.
    assert cfg.expected_num_parameters() == model.num_parameters() == 753_329_921_024
    assert get_preset("glm52", num_mtp_layers=0).expected_num_parameters() == 743_377_000_704


def test_max_position_embeddings_enforced():
    cfg = GLMConfig(**{**CFG_KW, "max_position_embeddings": 4})
    model = GLMForCausalLM(cfg)
    model.init_weights(0)
    model(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_key_value_heads=3), r"num_key_value_heads \(3\) must divide num_attention_heads"),
        (dict(head_dim=None, hidden_size=30), r"num_attention_heads \(4\) must divide hidden_size"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) must be <= n_routed_experts"),
        (dict(n_group=3), r"n_group \(3\) must divide n_routed_experts \(8\)"),
        (dict(n_group=8, topk_group=4), r"n_group \(8\) leaves 1 expert per group"),
        (dict(n_group=4, topk_group=5), r"topk_group \(5\) must be <= n_group"),
        (dict(n_group=4, topk_group=1), r"topk_group \(1\) groups of 2 experts hold fewer"),
        (dict(n_dense_layers=4), r"n_dense_layers \(4\) must be <= num_hidden_layers"),
        (dict(partial_rotary_factor=0.1), r"partial_rotary_factor .* must be even and >= 2"),
        (dict(hidden_size=0), r"hidden_size must be a positive int"),
        (dict(routed_scaling_factor=0.0), r"routed_scaling_factor must be > 0"),
    ],
)
def test_bad_configs_fail_naming_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        GLMConfig(**{**CFG_KW, **overrides})


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown GLM preset 'nope'; choose one of"):
        get_preset("nope")


def test_the_moved_statistics_methods_fail_naming_their_new_place():
    """The model's cross-rank statistics and QK-clip moved to models.glm.infra: calling the old
    methods is an error naming the function to call (never a silently local result)."""
    import pytest

    from models.glm import GLMForCausalLM
    from tests.models import tiny_glm

    model = GLMForCausalLM(tiny_glm())
    with pytest.raises(AttributeError, match="infra.statistics.take_max_logits"):
        model.take_max_logits()
    with pytest.raises(AttributeError, match="infra.statistics.update_router_bias"):
        model.update_router_bias(0.001)
    with pytest.raises(AttributeError, match="infra.qk_clip.qk_clip_"):
        model.qk_clip_(None, 1.0)
