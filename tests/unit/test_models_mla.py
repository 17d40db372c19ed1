"""Multi-head latent attention + DeepSeek Sparse Attention: numerically transformers'
GlmMoeDsaForCausalLM (the in-memory state dict loaded in-process), the sparsity matters, and
bad MLA / DSA combinations fail at construction naming the field."""

import dataclasses

import pytest
import torch

from models.glm import GLMConfig, GLMForCausalLM, get_preset

transformers = pytest.importorskip("transformers")

T = 32  # > index_topk (8): queries from position 8 on attend a strict subset of their keys
TOPK = 8
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _ours(rope_scaling=None, index_topk=TOPK, dsa_impl="latent") -> GLMConfig:
    """mla_tiny (3 layers, the middle one shared) with 8 indexer heads, attention biases and
    no MTP layer (transformers' model has none); `dsa_impl`: the sparse path by default."""
    return get_preset(
        "mla_tiny",
        index_n_heads=8,
        index_topk=index_topk,
        attention_bias=True,
        max_position_embeddings=64,
        num_mtp_layers=0,
        rope_scaling=rope_scaling,
        dsa_impl=dsa_impl,
    )


def _theirs(c: GLMConfig):
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        rope = {**c.rope_scaling, "rope_theta": c.rope_theta}
    hf = transformers.GlmMoeDsaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        first_k_dense_replace=c.n_dense_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=c.qk_nope_head_dim,
        qk_rope_head_dim=c.qk_rope_head_dim,
        v_head_dim=c.v_head_dim,
        index_n_heads=c.index_n_heads,
        index_head_dim=c.index_head_dim,
        index_topk=c.index_topk,
        indexer_types=c.indexer_types,
        attention_bias=c.attention_bias,
        n_routed_experts=c.n_routed_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        n_shared_experts=c.n_shared_experts,
        routed_scaling_factor=c.routed_scaling_factor,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=rope,
        rms_norm_eps=c.rms_norm_eps,
        pad_token_id=c.pad_token_id,
    )
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(hf).eval()
    model.config._experts_implementation = "eager"
    with torch.no_grad():  # away from the init's ones and zeros, so a swapped norm shows
        for name, p in model.named_parameters():
            noise = torch.randn_like(p)
            if p.ndim == 1:
                p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.2 * noise)
            else:  # std 0.5 / sqrt(fan_in): activations and logits of order one
                p.copy_(noise * 0.5 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def _load_theirs(ours: GLMForCausalLM, theirs) -> None:
    """transformers' in-memory keys are ours, but for the fused 3-D experts (ours are 2-D)."""
    state = {}
    for key, value in theirs.state_dict().items():
        if key.endswith("experts.gate_up_proj") or key.endswith("experts.down_proj"):
            value = value.reshape(-1, value.shape[-1])
        state[key] = value
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not missing, missing


def _hook_topk(model, cls_name: str, found: list) -> list:
    handles = []
    for m in model.modules():
        if type(m).__name__ == cls_name:
            handles.append(m.register_forward_hook(lambda _m, _i, out: found.append(out)))
    return handles


@pytest.mark.parametrize("dsa_impl", ["latent", "per_head", "masked"])
@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default_rope", "yarn"])
def test_logits_equal_transformers_glm_moe_dsa(rope_scaling, dsa_impl):
    config = _ours(rope_scaling, dsa_impl=dsa_impl)
    theirs = _theirs(config)
    ours = GLMForCausalLM(config).eval()
    _load_theirs(ours, theirs)
    ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    their_topk: list = []
    handles = _hook_topk(theirs, "GlmMoeDsaIndexer", their_topk)
    with torch.no_grad():
        ref = theirs(ids).logits
        our_scores = []
        for layer in ours.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.register_forward_hook(
                    lambda _m, _i, out: our_scores.append(out)
                )
        got = ours(ids)
    for h in handles:
        h.remove()
    # The same keys are kept: compare the kept sets of the two "full" layers (the shared
    # layer reuses layer 0's), with the causal ones only (ties among masked keys are free).
    assert len(their_topk) == len(our_scores) == 2
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for theirs_k, (ours_k, _) in zip(their_topk, our_scores, strict=True):
        a = torch.zeros(2, T, T, dtype=torch.bool).scatter_(-1, theirs_k.long(), True) & causal
        b = torch.zeros(2, T, T, dtype=torch.bool).scatter_(-1, ours_k, True) & causal
        assert torch.equal(a, b)
    # Tolerance: the two float32 forwards differ only in the order of their sums (einsum vs
    # matmul, SDPA vs eager softmax, fused vs per-expert GEMMs). Each stage then differs by a
    # few ulps of its output (eps = 1.2e-7, reductions of <= 128 terms with random signs grow
    # it ~sqrt(128) = 11x); about 40 stages (3 layers x ~12 ops + head) accumulate to
    # ~40 * 11 * 1.2e-7 = 5e-5 relative; with |logits| <= ~4 that is 2e-4. A wrong norm,
    # rotation, scale or kept key moves logits by > 1e-2.
    assert ref.abs().max() > 0.5  # the weights are not so small that every logit is ~0
    err = (got - ref).abs().max().item()
    assert err < 2e-4, err


def test_sparsity_matters():
    """The same weights with index_topk >= T (every causal key kept) give other logits."""
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(2))
    logits = []
    for topk in (TOPK, T):
        theirs = _theirs(_ours(index_topk=TOPK))
        ours = GLMForCausalLM(_ours(index_topk=topk)).eval()
        _load_theirs(ours, theirs)
        with torch.no_grad():
            logits.append(ours(ids))
    # The first TOPK positions see all their keys either way; later ones do not.
    assert torch.allclose(logits[0][:, :TOPK], logits[1][:, :TOPK], atol=1e-5)
    assert (logits[0][:, TOPK:] - logits[1][:, TOPK:]).abs().max() > 1e-2


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(attention="mla", kv_lora_rank=None), "kv_lora_rank"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(head_dim=16), "head_dim"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(use_qk_norm=True), "use_qk_norm"),
        (dict(index_head_dim=4), "index_head_dim"),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(indexer_types=["full", "shared"]), "indexer_types"),
        (dict(indexer_types=["shared", "full", "full"]), "indexer_types"),
        (dict(indexer_types=["full", "sparse", "full"]), "indexer_types"),
        (dict(index_topk=None), "index_n_heads"),
        (dict(indexer_training="train"), "indexer_training"),
        (dict(attention="dsa"), "attention"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2}), "rope_scaling"),
        (dict(rope_scaling={**YARN, "alpha": 1}), "rope_scaling"),
        (dict(qk_rope_head_dim=7, index_head_dim=16), "qk_rope_head_dim"),
    ],
)
def test_bad_mla_combinations_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"GLMConfig\.{field}\b"):
        get_preset("mla_tiny", **overrides)


