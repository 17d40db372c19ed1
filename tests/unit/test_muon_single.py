"""Acceptance tests for the single-device Muon optimizer (muon/optimizer.py, muon.param_groups).

Single process, CPU, fast. Oracles:
- torch.optim.Muon (torch 2.13) for bf16 parity on 2-D params. torch uses the EMA momentum form
  (buf.lerp_(g, 1 - mu); nesterov input g.lerp(buf, mu)), which is (1 - mu) times the spec's
  M = mu*M + G / G + mu*M. Newton-Schulz normalizes by the Frobenius norm, so the updates agree
  up to bf16 rounding (measured: ~2.5% relative error of the accumulated 5-step update), while
  the spec's buffer would differ by the factor (1 - mu). The implementation keeps torch's EMA
  buffer (not the spec form M = mu*M + G), so buffers are compared with torch's directly.
  torch's weight decay is p *= 1 - lr*wd with the unadjusted lr; eps enters as
  X / max(||X||_F, eps).
- A float64 transcription of the spec (ref_muon_steps) for tight float32 checks.
- torch.optim.AdamW for the AdamW groups.
"""

import copy
import io
import math
import warnings

import pytest
import torch
from torch import nn

import muon
from muon import Muon, param_groups
from muon.plan import REMAINDER_STRATEGIES
from tests.reference import ref_ns

FIXED = [(3.4445, -4.7750, 2.0315)]
TUNED = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
DEFAULT = list(muon.NS_COEFFICIENTS["polar_express"])  # Muon's default coefficients
SHAPES = [(64, 32), (32, 96), (48, 48), (128, 16)]  # tall, wide, square, very tall

# bf16 parity tolerance: relative Frobenius error of the 5-step parameter change. Measured: 0.0 for
# this implementation (torch's EMA momentum and addmm kernels, bit-identical), ~0.025 for a
# spec-form (M = mu*M + G) implementation whose bf16 NS inputs are scaled differently; the wrong
# variants checked below (other adjust_lr mode, nesterov flipped) measured >= 0.116.
BF16_PARITY_TOL = 0.06


# ----------------------------------------------------------------------------- helpers


def ref_adjusted_lr(lr, mode, rows, cols):
    if mode == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    assert mode == "none"
    return lr


def ref_muon_steps(
    p0, grads, *, lr, mu, nesterov, wd, mode, num_experts=1, coefficients=DEFAULT, steps=5
):
    """float64 spec reference: returns (param, momentum_buffer) after len(grads) steps."""
    p = p0.double().clone()
    M = torch.zeros_like(p)
    rows, cols = p.shape
    r = rows // num_experts
    for g in grads:
        g = g.double()
        M = mu * M + g
        inp = g + mu * M if nesterov else M
        O = ref_ns(inp.view(num_experts, r, cols), coefficients, steps).reshape(rows, cols)
        p = p * (1 - lr * wd)
        p = p - ref_adjusted_lr(lr, mode, r, cols) * O
    return p, M


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make_params(shapes, seed=0, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen) * scale) for s in shapes]


def make_grads(shapes, n_steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(n_steps)]


def run(opt, params, grads_seq):
    for grads in grads_seq:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        opt.step()


def clone_params(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def snapshot_state(opt):
    out = {}
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = opt.state[p]
            out[(i, j)] = {
                k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                for k, v in st.items()
            }
    return out


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].keys() == b[key].keys(), key
        for k in a[key]:
            va, vb = a[key][k], b[key][k]
            if torch.is_tensor(va):
                assert torch.equal(va, vb), (key, k)
            else:
                assert va == vb, (key, k)


def wrong_mode(mode):
    return {"original": "match_rms_adamw", "match_rms_adamw": "original"}[mode]


# ----------------------------------------------------------------------------- parity with torch


