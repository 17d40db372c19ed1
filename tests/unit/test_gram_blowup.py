"""A Gram Newton-Schulz block that leaves the band, inside the optimizer and through the public
functions: no host read where it happens; the parameter holding it keeps its value (weight decay
included) and the step is marked skipped; the next step's census demotes the batch to the
standard iteration, with a warning. Single process, float32 Newton-Schulz, so that the
comparisons with the standard iteration are exact up to one float32 rounding of the apply.

The blow-up is forced: `gram_iteration` is wrapped to multiply one block's output by 100, far
outside the band (the output check estimates its largest singular value at ~100 > 1.12 + 0.04).
"""

from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch

from muon import Muon
from muon.chunks import adjusted_lr
from muon.newton_schulz import newton_schulz, orthogonalize_blocks
from recipes.bench.probe import all_on_device

# (muon/__init__ exports the function newton_schulz, which shadows the module's name)
ns_module = importlib.import_module("muon.newton_schulz")

LR, WD, MU = 0.02, 0.1, 0.95
NS = dict(steps=5, coefficients="polar_express", dtype=torch.float32)
#: a [256, 768] block runs Gram under ns_algorithm="auto" (>= 256 rows and columns)
SHAPE = (256, 768)


class BlowUp:
    """`gram_iteration` with block 0 of its output multiplied by 100 while `armed`; counts its
    calls."""

    def __init__(self) -> None:
        self.real, self.armed, self.calls = ns_module.gram_iteration, False, 0

    def __call__(self, X, *args):
        self.calls += 1
        out = self.real(X, *args)
        if self.armed:
            (out[0] if out.ndim == 3 else out).mul_(100.0)
        return out


@pytest.fixture
def blow_up(monkeypatch) -> BlowUp:
    fake = BlowUp()
    monkeypatch.setattr(ns_module, "gram_iteration", fake)
    return fake


