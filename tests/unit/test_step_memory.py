"""recipes.step_memory: the activation bytes it counts are what autograd really saves."""

import pytest
import torch

from models.glm import GLMForCausalLM, get_preset
from models.glm.model.layers import rope_cos_sin
from models.glm.model.model import chunked_cross_entropy
from recipes.step_memory import (
    head_bytes_per_token,
    layer_activation_bytes,
)
from tests.models import mixed_precision_model

CONFIGS = {
    "small": get_preset("small"),  # qk-norm, grouped routing, scaling 2.5
    "air-like": get_preset(  # attention biases, no qk-norm, GQA 4:1
        "glm45_air",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_mtp_layers=0,
    ),
}
# MLA + DSA with equal q/k and v head widths (16 + 8 = 24, as GLM-5's 192 + 64 = 256), so SDPA
# takes the fused kernel with the sparse mask on CPU too; index_topk 16 < T, a "shared" layer
# and an MTP layer (which runs its own indexer).
# Every dsa_impl: the sparse paths (latent, per_head) and the masked reference.
MLA_CONFIGS = {
    f"mla-{impl}-{mode}": get_preset(
        "mla_tiny", v_head_dim=24, attention_bias=True, indexer_training=mode, dsa_impl=impl
    )
    for mode in ("frozen", "kl")
    for impl in ("latent", "per_head", "masked")
}


