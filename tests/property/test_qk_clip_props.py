"""Properties of QK-clip (`models.glm.infra.qk_clip`) on generated inputs: GQA (1, 2 or 4 KV
heads, with q/k biases), GQA with QK-norm, MLA (low-rank query with DSA, full q_proj); per head
weights scaled at random so the logits spread; tau a fraction of the largest logit or any
number; alpha in [0, 1] or not; the recorded max logits with NaN / +-inf written over some heads.

Either the clip refuses, naming tau, alpha or max_logit_N, and no weight changed; or, per unit
(GQA: KV group, MLA: head, QK-norm: the layer), with S the largest finite given logit of its
heads: a unit with S <= tau (or no finite head) keeps its weights and its logits bit for bit;
a unit with S > tau has every logit scaled by eta = tau / S, so each head that was given a
finite logit ends at or under tau.

The models run in float64 (the recording promotes to it) with one layer (a clipped layer would
change the next one's inputs). Tolerance: the clipped logits equal eta x the recorded ones in
exact arithmetic (the logit is bilinear in the scaled rows, RoPE and the RMS norm are linear in
them); in float64 they differ by the rounding of eta, of its powers and of the scaled weights
(a few u, u = 2^-53 ~ 1.1e-16) and of the recomputed dot products (<= D + K + 2 < 100 terms:
<= 100 u of the sum of |terms|). With weights of RMS <= e^2 / sqrt(fan-in) and normalized
inputs, the sum of |terms| is within a factor 10^3 of the layer's largest |logit|, so
|after - eta before| <= 1e-9 max|before| holds with two orders of magnitude to spare (float32
rounding, 6e-8 per operation, would not).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from models.glm.infra.qk_clip import qk_clip_
from tests.unit.test_qk_clip import IDS, gqa_model, mla_model

RTOL = 1e-9  # of the layer's largest |logit|: see the module docstring

VARIANTS = {
    "gqa_kv1": lambda: gqa_model(num_hidden_layers=1, num_key_value_heads=1),
    "gqa_kv2": lambda: gqa_model(num_hidden_layers=1),
    "gqa_kv4": lambda: gqa_model(num_hidden_layers=1, num_key_value_heads=4),
    "gqa_qk_norm": lambda: gqa_model(num_hidden_layers=1, use_qk_norm=True),
    "mla_dsa": lambda: mla_model(1),  # + its MTP layer's attention, unseen: -inf, never clipped
    "mla_q_proj": lambda: mla_model(1, q_lora=False),
}


@functools.cache
def _base(variant: str):
    return VARIANTS[variant]().double()


def _query_rows(attn) -> tuple[torch.nn.Linear, int]:
    """The projection holding the query rows and the rows per query head."""
    if hasattr(attn, "kv_b_proj"):
        q = attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj
        return q, attn.nope + attn.rope
    return attn.q_proj, attn.head_dim


def _spread(model, seed: int) -> None:
    """Scale each query head's rows by e^z, z ~ N(0, 1): the heads' logits spread apart."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in model.attentions():
            q, rows = _query_rows(attn)
            z = torch.randn(attn.n_heads, generator=g, dtype=torch.float64).clamp(-2, 2)
            q.weight.mul_(z.exp().repeat_interleave(rows)[:, None])


def _record(model) -> torch.Tensor:
    model.record_max_logits(True)
    with torch.enable_grad():  # a training forward records; no backward needed
        model(IDS[:, :-1])
    return model.take_local_max_logits()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _qk_norm(attn) -> bool:
    return getattr(attn, "q_norm", None) is not None


def _units(attn) -> list[list[int]]:
    """The heads of each unit the clip scales together."""
    n = attn.n_heads
    if hasattr(attn, "kv_b_proj"):
        return [[h] for h in range(n)]
    if _qk_norm(attn):
        return [list(range(n))]
    rep = n // attn.n_kv_heads
    return [list(range(g * rep, (g + 1) * rep)) for g in range(attn.n_kv_heads)]


def _unit_params(prefix: str, attn, heads: list[int]) -> dict[str, slice]:
    """The rows of the unit's heads in each parameter the clip may scale (contiguous)."""
    lo, hi = heads[0], heads[-1] + 1
    if hasattr(attn, "kv_b_proj"):
        q, rows = _query_rows(attn)
        name = "q_b_proj" if hasattr(attn, "q_b_proj") else "q_proj"
        kv = attn.nope + attn.v_dim
        return {
            f"{prefix}{name}.weight": slice(lo * rows, hi * rows),
            f"{prefix}kv_b_proj.weight": slice(lo * kv, hi * kv),
        }
    if _qk_norm(attn):
        return {f"{prefix}{n}_norm.weight": slice(None) for n in "qk"}
    K, rep = attn.head_dim, attn.n_heads // attn.n_kv_heads
    g0, g1 = lo // rep, hi // rep
    out = {}
    for w in ("weight", "bias"):
        out[f"{prefix}q_proj.{w}"] = slice(lo * K, hi * K)
        out[f"{prefix}k_proj.{w}"] = slice(g0 * K, g1 * K)
    return out