@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("mode", ["original", "match_rms_adamw"])
def test_parity_with_torch_muon_bf16(mode, nesterov):
    n_steps, lr, mu, wd = 5, 0.02, 0.95, 0.1
    init = make_params(SHAPES, seed=0)
    grads = make_grads(SHAPES, n_steps, seed=1)

    ours_p = clone_params(init)
    ours = Muon(
        ours_p,
        lr=lr,
        momentum=mu,
        nesterov=nesterov,
        weight_decay=wd,
        adjust_lr=mode,
        ns_coefficients="fixed",  # torch.optim.Muon's iteration
        ns_algorithm="standard",
    )
    run(ours, ours_p, grads)
    ours_delta = [p.detach() - q.detach() for p, q in zip(ours_p, init, strict=True)]

    def torch_delta(adjust, nest):
        ps = clone_params(init)
        opt = torch.optim.Muon(
            ps, lr=lr, momentum=mu, nesterov=nest, weight_decay=wd, adjust_lr_fn=adjust
        )
        run(opt, ps, grads)
        return [p.detach() - q.detach() for p, q in zip(ps, init, strict=True)]

    ref_p = clone_params(init)
    ref_opt = torch.optim.Muon(
        ref_p, lr=lr, momentum=mu, nesterov=nesterov, weight_decay=wd, adjust_lr_fn=mode
    )
    run(ref_opt, ref_p, grads)
    ref = [p.detach() - q.detach() for p, q in zip(ref_p, init, strict=True)]
    # momentum buffers are plain float32 arithmetic: they match torch's (EMA form) closely
    for p, q in zip(ours_p, ref_p, strict=True):
        torch.testing.assert_close(
            ours.state[p]["momentum_buffer"],
            ref_opt.state[q]["momentum_buffer"],
            rtol=1e-6,
            atol=1e-7,
        )
    errs = [rel_err(o, t) for o, t in zip(ours_delta, ref, strict=True)]
    assert max(errs) < BF16_PARITY_TOL, dict(zip(SHAPES, errs, strict=True))

    # The tolerance is tight enough to catch a wrong variant: the same comparison against torch
    # with the other lr adjustment, or with nesterov flipped, fails on every shape.
    for variant in (torch_delta(wrong_mode(mode), nesterov), torch_delta(mode, not nesterov)):
        bad = [rel_err(o, t) for o, t in zip(ours_delta, variant, strict=True)]
        assert min(bad) > BF16_PARITY_TOL, dict(zip(SHAPES, bad, strict=True))


@pytest.mark.parametrize(
    "mode,nesterov,coefficients",
    [
        ("original", True, "fixed"),
        ("match_rms_adamw", True, "fixed"),
        ("none", True, "fixed"),
        ("match_rms_adamw", False, "fixed"),
        ("match_rms_adamw", True, "tuned"),
        ("match_rms_adamw", True, "polar_express"),
    ],
)
def test_float32_matches_spec_reference(mode, nesterov, coefficients):
    """With ns_dtype=float32 the update matches the spec formulas to float32 accuracy. The state's
    momentum buffer follows torch.optim.Muon (EMA form), i.e. (1 - mu) times the spec's
    M = mu*M + G; the update direction is the same either way."""
    n_steps, lr, mu, wd = 4, 0.03, 0.9, 0.05
    init = make_params(SHAPES, seed=2)
    grads = make_grads(SHAPES, n_steps, seed=3)
    ps = clone_params(init)
    opt = Muon(
        ps,
        lr=lr,
        momentum=mu,
        nesterov=nesterov,
        weight_decay=wd,
        adjust_lr=mode,
        ns_dtype=torch.float32,
        ns_coefficients=coefficients,
    )
    run(opt, ps, grads)
    coefs = {"fixed": FIXED, "tuned": TUNED, "polar_express": DEFAULT}[coefficients]
    for i, (p, q) in enumerate(zip(ps, init, strict=True)):
        want_p, want_M = ref_muon_steps(
            q.detach(),
            [g[i] for g in grads],
            lr=lr,
            mu=mu,
            nesterov=nesterov,
            wd=wd,
            mode=mode,
            coefficients=coefs,
        )
        assert rel_err(p.detach() - q.detach(), want_p - q.detach().double()) < 1e-4, SHAPES[i]
        # momentum_buffer holds torch.optim.Muon's EMA form, (1 - mu) times the spec's M
        M = opt.state[p]["momentum_buffer"]
        torch.testing.assert_close(M.double(), (1 - mu) * want_M, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["original", "match_rms_adamw", "none"])