def _model(normuon: bool = False):
    """Two [256, 768] matrices (one local batch: one batched Gram call, A's block first) and a
    small one that runs the standard iteration."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in (SHAPE, SHAPE, (32, 48))]
    opt = Muon(
        [{"params": params, "param_names": ["a", "b", "c"]}],
        lr=LR,
        weight_decay=WD,
        momentum=MU,
        ns_dtype=torch.float32,
        normuon=normuon,
    )
    return opt, params


def _grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(10 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_public_form_without_a_read_returns_zeros_and_flags(blow_up):
    G = torch.randn(4, 16, 48, generator=torch.Generator().manual_seed(3))
    blow_up.armed = False
    clean = newton_schulz(G, algorithm="gram", **NS)
    blow_up.armed = True
    flags: list[torch.Tensor] = []
    with all_on_device() as count:  # every tensor counted as a device tensor
        got = newton_schulz(G, algorithm="gram", blowups=flags, **NS)
    assert count.n_syncs == 0, count.syncs_by_kind()
    (bad,) = flags
    assert bad.tolist() == [True, False, False, False]
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.equal(got[1:], clean[1:])
    # a matrix: one flag; fused blocks: one per block; the standard iteration: none
    flags.clear()
    newton_schulz(G[0], algorithm="gram", blowups=flags, **NS)
    orthogonalize_blocks(G.reshape(64, 48), 4, algorithm="gram", blowups=flags, **NS)
    newton_schulz(G, algorithm="standard", blowups=flags, **NS)
    assert [f.tolist() for f in flags] == [[True], [True, False, False, False]]
    # without `blowups`: recomputed with the standard iteration, as before
    assert torch.equal(newton_schulz(G, algorithm="gram", **NS)[0], newton_schulz(G, **NS)[0])


def test_a_blown_up_block_refuses_its_parameter_and_the_next_step_runs_standard(blow_up):
    opt, params = _model()
    ref, ref_params = _model()
    before = [p.detach().clone() for p in params]
    _grads(params, 0)
    _grads(ref_params, 0)
    blow_up.armed = True
    with all_on_device() as count:
        opt.step()
    assert count.syncs_by_kind() == {"tolist": 1}, "the census is the step's one read"
    blow_up.armed = False
    ref.step()
    a, b, c = params
    assert torch.equal(a, before[0]), "the blown-up block's parameter keeps its value (no decay)"
    assert torch.equal(b, ref_params[1]) and torch.equal(c, ref_params[2])
    for p, q in zip(params, ref_params, strict=True):  # momentum moved, as for an unfit update
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    assert opt.last_step_skipped and not ref.last_step_skipped
    assert opt.skipped_steps == 1

    # the next step's census learns it: a warning naming the batch, then the standard iteration
    calls = blow_up.calls
    start = [p.detach().clone() for p in params]
    _grads(params, 1)
    with pytest.warns(RuntimeWarning, match=r"'a', 'b'.*standard iteration"):
        opt.step()
    assert blow_up.calls == calls, "a demoted batch runs no Gram iteration"
    assert not opt.last_step_skipped
    M = [opt.state[p]["momentum_buffer"] for p in (a, b)]
    U = torch.stack([p.grad.lerp(m, MU) for p, m in zip((a, b), M, strict=True)])
    O = newton_schulz(U, algorithm="standard", **NS)
    alpha = adjusted_lr(LR, "match_rms_adamw", *SHAPE)
    # one float32 multiply and one fused multiply-add per entry: a few ulps of |p| <= ~5
    for p, p0, o in zip((a, b), start[:2], O, strict=True):
        torch.testing.assert_close(p, p0 * (1 - LR * WD) - alpha * o, rtol=0, atol=2e-6)
    # the demotion is the parameters' state: a new group re-plans, and the batch stays demoted
    _grads(params, 2)
    opt.step()
    assert blow_up.calls == calls
    assert all(bool(opt.state[p]["gram_demoted"]) for p in (a, b))
    assert not opt.state[c]["gram_demoted"]
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, 8))], "param_names": ["d"]})
    opt.param_groups[-1]["params"][0].grad = torch.zeros(8, 8)
    opt.step()
    assert blow_up.calls == calls


def test_normuon_sees_zeros_for_a_blown_up_block(blow_up):
    """NorMuon's moments of the blown-up block see a zero block (they decay), not its values;
    the other block's moments are those of the run without the blow-up."""
    opt, params = _model(normuon=True)
    ref, ref_params = _model(normuon=True)
    _grads(params, 0)
    _grads(ref_params, 0)
    ref.step()
    blow_up.armed = True
    opt.step()
    v = [opt.state[p]["normuon_v"] for p in params]
    v_ref = [ref.state[p]["normuon_v"] for p in ref_params]
    assert torch.equal(v[0], torch.zeros_like(v[0])) and v_ref[0].abs().sum() > 0
    assert torch.equal(v[1], v_ref[1]) and torch.equal(v[2], v_ref[2])
    assert torch.equal(params[1], ref_params[1]) and opt.last_step_skipped


def test_a_demotion_learnt_before_a_save_is_resumed(blow_up):
    """Blow-up at step 0, learnt at step 1, saved after step 2: the resumed optimizer (on other
    weights, loading the save) runs the standard iteration on that batch as the uninterrupted
    one does, so the next 5 updates are bit-equal (a resume re-ran Gram, whose float32 result
    differs from the standard iteration's, and would re-learn the demotion with a refusal)."""
    opt, params = _model()
    for step in range(3):
        blow_up.armed = step == 0
        _grads(params, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    blow_up.armed = False
    saved = copy.deepcopy((opt.state_dict(), [p.detach() for p in params]))
    for step in range(3, 8):
        _grads(params, step)
        opt.step()
    resumed, other = _model()
    with torch.no_grad():
        for p, w in zip(other, saved[1], strict=True):
            p.copy_(w)
    resumed.load_state_dict(saved[0])
    calls = blow_up.calls
    for step in range(3, 8):
        _grads(other, step)
        resumed.step()
        assert not resumed.last_step_skipped
    assert blow_up.calls == calls, "the demoted batch runs no Gram iteration after the load"
    for p, q in zip(params, other, strict=True):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            assert torch.equal(resumed.state[q][key], value), key