NON_FINITE = st.sampled_from([float("nan"), float("inf"), -float("inf")])


@given(
    variant=st.sampled_from(sorted(VARIANTS)),
    seed=st.integers(0, 2**16),
    fraction=st.floats(0.05, 1.5),
    alpha=st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0)),
    poison=st.lists(st.tuples(st.integers(0, 7), NON_FINITE), max_size=3),
)
@example(variant="gqa_kv2", seed=0, fraction=0.5, alpha=0.5, poison=[(1, float("nan"))])
@example(variant="gqa_kv1", seed=1, fraction=0.5, alpha=0.5, poison=[(0, float("inf"))])
@example(variant="gqa_qk_norm", seed=2, fraction=0.3, alpha=0.0, poison=[(3, float("nan"))])
def test_clipped_heads_land_on_tau_and_the_rest_stay(variant, seed, fraction, alpha, poison):
    model = copy.deepcopy(_base(variant))
    _spread(model, seed)
    before = _record(model)
    given_LN = before.clone()
    for slot, value in poison:  # non-finite over some heads of the first attention
        given_LN[0, slot % given_LN.shape[1]] = value
    finite = given_LN[torch.isfinite(given_LN)]
    tau = float(finite.max()) * fraction if finite.numel() else 1.0
    snap = _params(model)
    clipped = qk_clip_(model, given_LN, tau, alpha)
    after = _record(model)
    now = _params(model)
    touched: set[str] = set()
    n_clipped = 0
    for i, attn in enumerate(model.attentions()):
        prefix = f"{'model.layers' if i == 0 else 'model.mtp_layers'}.0.self_attn."
        seen = before[i][torch.isfinite(before[i])]
        bound = RTOL * (float(seen.abs().max()) if seen.numel() else 1.0)
        for heads in _units(attn):
            g = given_LN[i, heads]
            s = float(g[torch.isfinite(g)].max()) if torch.isfinite(g).any() else -float("inf")
            rows = _unit_params(prefix, attn, heads)
            if s <= tau:  # untouched: weights and logits bit for bit
                for n, r in rows.items():
                    if n in now:
                        assert torch.equal(now[n][r], snap[n][r]), (n, heads)
                assert torch.equal(after[i, heads], before[i, heads]), heads
                continue
            eta = tau / s
            n_clipped += _groups_over(attn, given_LN[i], tau) if _qk_norm(attn) else 1
            touched |= set(rows)
            diff = (after[i, heads] - eta * before[i, heads]).abs()
            assert float(diff.max()) <= bound, (heads, diff, bound)
            ends = after[i, heads][torch.isfinite(g)]
            assert float(ends.max()) <= tau + bound, (heads, ends, tau)
    changed = {n for n in now if not torch.equal(now[n], snap[n])}
    assert changed <= touched  # nothing outside the clipped units' rows
    assert int(clipped) == n_clipped


def _groups_over(attn, given_N: torch.Tensor, tau: float) -> int:
    """QK-norm counts the KV groups whose largest finite logit is over tau."""
    finite_N = torch.where(torch.isfinite(given_N), given_N, -torch.inf)
    return int((finite_N.view(attn.n_kv_heads, -1).amax(dim=1) > tau).sum())


BAD_TAU = st.one_of(
    st.floats(max_value=0.0),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), True, False, None, "1.0"]),
    st.just(torch.tensor(1.0)),
)
BAD_ALPHA = st.one_of(
    st.floats(min_value=1.0, exclude_min=True),
    st.floats(max_value=0.0, exclude_max=True),
    st.sampled_from([float("nan"), True, None, "0.5"]),
)


@given(
    variant=st.sampled_from(sorted(VARIANTS)),
    bad=st.one_of(
        st.tuples(st.just("tau"), BAD_TAU),
        st.tuples(st.just("alpha"), BAD_ALPHA),
        st.tuples(st.just("max_logit_N"), st.integers(1, 9).filter(lambda n: n != 4)),
    ),
)
def test_bad_arguments_are_refused_by_name_before_any_write(variant, bad):
    model = copy.deepcopy(_base(variant))
    logits = _record(model)
    snap = _params(model)
    key, value = bad
    args = {"max_logits_LN": logits, "tau": float(logits.max()) / 2, "alpha": 0.5}
    if key == "max_logit_N":  # the attention has 4 query heads
        args["max_logits_LN"] = torch.ones(logits.shape[0], value, dtype=logits.dtype)
    else:
        args[key] = value
    with pytest.raises((TypeError, ValueError), match=key):
        qk_clip_(model, **args)
    assert all(torch.equal(p, snap[n]) for n, p in _params(model).items())