def saved_bytes(fn, params) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while running fn()."""
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_bytes_match_autograd(name, dtype):
    config = CONFIGS[name]
    model = mixed_precision_model(config, dtype)
    B, T = 2, 48
    cos, sin = rope_cos_sin(T, config.rotary_dim, config.rope_theta, "cpu")
    itemsize = torch.finfo(dtype).bits // 8
    params = [*model.parameters(), cos, sin]  # the shared rope tables are not per layer
    for i, layer in enumerate(model.model.layers):
        h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)
        got = saved_bytes(lambda layer=layer, h=h: layer(h, cos, sin), params)
        want = layer_activation_bytes(config, i, layer.is_moe, itemsize, 1, B, T)
        assert got == want, (name, dtype, i)
    # The loss head: final norm, chunked cross-entropy (it saves its input, a view of the
    # normed output, and the targets; and the embedding ids).
    ids = torch.randint(0, config.vocab_size, (B, T + 1))

    def head():
        h = model.model.embed_tokens(ids[:, :-1])
        target = ids[:, 1:].reshape(B, T)
        chunked_cross_entropy(model.lm_head, model.model.norm(h), target, chunk_tokens=20)

    got = saved_bytes(head, params)
    # Slack: the embedding's ids are a view of `ids`, whose storage holds one more int64
    # column (B * 8 bytes), and the mean divides by an int64 token count (8 bytes).
    slack = got - B * T * head_bytes_per_token(config, itemsize)
    assert slack == B * 8 + 8, (name, dtype, slack)


@pytest.mark.parametrize("name", sorted(MLA_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_dsa_mtp_activation_bytes_match_autograd(name, dtype):
    config = MLA_CONFIGS[name]
    model = mixed_precision_model(config, dtype)
    for mtp in model.model.mtp_layers:
        mtp.mlp.gate.weight.data = mtp.mlp.gate.weight.data.float()
    B, T = 2, 24
    assert config.index_topk < T  # the sparse path
    cos, sin = rope_cos_sin(T, config.rotary_dim, config.rope_theta, "cpu")
    itemsize = torch.finfo(dtype).bits // 8
    params = [*model.parameters(), cos, sin]
    kl = config.indexer_training == "kl"
    topk = None
    for i, layer in enumerate(model.model.layers):
        h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)
        out = []

        def run(layer=layer, h=h, topk=topk if layer.reads_topk else None, out=out):
            out.append(layer(h, cos, sin, topk, kl))

        got = saved_bytes(run, params)
        topk = out[0][1]
        want = layer_activation_bytes(config, i, layer.is_moe, itemsize, 1, B, T)
        assert got == want, (name, dtype, i, got - want)
    # The embedding's ids and the targets are two tensors, as in forward (rolled copies).
    ids, target = (torch.randint(0, config.vocab_size, (B, T)) for _ in range(2))
    (mtp,) = model.model.mtp_layers
    h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)

    def mtp_step():
        emb = model.model.embed_tokens(ids)
        normed, _, _ = mtp(h, emb, cos, sin, None, kl)
        chunked_cross_entropy(model.lm_head, normed, target, chunk_tokens=20)

    got = saved_bytes(mtp_step, params)
    N = config.num_hidden_layers
    want = layer_activation_bytes(config, N, True, itemsize, 1, B, T)
    want += B * T * head_bytes_per_token(config, itemsize)
    # Slack: the loss mean's int64 token count.
    assert got - want == 8, (name, dtype, got - want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_mtp_layer_bytes_match_autograd(dtype):
    """A GQA MTP layer with its loss head: the decoder layer, its norms and eh_proj input
    (`layer_activation_bytes` of layer num_hidden_layers) plus a loss head."""
    config = get_preset("small", num_hidden_layers=2, num_mtp_layers=1)
    model = mixed_precision_model(config, dtype)
    B, T = 2, 48
    cos, sin = rope_cos_sin(T, config.rotary_dim, config.rope_theta, "cpu")
    itemsize = torch.finfo(dtype).bits // 8
    ids = torch.randint(0, config.vocab_size, (B, T + 1))
    h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)

    def mtp():
        emb = model.model.embed_tokens(ids[:, :-1].roll(-1, dims=1))
        normed, _, _ = model.model.mtp_layers[0](h, emb, cos, sin)
        chunked_cross_entropy(model.lm_head, normed, ids[:, 1:].reshape(B, T), chunk_tokens=20)

    got = saved_bytes(mtp, [*model.parameters(), cos, sin])
    want = layer_activation_bytes(config, 2, True, itemsize, 1, B, T)
    want += B * T * head_bytes_per_token(config, itemsize)
    # Slack: the loss mean's int64 token count (both id tensors are fresh [B, T] copies
    # here: the rolled ids and the reshaped targets).
    assert got - want == 8, dtype


def test_planner_counts_one_mtp_run_and_head_per_depth():
    """mtp_depths 3 on one MTP layer: three runs of that layer and four loss heads (one
    cross-entropy chunk recomputed at a time), against one depth."""
    from recipes.step_memory import (
        estimate_step_memory,
        indexer_kl_bytes_per_token,
        layer_activation_bytes,
    )

    def estimate(**overrides):
        model = GLMForCausalLM(get_preset("mla_tiny", **overrides))
        opt = torch.optim.AdamW(model.parameters())
        kw = dict(ep=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw |= dict(ns_itemsize=2, nesterov=True, max_inflight=1, gloo=False)
        return model.config, estimate_step_memory(
            model, opt, tokens=64, seq_len=32, activation_checkpointing=False, **kw
        )

    config, one = estimate()
    _, three = estimate(mtp_depths=3)
    N = config.num_hidden_layers
    mtp_layer = layer_activation_bytes(config, N, True, 2, 1, 2, 32)
    # Depths 2 and 3 attend depth 1's kept keys (index_share_for_mtp_iteration): they run no
    # indexer, so they save none of its KL's tensors.
    reused = mtp_layer - 64 * indexer_kl_bytes_per_token(config, 2, 32)
    got = three.parts["activations (all layers)"] - one.parts["activations (all layers)"]
    assert got == 2 * reused
    assert three.parts["loss head activations"] * 2 == one.parts["loss head activations"] * 4
    chunk = "loss head chunk (recomputed)"
    # One chunk's logits (bf16 and float32) and the float32 sum of lm_head's weight gradient.
    want = 64 * config.vocab_size * (4 + 2) + 4 * config.vocab_size * config.hidden_size
    assert three.parts[chunk] == one.parts[chunk] == want
