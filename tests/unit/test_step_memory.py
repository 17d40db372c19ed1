"""recipes.step_memory: the activation bytes it counts are what autograd really saves."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models.glm import GLMForCausalLM, get_preset
from models.glm.layers import rope_cos_sin
from recipes.step_memory import (
    head_bytes_per_token,
    layer_activation_bytes,
)

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
MLA_CONFIGS = {
    f"mla-{mode}": get_preset("mla_tiny", v_head_dim=24, attention_bias=True, indexer_training=mode)
    for mode in ("frozen", "kl")
}


def _saved_bytes(fn, params) -> int:
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
    model = GLMForCausalLM(config)
    model.init_weights(0)
    model.to(dtype)
    for router in model.routers():  # as under FSDP2 mixed precision: routers stay float32
        router.weight.data = router.weight.data.float()
    B, T = 2, 48
    cos, sin = rope_cos_sin(T, config.rotary_dim, config.rope_theta, "cpu")
    itemsize = torch.finfo(dtype).bits // 8
    params = [*model.parameters(), cos, sin]  # the shared rope tables are not per layer
    for i, layer in enumerate(model.model.layers):
        h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)
        got = _saved_bytes(lambda layer=layer, h=h: layer(h, cos, sin), params)
        want = layer_activation_bytes(config, i, layer.is_moe, itemsize, 1, B, T)
        assert got == want, (name, dtype, i)
    # The loss head: final norm, lm_head, float32 log-softmax, targets (and the embedding ids).
    ids = torch.randint(0, config.vocab_size, (B, T + 1))

    def head():
        h = model.model.embed_tokens(ids[:, :-1])
        logits = model.lm_head(model.model.norm(h))
        torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)
        )

    got = _saved_bytes(head, params)
    # Slack: the embedding's ids are a view of `ids`, whose storage holds one more int64
    # column (B * 8 bytes), and cross-entropy saves a float32 scalar total weight (4 bytes).
    slack = got - B * T * head_bytes_per_token(config, itemsize)
    assert slack == B * 8 + 4, (name, dtype, slack)


@pytest.mark.parametrize("name", sorted(MLA_CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_dsa_mtp_activation_bytes_match_autograd(name, dtype):
    config = MLA_CONFIGS[name]
    model = GLMForCausalLM(config)
    model.init_weights(0)
    model.to(dtype)
    for router in model.routers():
        router.weight.data = router.weight.data.float()
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

        def run(layer=layer, h=h, topk=topk, out=out):
            out.append(layer(h, cos, sin, topk, kl))

        got = _saved_bytes(run, params)
        topk = out[0][1]
        want = layer_activation_bytes(config, i, layer.is_moe, itemsize, 1, B, T)
        assert got == want, (name, dtype, i, got - want)
    # The embedding's ids and the targets are two tensors, as in forward (rolled copies).
    ids, target = (torch.randint(0, config.vocab_size, (B, T)) for _ in range(2))
    (mtp,) = model.model.mtp_layers
    h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)

    def mtp_step():
        emb = model.model.embed_tokens(ids)
        _, normed, _ = mtp(h, emb, cos, sin, kl)
        logits = model.lm_head(normed)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

    got = _saved_bytes(mtp_step, params)
    N = config.num_hidden_layers
    want = layer_activation_bytes(config, N, True, itemsize, 1, B, T)
    want += B * T * head_bytes_per_token(config, itemsize)
    # Slack: cross-entropy's float32 scalar total weight.
    assert got - want == 4, (name, dtype, got - want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_mtp_layer_bytes_match_autograd(dtype):
    """A GQA MTP layer with its loss head: the decoder layer, its norms and eh_proj input
    (`layer_activation_bytes` of layer num_hidden_layers) plus a loss head."""
    config = get_preset("small", num_hidden_layers=2, num_mtp_layers=1)
    model = GLMForCausalLM(config)
    model.init_weights(0)
    model.to(dtype)
    for router in model.routers():
        router.weight.data = router.weight.data.float()
    B, T = 2, 48
    cos, sin = rope_cos_sin(T, config.rotary_dim, config.rope_theta, "cpu")
    itemsize = torch.finfo(dtype).bits // 8
    ids = torch.randint(0, config.vocab_size, (B, T + 1))
    h = torch.randn(B, T, config.hidden_size, dtype=dtype, requires_grad=True)

    def mtp():
        emb = model.model.embed_tokens(ids[:, :-1].roll(-1, dims=1))
        _, normed, _ = model.model.mtp_layers[0](h, emb, cos, sin)
        logits = model.lm_head(normed)
        torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1)
        )

    got = _saved_bytes(mtp, [*model.parameters(), cos, sin])
    want = layer_activation_bytes(config, 2, True, itemsize, 1, B, T)
    want += B * T * head_bytes_per_token(config, itemsize)
    # Slack: cross-entropy's float32 scalar total weight (both id tensors are fresh [B, T]
    # copies here: the rolled ids and the reshaped targets).
    assert got - want == 4, dtype


@pytest.mark.slow
def test_planner_prints_the_whole_step_estimate_against_a_budget():
    """`scripts/plan_memory.py --step` (fake 8-rank world): both checkpointing modes, the
    verdict against --budget-gib, and the exit status when nothing fits."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "plan_memory.py"
    args = [sys.executable, str(script), "--model", "small", "--world-size", "8", "--ep", "2"]
    args += ["--step", "--seq-len", "256", "--micro-batch", "2", "--strategy", "pad_all2all"]
    fits = subprocess.run([*args, "--budget-gib", "8"], capture_output=True, text=True)
    assert fits.returncode == 0, fits.stderr[-2000:]
    text = fits.stdout[fits.stdout.index("whole step per rank") :]
    peaks = [float(line.split()[4]) for line in text.splitlines() if "step peak per rank" in line]
    assert len(peaks) == 2 and 0 < peaks[1] < peaks[0], text  # checkpointing saves memory
    assert text.count("fits in 8 GiB") == 2
    tight = subprocess.run([*args, "--budget-gib", "0.001"], capture_output=True, text=True)
    assert tight.returncode == 1 and "DOES NOT FIT in 0.001 GiB" in tight.stdout