def test_gqa_refuses_mla_fields():
    with pytest.raises(ValueError, match=r"GLMConfig\.kv_lora_rank\b.*attention='mla'"):
        GLMConfig(kv_lora_rank=16)


def test_dense_mla_without_q_lora():
    """q_lora_rank None is a full q_proj (DeepSeek-V2-Lite style), allowed without DSA."""
    config = get_preset(
        "mla_tiny",
        q_lora_rank=None,
        index_topk=None,
        index_n_heads=None,
        index_head_dim=None,
        indexer_types=None,
    )
    model = GLMForCausalLM(config)
    model.init_weights(0)
    assert model.num_parameters() == config.expected_num_parameters()
    assert hasattr(model.model.layers[0].self_attn, "q_proj")
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)


def test_pad_row_as_transformers_builds_it():
    """With pad_token_id set (GLM-5.2: its first eos id) the embedding's pad row starts at zero
    and takes no gradient, in our model as in transformers' GlmMoeDsaForCausalLM; the other
    rows the batch reads do."""
    pad = 7
    config = dataclasses.replace(_ours(), pad_token_id=pad)
    theirs = _theirs(config)
    ours = GLMForCausalLM(config)
    ours.init_weights(0)
    assert not ours.model.embed_tokens.weight[pad].any()
    ids = torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(3))
    ids[:, ::3] = pad
    their_embed = transformers.GlmMoeDsaForCausalLM(theirs.config).model.embed_tokens
    assert their_embed.padding_idx == pad and not their_embed.weight[pad].any()
    _load_theirs(ours, theirs)
    for model in (ours, theirs):
        model.zero_grad()
        out = model(ids)
        (out if isinstance(out, torch.Tensor) else out.logits).square().mean().backward()
    for model in (ours, theirs):
        grad = model.model.embed_tokens.weight.grad
        assert not grad[pad].any() and grad[ids[0, 1]].abs().max() > 0
    with pytest.raises(ValueError, match=r"GLMConfig\.pad_token_id \(256\) must be < vocab"):
        dataclasses.replace(config, pad_token_id=256)
