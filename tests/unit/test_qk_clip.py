"""QK-clip on one process: recording the max logits, clipping a head onto tau, leaving the rest."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
import torch

from models.glm import GLMForCausalLM
from models.glm.infra import qk_clip as clip
from models.glm.model import qk_clip as qk
from tests.models import tiny_glm

CFG = tiny_glm(
    num_hidden_layers=2,
    head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    attention_bias=True,
    routed_scaling_factor=1.0,
)
IDS = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))


def gqa_model(**overrides) -> GLMForCausalLM:
    torch.manual_seed(0)
    model = GLMForCausalLM(replace(CFG, **overrides))
    model.init_weights(0)
    with torch.no_grad():  # larger weights than init: logits of a few units
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            elif name.endswith("proj.bias"):  # nonzero, so that scaling them shows
                p.normal_(0.0, 0.1)
        attn = model.attentions()[0]
        attn.q_proj.weight[:8] *= 6.0  # query head 0 (KV group 0) far above the others
        attn.k_proj.weight[:8] *= 2.0
    return model


def _max_logits(model, ids=IDS) -> torch.Tensor:
    model.record_max_logits(True)
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    model.zero_grad()
    return model.take_local_max_logits()


def _reference_logits(model, ids=IDS) -> torch.Tensor:
    """Per layer and head, the max causal q.k/sqrt(K), by hooking the projections' inputs."""
    inputs = {}
    hooks = [
        a.q_proj.register_forward_hook(lambda m, x, y, i=i: inputs.__setitem__(i, x[0]))
        for i, a in enumerate(model.attentions())
    ]
    with torch.no_grad():
        model(ids[:, :-1])
    for h in hooks:
        h.remove()
    out = []
    from models.glm.model.layers import apply_partial_rope, rope_cos_sin

    T = ids.shape[1] - 1
    cos, sin = rope_cos_sin(
        T, model.config.rotary_dim, model.config.rope_theta, torch.device("cpu")
    )
    for i, a in enumerate(model.attentions()):
        x = inputs[i]
        q = a.q_proj(x).view(*x.shape[:2], a.n_heads, a.head_dim)
        k = a.k_proj(x).view(*x.shape[:2], a.n_kv_heads, a.head_dim)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        k = k.repeat_interleave(a.n_heads // a.n_kv_heads, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(a.head_dim)
        s = s.masked_fill(torch.ones(T, T).triu(1).bool(), -torch.inf)
        out.append(s.amax(dim=(0, 2, 3)))
    return torch.stack(out)


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_records_the_masked_max_logit_per_head(qk_norm):
    model = gqa_model(use_qk_norm=qk_norm)
    got = _max_logits(model)
    # the same float32 products in another order (einsum vs chunked matmul): a few ulps
    torch.testing.assert_close(got, _reference_logits(model), rtol=1e-5, atol=1e-5)
    assert got.shape == (2, 4)
    if not qk_norm:  # head 0 of layer 0 was scaled up (QK-norm cancels that scale)
        assert got[0, 0] == got.max()


def test_recording_spans_micro_batches_and_skips_eval_and_recompute(monkeypatch):
    model = gqa_model()
    model.record_max_logits(True)
    calls = []
    real = qk.head_max_logits

    def spy(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr("models.glm.model.qk_clip.head_max_logits", spy)
    halves = IDS[:1], IDS[1:]
    for half in halves:  # two micro-batches: the max over both
        model.loss(half[:, :-1], half[:, 1:]).backward()
    both = model.take_local_max_logits()
    expected = torch.maximum(
        _reference_logits(model, halves[0]), _reference_logits(model, halves[1])
    )
    torch.testing.assert_close(both, expected, rtol=1e-5, atol=1e-5)
    assert len(calls) == 4  # 2 layers x 2 micro-batches
    with torch.no_grad():
        model(IDS[:, :-1])  # evaluation: not recorded
    assert torch.isinf(model.take_local_max_logits()).all()
    for layer in model.model.layers:
        layer.checkpoint_activations = True
    calls.clear()
    model.loss(IDS[:, :-1], IDS[:, 1:]).backward()  # forward + recomputation in backward
    assert len(calls) == 2  # once per layer: the recomputation records nothing


def test_clip_puts_the_head_on_tau_and_leaves_the_rest():
    model = gqa_model()
    before = _max_logits(model)
    tau = float(before[0, 0]) * 0.5
    assert before[0, 1:].max() < tau and before[1].max() < tau  # only group 0 of layer 0
    snap = _snapshot(model)
    assert clip.qk_clip_(model, before, tau, alpha=0.5) == 1
    after = _max_logits(model)
    # logits are bilinear in the scaled rows: eta^a * eta^(1-a) = eta exactly up to fp32 rounding
    torch.testing.assert_close(after[0, 0], torch.tensor(tau), rtol=1e-5, atol=0)
    assert torch.equal(after[0, 2:], before[0, 2:])  # group 1 (layer 1 sees new inputs)
    eta = tau / float(before[0, 0])
    torch.testing.assert_close(after[0, 1], before[0, 1] * eta, rtol=1e-5, atol=0)  # same group
    now = _snapshot(model)
    changed = {n for n in snap if not torch.equal(snap[n], now[n])}
    prefix = "model.layers.0.self_attn."
    assert changed == {prefix + f"{p}_proj.{w}" for p in "qk" for w in ("weight", "bias")}
    q, k = prefix + "q_proj.weight", prefix + "k_proj.weight"
    assert torch.equal(now[q][16:], snap[q][16:]) and torch.equal(now[k][8:], snap[k][8:])
    torch.testing.assert_close(now[q][:16], snap[q][:16] * eta**0.5)
    torch.testing.assert_close(now[k][:8], snap[k][:8] * eta**0.5)


def test_clip_with_qk_norm_scales_the_norm_weights():
    # one layer: a clipped layer would change the next one's inputs
    model = gqa_model(use_qk_norm=True, num_hidden_layers=1)
    before = _max_logits(model)
    tau = float(before.max()) * 0.7
    snap = _snapshot(model)
    assert clip.qk_clip_(model, before, tau, alpha=0.25) >= 1
    after = _max_logits(model)
    # the norm weights are shared by the heads: every head shrinks by the layer's eta
    torch.testing.assert_close(after, before * (tau / float(before.max())), rtol=1e-5, atol=0)
    changed = {n for n in snap if not torch.equal(snap[n], _snapshot(model)[n])}
    assert changed == {f"model.layers.0.self_attn.{n}_norm.weight" for n in "qk"}


def test_below_tau_nothing_changes_bit_for_bit():
    model = gqa_model()
    before = _max_logits(model)
    snap = _snapshot(model)
    assert clip.qk_clip_(model, before, float(before.max()) + 1.0) == 0
    now = _snapshot(model)
    assert all(torch.equal(snap[n], now[n]) for n in snap)


def test_non_finite_logits_never_clip():
    logits = torch.tensor([float("nan"), float("inf"), 5.0, -float("inf")])
    assert torch.equal(clip.clip_factors(logits, 4, tau=1.0), torch.tensor([1.0, 1.0, 0.2, 1.0]))


def mla_model(num_hidden_layers: int = 1, q_lora: bool = True, **overrides) -> GLMForCausalLM:
    """The MLA preset with DSA (index_topk 4) on the low-rank query, or with `q_lora` off a full
    q_proj and dense MLA (the indexer reads the low-rank query); `overrides` replace fields."""
    from models.glm import get_preset

    torch.manual_seed(0)
    dsa = ("index_n_heads", "index_head_dim", "index_topk", "indexer_types")
    if q_lora:
        fields = dict(index_topk=4, indexer_types=["full"] * num_hidden_layers)
    else:
        fields = dict.fromkeys(("q_lora_rank", *dsa))
    config = get_preset(
        "mla_tiny",
        num_hidden_layers=num_hidden_layers,
        n_dense_layers=1,
        **{**fields, **overrides},
    )
    model = GLMForCausalLM(config)
    model.init_weights(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
        attn = model.attentions()[0]
        q = attn.q_b_proj if q_lora else attn.q_proj
        q.weight[:24] *= 4.0  # head 0: q_nope and q_rope rows
        attn.kv_b_proj.weight[:16] *= 2.0  # head 0: k_nope rows
    return model


def test_mla_clip_puts_the_head_on_tau_and_leaves_the_rotary_key():
    """MLA with DSA (index_topk 4 < T: the sparse mask is the one recorded under)."""
    model = mla_model()
    before = _max_logits(model)
    tau = float(before[0, 0]) * 0.5
    assert before[0, 1:].max() < tau
    snap = _snapshot(model)
    assert clip.qk_clip_(model, before, tau, alpha=0.5) == 1
    after = _max_logits(model)
    # q_nope.k_nope by eta^a * eta^(1-a), q_rope.k_rope by eta * 1: the head's logits by eta
    torch.testing.assert_close(after[0, 0], torch.tensor(tau), rtol=1e-5, atol=0)
    assert torch.equal(after[0, 1:], before[0, 1:])
    now = _snapshot(model)
    prefix = "model.layers.0.self_attn."
    changed = {n for n in snap if not torch.equal(snap[n], now[n])}
    assert changed == {prefix + "q_b_proj.weight", prefix + "kv_b_proj.weight"}
    eta = tau / float(before[0, 0])
    q, kv = prefix + "q_b_proj.weight", prefix + "kv_b_proj.weight"
    torch.testing.assert_close(now[q][:16], snap[q][:16] * eta**0.5)  # q_nope of head 0
    torch.testing.assert_close(now[q][16:24], snap[q][16:24] * eta)  # q_rope of head 0
    assert torch.equal(now[q][24:], snap[q][24:])
    torch.testing.assert_close(now[kv][:16], snap[kv][:16] * eta**0.5)  # k_nope of head 0
    assert torch.equal(now[kv][16:], snap[kv][16:])  # v of head 0 and the other heads


def test_mtp_attention_is_recorded_in_training_and_clipped():
    """MTP layers train in the training forward, so their attention is watched and clipped too:
    its row is finite after a forward with MTP, -inf after one without (never clipped)."""
    model = gqa_model(num_hidden_layers=1, num_mtp_layers=1)
    assert len(model.attentions()) == 2  # the layer's, then the MTP layer's
    assert torch.isinf(_max_logits(model)[1]).all()  # `loss` runs without MTP
    model.record_max_logits(True)
    out = model.losses(IDS[:, :-1], IDS[:, 1:])
    (out["loss"] + out["mtp_loss"]).backward()
    model.zero_grad()
    logits = model.take_local_max_logits()
    assert torch.isfinite(logits).all()
    snap = _snapshot(model)
    tau = float(logits[1].max()) * 0.5
    logits[0] = -torch.inf  # clip only the MTP layer's attention
    assert clip.qk_clip_(model, logits, tau) >= 1
    now = _snapshot(model)
    changed = {n for n in snap if not torch.equal(snap[n], now[n])}
    assert changed and all(n.startswith("model.mtp_layers.0.self_attn.") for n in changed)


@pytest.mark.parametrize(
    ("tau", "alpha", "error", "named"),
    [
        (0.0, 0.5, ValueError, "tau=0.0"),
        (-1.0, 0.5, ValueError, "tau=-1.0"),
        (float("nan"), 0.5, ValueError, "tau=nan"),
        (float("inf"), 0.5, ValueError, "tau=inf"),
        (True, 0.5, TypeError, "tau=True"),
        ("5", 0.5, TypeError, "tau='5'"),
        (1.0, 1.5, ValueError, "alpha=1.5"),
        (1.0, float("nan"), ValueError, "alpha=nan"),
        (1.0, None, TypeError, "alpha=None"),
    ],
)
def test_bad_tau_or_alpha_is_refused_before_any_write(tau, alpha, error, named):
    """tau <= 0 used to zero (tau = 0) or flip and NaN (tau < 0) the q/k weights."""
    model = gqa_model()
    before = _max_logits(model)
    snap = _snapshot(model)
    with pytest.raises(error, match=named.replace("'", ".")):
        clip.qk_clip_(model, before, tau, alpha)
    now = _snapshot(model)
    assert all(torch.equal(snap[n], now[n]) for n in snap)


def test_logits_of_the_wrong_shape_are_refused():
    attn = gqa_model().attentions()[0]
    with pytest.raises(ValueError, match=r"max_logit_N: shape \(3,\).*expected \(4,\)"):
        clip.clip_attention_(attn, torch.ones(3), 1.0, 0.5)


def test_a_nan_head_leaves_its_group_to_the_finite_heads():
    """One NaN head in a KV group used to make the group's maximum NaN: the group unclipped."""
    model = gqa_model()
    before = _max_logits(model)
    tau = float(before[0, 0]) * 0.5
    noisy = before.clone()
    noisy[0, 1] = float("nan")  # head 1 shares KV group 0 with head 0, which is over tau
    assert clip.qk_clip_(model, noisy, tau) == 1
    after = _max_logits(model)
    torch.testing.assert_close(after[0, 0], torch.tensor(tau), rtol=1e-5, atol=0)
    # a group with no finite head is not clipped (its weights would be zeroed by tau / inf)
    logits = torch.tensor([float("nan"), float("inf"), 5.0, float("nan")])
    assert torch.equal(clip.clip_factors(logits, 2, tau=1.0), torch.tensor([1.0, 0.2]))


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what would be a device -> host read on a GPU (`.item()`, `int()`, `bool()`)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [gqa_model, partial(gqa_model, use_qk_norm=True), mla_model])
def test_the_clip_is_decided_on_the_device(make):
    """No host read of the logits: eta, the rows and the count stay tensors."""
    model = make()
    before = _max_logits(model)
    tau = float(before.max()) * 0.5
    with _HostReads() as mode:
        clipped = clip.qk_clip_(model, before, tau)
    assert mode.reads == 0
    assert isinstance(clipped, torch.Tensor) and clipped >= 1