def test_weight_decay_uses_unadjusted_lr(mode):
    """Zero gradient: NS(0) = 0 (eps keeps it finite), so only p *= 1 - lr*wd remains."""
    lr, wd = 0.05, 0.3
    init = make_params([(64, 16)], seed=4)
    ps = clone_params(init)
    opt = Muon(ps, lr=lr, weight_decay=wd, adjust_lr=mode)
    ps[0].grad = torch.zeros(64, 16)
    opt.step()
    assert torch.isfinite(ps[0]).all()
    torch.testing.assert_close(ps[0].detach(), init[0].detach() * (1 - lr * wd), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- fused experts


@pytest.mark.parametrize("mode", ["original", "match_rms_adamw"])
@pytest.mark.parametrize(
    "E,out_dim,in_dim",
    [(4, 24, 16), (4, 8, 24), (6, 8, 32)],
    ids=["tall-blocks", "wide-blocks", "gate-up-2E"],
)
def test_num_experts_equals_independent_blocks(mode, E, out_dim, in_dim):
    """A step with num_experts=E equals E independent single-block Muon optimizers, including
    the lr adjustment from the per-block shape [rows/E, cols] (float32 NS)."""
    n_steps, lr, mu, wd = 3, 0.02, 0.95, 0.1
    gen = torch.Generator().manual_seed(5)
    W0 = torch.randn(E * out_dim, in_dim, generator=gen) * 0.05
    grads = [torch.randn(E * out_dim, in_dim, generator=gen) for _ in range(n_steps)]
    for g in grads:  # blocks with very different gradient scales
        for e in range(E):
            g[e * out_dim : (e + 1) * out_dim] *= 10.0 ** (e % 3 - 1)

    kw = dict(lr=lr, momentum=mu, weight_decay=wd, adjust_lr=mode, ns_dtype=torch.float32)
    W = nn.Parameter(W0.clone())
    fused = Muon([{"params": [W], "num_blocks": E}], **kw)
    run(fused, [W], [[g] for g in grads])

    blocks = [nn.Parameter(W0[e * out_dim : (e + 1) * out_dim].clone()) for e in range(E)]
    singles = [Muon([b], **kw) for b in blocks]
    for g in grads:
        for e, (b, o) in enumerate(zip(blocks, singles, strict=True)):
            b.grad = g[e * out_dim : (e + 1) * out_dim].clone()
            o.step()
    torch.testing.assert_close(
        W.detach(), torch.cat([b.detach() for b in blocks]), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        fused.state[W]["momentum_buffer"],
        torch.cat([o.state[b]["momentum_buffer"] for b, o in zip(blocks, singles, strict=True)]),
        rtol=0,
        atol=0,
    )
    # and the spec reference, which makes the per-block lr explicit
    want, _ = ref_muon_steps(
        W0, grads, lr=lr, mu=mu, nesterov=True, wd=wd, mode=mode, num_experts=E
    )
    assert rel_err(W.detach() - W0, want - W0.double()) < 1e-4
    # the whole-matrix treatment is measurably different (guards against a vacuous pass)
    whole, _ = ref_muon_steps(W0, grads, lr=lr, mu=mu, nesterov=True, wd=wd, mode=mode)
    assert rel_err(W.detach() - W0, whole - W0.double()) > 0.05


# ----------------------------------------------------------------------------- AdamW groups


def test_adamw_groups_match_torch_adamw():
    shapes = [(32,), (16, 24), (8, 4, 4), (1,)]
    n_steps = 6
    init = make_params(shapes, seed=6)
    grads = make_grads(shapes, n_steps, seed=7)

    ours_p = clone_params(init)
    a, b = ours_p[:2], ours_p[2:]
    opt = Muon(
        [
            # explicit per-group hyper-parameters
            {
                "params": a,
                "algorithm": "adamw",
                "lr": 3e-3,
                "betas": (0.8, 0.99),
                "eps": 1e-6,
                "weight_decay": 0.05,
            },
            # betas / eps from the constructor's betas and adamw_eps (not the NS eps)
            {"params": b, "algorithm": "adamw", "lr": 1e-2, "weight_decay": 0.2},
        ],
        betas=(0.7, 0.9),
        adamw_eps=1e-3,
    )
    ref_p = clone_params(init)
    ref = torch.optim.AdamW(
        [
            {
                "params": ref_p[:2],
                "lr": 3e-3,
                "betas": (0.8, 0.99),
                "eps": 1e-6,
                "weight_decay": 0.05,
            },
            {
                "params": ref_p[2:],
                "lr": 1e-2,
                "betas": (0.7, 0.9),
                "eps": 1e-3,
                "weight_decay": 0.2,
            },
        ]
    )
    for step, g in enumerate(grads):
        for p, q, gg in zip(ours_p, ref_p, g, strict=True):
            p.grad = gg.clone()
            q.grad = gg.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours_p, ref_p, strict=True):
            torch.testing.assert_close(
                p.detach(), q.detach(), rtol=1e-5, atol=1e-7, msg=f"step {step}"
            )
    for p, q in zip(ours_p, ref_p, strict=True):
        st, rst = opt.state[p], ref.state[q]
        torch.testing.assert_close(st["exp_avg"], rst["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(st["exp_avg_sq"], rst["exp_avg_sq"], rtol=1e-5, atol=1e-10)
        assert float(st["step"]) == float(rst["step"]) == n_steps


def test_mixed_muon_and_adamw_groups():
    """One optimizer holding both kinds: each part equals its own oracle."""
    mshapes, ashapes = [(64, 32), (32, 96)], [(32,), (10, 8)]
    init_m, init_a = make_params(mshapes, seed=8), make_params(ashapes, seed=9)
    grads = make_grads(mshapes + ashapes, 4, seed=10)
    pm, pa = clone_params(init_m), clone_params(init_a)
    opt = Muon(
        [
            {"params": pm},  # no "algorithm": defaults to muon
            {"params": pa, "algorithm": "adamw", "lr": 1e-3, "weight_decay": 0.01},
        ],
        lr=0.02,
        weight_decay=0.1,
        adjust_lr="match_rms_adamw",
        ns_dtype=torch.float32,
    )
    assert opt.param_groups[0]["algorithm"] == "muon"
    assert opt.param_groups[0].get("num_blocks", 1) == 1
    assert opt.param_groups[1]["algorithm"] == "adamw"
    run(opt, pm + pa, grads)

    qa = clone_params(init_a)
    ref = torch.optim.AdamW(qa, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    run(ref, qa, [g[2:] for g in grads])
    for p, q in zip(pa, qa, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    for i, (p, q) in enumerate(zip(pm, init_m, strict=True)):
        want, _ = ref_muon_steps(
            q.detach(),
            [g[i] for g in grads],
            lr=0.02,
            mu=0.95,
            nesterov=True,
            wd=0.1,
            mode="match_rms_adamw",
        )
        assert rel_err(p.detach() - q.detach(), want - q.detach().double()) < 1e-4


def test_lambda_lr_schedule_applies():
    shapes = [(32, 16), (16,)]
    init = make_params(shapes, seed=11)
    grads = make_grads(shapes, 3, seed=12)

    def build(ps, lr, adamw_lr):
        return Muon(
            [
                {"params": [ps[0]], "lr": lr},
                {"params": [ps[1]], "algorithm": "adamw", "lr": adamw_lr},
            ],
            ns_dtype=torch.float32,
        )

    a = clone_params(init)
    opt_a = build(a, 0.02, 1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda step: 0.5)
    run(opt_a, a, grads)
    assert sched.get_last_lr() == pytest.approx([0.01, 5e-4])
    b = clone_params(init)
    run(build(b, 0.01, 5e-4), b, grads)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------- param_groups


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class FusedExperts(nn.Module):
    def __init__(self, E, hidden, inter):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E * 2 * inter, hidden) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(E * hidden, inter) * 0.02)
        self.orthogonal_blocks = {"gate_up_proj": 2 * E, "down_proj": E}


class Block(nn.Module):
    def __init__(self, E, hidden, inter):
        super().__init__()
        self.attn_norm = RMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, hidden, bias=True)
        self.k_proj = nn.Linear(hidden, hidden // 2, bias=False)
        self.v_proj = nn.Linear(hidden, hidden // 2, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.router = nn.Linear(hidden, E, bias=False)
        self.router.param_roles = {"weight": "router"}
        self.experts = FusedExperts(E, hidden, inter)
        # a plain matrix whose name mentions "embed"/"head": roles come from metadata, not names
        self.embed_head_proj = nn.Linear(hidden, hidden, bias=False)


class TinyMoE(nn.Module):
    def __init__(self, E=4, hidden=16, inter=8, vocab=40, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([Block(E, hidden, inter) for _ in range(2)])
        self.final_norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.param_roles = {"weight": "head"}
        if tied:
            self.lm_head.weight = self.embed.weight


def _where(groups, model):
    """name -> (algorithm, num_experts) for every parameter; asserts each appears exactly once."""
    by_id = {}
    for g in groups:
        alg = g.get("algorithm", "muon")
        for p in g["params"]:
            assert id(p) not in by_id, "parameter placed in two groups"
            by_id[id(p)] = (alg, g.get("num_blocks", 1) if alg == "muon" else None)
    names = dict(model.named_parameters())  # de-duplicates tied weights
    assert set(by_id) == {id(p) for p in names.values()}, "some parameter missing or foreign"
    return {n: by_id[id(p)] for n, p in names.items()}


@pytest.mark.parametrize("router", ["adamw", "muon"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_param_groups_placement(router, tied):
    E = 4
    model = TinyMoE(E=E, tied=tied)
    groups = param_groups(
        model,
        router=router,
        lr=0.03,
        weight_decay=0.1,
        adamw_lr=2e-3,
        adamw_weight_decay=0.01,
        adamw_betas=(0.8, 0.9),
        adamw_eps=1e-6,
    )
    where = _where(groups, model)
    muon1, adamw = ("muon", 1), ("adamw", None)
    want = {"embed.weight": adamw, "final_norm.weight": adamw}
    if not tied:
        want["lm_head.weight"] = adamw
    for i in range(2):
        b = f"blocks.{i}."
        want.update(
            {
                b + "attn_norm.weight": adamw,
                b + "mlp_norm.weight": adamw,
                b + "q_proj.weight": muon1,
                b + "q_proj.bias": adamw,
                b + "k_proj.weight": muon1,
                b + "v_proj.weight": muon1,
                b + "embed_head_proj.weight": muon1,
                b + "router.weight": muon1 if router == "muon" else adamw,
                b + "experts.gate_up_proj": ("muon", 2 * E),
                b + "experts.down_proj": ("muon", E),
            }
        )
    assert where == want

    for g in groups:
        if g.get("algorithm", "muon") == "muon":
            assert g["lr"] == 0.03 and g["weight_decay"] == 0.1
            assert all(
                p.ndim == 2 and p.shape[0] % g.get("num_blocks", 1) == 0 for p in g["params"]
            )
        else:
            assert g["algorithm"] == "adamw"
            assert g["lr"] == 2e-3 and g["weight_decay"] == 0.01
            assert tuple(g["betas"]) == (0.8, 0.9) and g["eps"] == 1e-6

    # the groups drive a working optimizer, and fused experts get per-block treatment
    opt = Muon(groups, ns_dtype=torch.float32)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert not opt.last_step_skipped
    assert opt.step_stats["muon/matrices"] == 2 * (3 + 1 + 2 * E + E + (router == "muon"))


def test_param_groups_invalid_router():
    with pytest.raises(ValueError, match="router"):
        param_groups(TinyMoE(), router="sgd")


# ----------------------------------------------------------------------------- state


def _mixed_setup(seed=13):
    shapes = [(32, 16), (4 * 8, 12), (16,), (6, 5)]
    params = make_params(shapes, seed=seed)
    return shapes, params


def _build_mixed(params, **kw):
    return Muon(
        [
            {"params": [params[0]]},
            {"params": [params[1]], "num_blocks": 4},
            {"params": params[2:], "algorithm": "adamw", "lr": 1e-3, "weight_decay": 0.01},
        ],
        weight_decay=0.1,
        **kw,
    )


def test_state_created_at_construction():
    _, params = _mixed_setup()
    opt = _build_mixed(params)
    for p in params[:2]:
        buf = opt.state[p]["momentum_buffer"]
        assert buf.shape == p.shape and torch.count_nonzero(buf) == 0
    for p in params[2:]:
        st = opt.state[p]
        assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape
        assert (
            torch.count_nonzero(st["exp_avg"]) == 0 and torch.count_nonzero(st["exp_avg_sq"]) == 0
        )
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3]
    assert "momentum_buffer" in sd["state"][0] and "momentum_buffer" in sd["state"][1]
    assert {"exp_avg", "exp_avg_sq"} <= set(sd["state"][2]) and {"exp_avg", "exp_avg_sq"} <= set(
        sd["state"][3]
    )
    # loading a before-any-step state_dict works too
    opt2 = _build_mixed(clone_params(params))
    opt2.load_state_dict(copy.deepcopy(sd))


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_state_dict_round_trip_is_bitwise(ns_dtype):
    shapes, init = _mixed_setup()
    grads = make_grads(shapes, 5, seed=14)

    a = clone_params(init)
    opt_a = _build_mixed(a, ns_dtype=ns_dtype)
    run(opt_a, a, grads[:2])
    buf = io.BytesIO()
    torch.save({"opt": opt_a.state_dict(), "params": [p.detach().clone() for p in a]}, buf)
    saved_state = snapshot_state(opt_a)
    run(opt_a, a, grads[2:])

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = [nn.Parameter(t) for t in ckpt["params"]]
    opt_b = _build_mixed(b, ns_dtype=ns_dtype)
    opt_b.load_state_dict(ckpt["opt"])
    assert_state_equal(snapshot_state(opt_b), saved_state)
    run(opt_b, b, grads[2:])
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
    assert_state_equal(snapshot_state(opt_a), snapshot_state(opt_b))
    # the adamw step counter kept counting across the round trip
    assert float(opt_b.state[b[2]]["step"]) == float(opt_a.state[a[2]]["step"]) == 5


# ----------------------------------------------------------------------------- bad input


def _p2d():
    return [nn.Parameter(torch.randn(8, 4))]


@pytest.mark.parametrize(
    "build,name",
    [
        (lambda: Muon([{"params": _p2d(), "algorithm": "sgd"}]), "algorithm"),
        (lambda: Muon(_p2d(), lr=0.0), "lr"),
        (lambda: Muon(_p2d(), lr=-1e-3), "lr"),
        (lambda: Muon([{"params": _p2d(), "lr": -0.1}]), "lr"),
        (lambda: Muon(_p2d(), ns_steps=0), "ns_steps"),
        (lambda: Muon(_p2d(), ns_steps=-2), "ns_steps"),
        (lambda: Muon(_p2d(), momentum=1.0), "momentum"),
        (lambda: Muon(_p2d(), momentum=-0.1), "momentum"),
        (lambda: Muon(_p2d(), adjust_lr="sqrt"), "adjust_lr"),
        (lambda: Muon(_p2d(), ns_coefficients="fancy"), "coefficients"),
        (lambda: Muon(_p2d(), ns_algorithm="fast"), "ns_algorithm"),
        (lambda: Muon([{"params": _p2d(), "ns_algorithm": "fast"}]), "ns_algorithm"),
        (lambda: Muon([{"params": _p2d(), "num_blocks": 3}]), "num_blocks"),
        (lambda: Muon([{"params": _p2d(), "num_blocks": 0}]), "num_blocks"),
        (lambda: Muon([nn.Parameter(torch.randn(8))]), "param"),
        (lambda: Muon(_p2d(), remainder_strategy="scatter"), "remainder_strategy"),
    ],
    ids=[
        "algorithm",
        "lr-zero",
        "lr-negative",
        "group-lr",
        "ns_steps-zero",
        "ns_steps-negative",
        "momentum-one",
        "momentum-negative",
        "adjust_lr",
        "ns_coefficients",
        "ns_algorithm",
        "group-ns_algorithm",
        "num_experts-not-dividing",
        "num_experts-zero",
        "1d-param-in-muon-group",
        "remainder_strategy",
    ],
)
def test_bad_input_raises_naming_argument(build, name):
    with pytest.raises(ValueError) as info:
        build()
    assert name in str(info.value), str(info.value)


def test_bad_remainder_strategy_lists_choices():
    with pytest.raises(ValueError) as info:
        Muon(_p2d(), remainder_strategy="scatter")
    msg = str(info.value)
    for choice in REMAINDER_STRATEGIES:
        assert choice in msg, msg


def _strategies(opt):
    found = {getattr(opt, "remainder_strategy", None), opt.defaults.get("remainder_strategy")}
    found |= {g.get("remainder_strategy") for g in opt.param_groups}
    return found - {None}


@pytest.mark.parametrize("strategy", ["pad_all2all", "ragged_all_to_all"])
def test_enable_all2all_false_coerces_to_agrs(strategy):
    with pytest.warns(UserWarning, match="agrs"):
        opt = Muon(_p2d(), enable_all2all=False, remainder_strategy=strategy)
    assert _strategies(opt) == {"agrs"}


def test_enable_all2all_false_with_agrs_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon(_p2d(), enable_all2all=False, remainder_strategy="agrs")
    assert _strategies(opt) == {"agrs"}


# ----------------------------------------------------------------------------- non-finite skip


@pytest.mark.parametrize(
    "where,value", [(0, float("nan")), (1, float("inf")), (2, float("-inf")), (3, float("nan"))]
)
def test_non_finite_gradient_skips_whole_step(where, value):
    shapes, init = _mixed_setup()
    grads = make_grads(shapes, 3, seed=15)

    a = clone_params(init)
    opt = _build_mixed(a)
    run(opt, a, grads[:1])
    assert opt.last_step_skipped is False and opt.skipped_steps == 0
    params_before = [p.detach().clone() for p in a]
    state_before = snapshot_state(opt)

    bad = [g.clone() for g in grads[1]]
    bad[where].view(-1)[3] = value
    for _ in range(2):
        run(opt, a, [bad])
        assert opt.last_step_skipped is True
        for p, q in zip(a, params_before, strict=True):
            assert torch.equal(p, q)
        assert_state_equal(snapshot_state(opt), state_before)
    assert opt.skipped_steps == 2

    # a finite step afterwards proceeds as if the bad steps never happened
    run(opt, a, grads[2:])
    assert opt.last_step_skipped is False and opt.skipped_steps == 2
    b = clone_params(init)
    opt_b = _build_mixed(b)
    run(opt_b, b, [grads[0], grads[2]])
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
    assert_state_equal(snapshot_state(opt), snapshot_state(opt_b))


# ----------------------------------------------------------------------------- stats, imports


def test_step_stats_single_device():
    shapes, params = _mixed_setup()
    opt = _build_mixed(params)
    run(opt, params, make_grads(shapes, 1, seed=16))
    stats = opt.step_stats
    assert isinstance(stats, dict)
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in stats.items()), stats
    assert stats["muon/matrices"] == 1 + 4  # one plain matrix + a 4-block fused one
    for k, v in stats.items():
        if "bytes" in k:
            assert v == 0.0, (k, v)


def test_public_imports():
    assert muon.Muon is Muon
    assert issubclass(Muon, torch.optim.Optimizer)
    from muon.coefficients import NS_COEFFICIENTS  # noqa: F401
    from muon.newton_schulz import newton_schulz, orthogonalize_blocks  # noqa: F401
