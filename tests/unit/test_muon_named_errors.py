"""Inputs Muon once ran silently, each now the reference result or an error naming its key
(muon/validate.py, muon/guard.py, muon/newton_schulz.py, muon/optimizer.py). Single process,
CPU, fast."""

import copy
import math

import pytest
import torch
from torch import nn

from muon import Muon


def _w(*shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(*shape, generator=gen).to(dtype))


def _grad(p, seed=1, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


# ------------------------------------------------------------------ float16 parameters


def test_float16_update_norm_past_65504_is_the_float32_update():
    """A [128, 128] float16 gradient of RMS 600 has a Frobenius norm of ~76800 > 65504 (as a
    1024 x 1024 one of RMS 70): the norm is taken in float32, so the float16 Newton-Schulz
    update is the float32 one (it was zero)."""
    moved = {}
    for ns_dtype in ("float16", "float32"):
        w = nn.Parameter(torch.zeros(128, 128, dtype=torch.float16))
        opt = Muon([w], ns_dtype=ns_dtype, momentum=0.0, adjust_lr="none", lr=1.0)
        _grad(w, scale=600.0)
        opt.step()
        assert not opt.last_step_skipped
        moved[ns_dtype] = w.detach().float()
    # entries of O are ~1/11; float16 Newton-Schulz rounds at 2^-11 relative per product and
    # five steps keep the error within a few roundings of the entries' size (test_ns_float16)
    assert moved["float16"].abs().amax() > 0.02
    torch.testing.assert_close(moved["float16"], moved["float32"], rtol=0, atol=1e-2 / 8)


def test_update_that_overflows_float16_is_skipped_not_written():
    """lr * O past 65504 cannot be written into a float16 parameter: that parameter keeps its
    value and the step is marked skipped; the next step with a sane lr runs."""
    w, v = _w(64, 64, dtype=torch.float16), _w(32, 16, seed=2)
    opt = Muon([{"params": [w], "lr": 1e6}, {"params": [v]}], weight_decay=1e-7)
    before_w, before_v = w.detach().clone(), v.detach().clone()
    _grad(w), _grad(v)
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert torch.equal(w, before_w) and torch.isfinite(w).all()
    assert not torch.equal(v, before_v)  # the update that fits is applied
    opt.param_groups[0]["lr"] = 0.02
    _grad(w), _grad(v)
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert not torch.equal(w, before_w) and torch.isfinite(w).all()


def test_adamw_update_that_cannot_be_written_is_skipped():
    """An AdamW lr whose bias-corrected scale passes float16's range (or float32's: it once
    raised mid-step) leaves the parameter as it was and marks the step skipped."""
    for dtype, lr in ((torch.float16, 1e6), (torch.float32, 1e300)):
        b = nn.Parameter(torch.ones(4, dtype=dtype))
        opt = Muon([{"params": [b], "algorithm": "adamw", "lr": lr}])
        _grad(b)
        opt.step()
        assert opt.last_step_skipped and torch.equal(b, torch.ones(4, dtype=dtype))


def test_zero_sized_parameter_is_an_error_naming_it():
    """A `(0, N)` matrix has no block to plan (it raised a bare ZeroDivisionError)."""
    for build in (
        lambda: Muon([{"params": [_w(0, 8)], "param_names": ["empty.weight"]}]),
        lambda: Muon([_w(8, 4)]).add_param_group({"params": [_w(4, 0)]}),
    ):
        with pytest.raises(ValueError, match=r"zero-sized parameter .*shape \("):
            build()


# ------------------------------------------------------------------ split_sizes


@pytest.mark.parametrize("splits", [(4, 4), (3, 3, 3), [6, 6, 6]])
def test_equal_split_sizes_must_cover_the_rows(splits):
    """Equal sizes that do not add up to the rows are an error, not `num_blocks`."""
    with pytest.raises(ValueError, match=r"split_sizes: .* 12 rows"):
        Muon([dict(params=[_w(12, 4)], split_sizes=splits)])


@pytest.mark.parametrize("splits", [(4, 4), (3, 3, 3), (5, 5, 5)])
def test_loaded_split_sizes_must_cover_the_rows(splits):
    """A saved group whose split sizes do not cover the rows is refused, naming split_sizes,
    and nothing is loaded (rows 8-11 once got a zero update at every step)."""
    opt = Muon([dict(params=[_w(12, 4)], split_sizes=(6, 6))])
    sd = opt.state_dict()
    sd["param_groups"][0].update(split_sizes=splits, num_blocks=1)
    with pytest.raises(ValueError, match="split_sizes"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["num_blocks"] == 2


def test_loaded_groups_are_the_checked_groups():
    """What the check normalizes is what is loaded: saved equal sizes become num_blocks, a saved
    list of unequal sizes a tuple, and the next step equals that of an optimizer built with
    those groups."""
    for saved, blocks, sizes in (((4, 4, 4), 3, None), ([8, 4], 2, (8, 4))):
        a, b = _w(12, 4), _w(12, 4)
        opt = Muon([dict(params=[a], split_sizes=(6, 6))], ns_dtype="float32")
        sd = opt.state_dict()
        sd["param_groups"][0].update(split_sizes=saved, num_blocks=1)
        opt.load_state_dict(sd)
        g = opt.param_groups[0]
        assert (g["num_blocks"], g["split_sizes"]) == (blocks, sizes)
        fresh = Muon([dict(params=[b], split_sizes=saved)], ns_dtype="float32")
        _grad(a), _grad(b)
        opt.step(), fresh.step()
        assert torch.equal(a, b)


def test_unequal_split_whose_count_does_not_divide_the_rows_runs():
    """(5, 3, 2) on 10 rows (MLA: nope + rope odd) runs and equals torch.optim.Muon on each
    block; no row is left without an update."""
    w = _w(10, 6)
    opt = Muon([dict(params=[w], split_sizes=(5, 3, 2))], ns_coefficients="fixed", lr=0.02)
    blocks = [nn.Parameter(b.clone()) for b in w.detach().split([5, 3, 2])]
    ref = torch.optim.Muon(blocks, lr=0.02, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
    before = w.detach().clone()
    _grad(w)
    for blk, g in zip(blocks, w.grad.split([5, 3, 2]), strict=True):
        blk.grad = g.clone()
    opt.step(), ref.step()
    assert ((w - before).abs().amax(dim=1) > 0).all()
    # the same bf16 iteration per block (test_muon_split): equal to well below one update
    torch.testing.assert_close(
        w.detach(), torch.cat([b.detach() for b in blocks]), atol=2e-3, rtol=0
    )


def test_mla_with_odd_split_sums_trains_every_row():
    """MLA under Muon Split with nope + rope, nope + v and kv_rank + rope odd (5 + 4, 5 + 6,
    7 + 4): the optimizer builds and every row of every split matrix moves."""
    from models.glm import GLMForCausalLM, get_preset
    from muon import param_groups

    config = get_preset(
        "mla_tiny", qk_nope_head_dim=5, qk_rope_head_dim=4, v_head_dim=6, kv_lora_rank=7
    )
    model = GLMForCausalLM(config)
    opt = Muon(param_groups(model, muon_split=True))
    split = {n for g in opt.param_groups if g.get("split_sizes") for n in g["param_names"]}
    assert any("kv_a_proj_with_mqa" in n for n in split) and any("kv_b_proj" in n for n in split)
    for i, p in enumerate(model.parameters()):
        _grad(p, seed=i)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for n, p in model.named_parameters():
        if n in split:
            assert ((p - before[n]).abs().amax(dim=1) > 0).all(), n


def test_split_sizes_as_a_set_is_refused():
    """A set has no order: it is refused, in the constructor and from a state dict."""
    with pytest.raises(ValueError, match=r"split_sizes: .*a set has no order"):
        Muon([dict(params=[_w(10, 4)], split_sizes={6, 4})])
    opt = Muon([dict(params=[_w(10, 4)], split_sizes=(6, 4))])
    sd = opt.state_dict()
    sd["param_groups"][0]["split_sizes"] = {6, 4}
    with pytest.raises(ValueError, match=r"split_sizes: .*a set has no order"):
        opt.load_state_dict(sd)


def test_split_sizes_saved_as_a_list_loads_and_steps():
    """A list (as JSON or YAML gives back) loads as a tuple: the next step runs (it once
    raised `unhashable type: 'list'`)."""
    w = _w(10, 4)
    opt = Muon([dict(params=[w], split_sizes=(6, 4))])
    sd = opt.state_dict()
    sd["param_groups"][0]["split_sizes"] = [7, 3]
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["split_sizes"] == (7, 3)
    _grad(w)
    opt.step()
    assert opt.plans[0][1][0].split_sizes == (7, 3)


# ------------------------------------------------------------------ hyperparameters


@pytest.mark.parametrize(
    "key, value",
    [
        ("nesterov", "False"),
        ("nesterov", 0),
        ("normuon", "yes"),
        ("ns_steps", True),
        ("ns_steps", 2.0),
        ("ns_steps", 10**9),
        ("eps", math.inf),
        ("eps", 1e300),
        ("eps", math.nan),
        ("lr", math.inf),
        ("lr", 0.0),  # a new group's lr is > 0 (a loaded one may be 0: test_muon_resume)
        ("lr", True),
        ("lr", "0.02"),
        ("momentum", math.nan),
        ("weight_decay", math.inf),
        ("weight_decay", 1e3),  # lr * weight_decay > 1: every sign flips
        ("ns_coefficients", [(math.nan, 1.0, 1.0)]),
        ("ns_coefficients", [(3.4, -4.7, math.inf)]),
        ("ns_coefficients", [("3.4", -4.7, 2.0)]),
        ("ns_coefficients", [(True, -4.7, 2.0)]),
        ("ns_coefficients", []),
        ("ns_algorithm", ["auto"]),
        ("adjust_lr", ["none"]),
        ("param_names", [3]),
    ],
)
def test_wrong_hyperparameter_is_an_error_naming_it(key, value):
    """Each once ran (nesterov='False' as True, ns_steps=True as one step, eps=inf zeroing
    every update, NaN coefficients turning parameters NaN, lr=inf) or failed mid-step."""
    for build in (
        lambda: Muon([{"params": [_w(8, 4)], key: value}]),
        lambda: Muon([_w(8, 4)]).add_param_group({"params": [_w(8, 4, seed=1)], key: value}),
    ):
        with pytest.raises(ValueError, match=key):
            build()


@pytest.mark.parametrize(
    "key, value",
    [
        ("enable_all2all", "False"),
        ("expert_aware", "no"),
        ("max_inflight", True),
        ("max_inflight", 2.5),
        ("memory_budget", math.nan),
        ("memory_budget", math.inf),
        ("remainder_strategy", ["agrs"]),
        ("betas", 5),
    ],
)
def test_wrong_optimizer_option_is_an_error_naming_it(key, value):
    """Optimizer-wide options are checked like group keys ('False' ran as True)."""
    with pytest.raises(ValueError, match=key):
        Muon(
            [
                {"params": [_w(8, 4)]},
                {"params": [nn.Parameter(torch.zeros(4))], "algorithm": "adamw"},
            ],
            **{key: value},
        )


@pytest.mark.parametrize(
    "key, value",
    [("betas", (0.9, math.nan)), ("betas", "ab"), ("betas", (0.9,)), ("eps", math.inf)],
)
def test_wrong_adamw_hyperparameter_is_an_error_naming_it(key, value):
    with pytest.raises(ValueError, match=key):
        Muon([{"params": [nn.Parameter(torch.zeros(4))], "algorithm": "adamw", key: value}])


# ------------------------------------------------------------------ schedulers and NorMuon


def _muon_and_adamw(**kw):
    w, b = _w(16, 8), nn.Parameter(torch.zeros(8))
    opt = Muon([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], **kw)
    return opt, w, b


def test_cycled_momentum_is_the_adamw_groups_beta1():
    """OneCycleLR (cycle_momentum=True) writes `momentum` into every group; in an AdamW group
    it is beta1, as torch's AdamW + OneCycleLR cycles betas[0]: the AdamW step equals
    torch.optim.AdamW's under the same schedule, and a reload keeps the cycled beta1."""
    opt, w, b = _muon_and_adamw()
    ref_b = nn.Parameter(torch.zeros(8))
    ref = torch.optim.AdamW([ref_b], lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref, max_lr=0.1, total_steps=10)
    for step in range(4):
        _grad(w, seed=step), _grad(b, seed=10 + step)
        ref_b.grad = b.grad.clone()
        opt.step(), ref.step()
        sched.step(), ref_sched.step()
    assert "momentum" in opt.param_groups[1]  # the scheduler wrote it after the step
    torch.testing.assert_close(b.detach(), ref_b.detach(), rtol=1e-6, atol=1e-9)
    cycled = ref.param_groups[0]["betas"][0]
    assert cycled != 0.9
    other, _, _ = _muon_and_adamw()
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert other.param_groups[1]["betas"][0] == cycled
    assert "momentum" not in other.param_groups[1]


def test_normuon_state_into_an_optimizer_without_normuon_is_refused():
    """Loading a NorMuon state into an optimizer built without it (or the reverse) is an
    error naming normuon, not NorMuon turned on (or off) without a word."""
    for saved_on in (True, False):
        src, w, _ = _muon_and_adamw(normuon=saved_on)
        _grad(w)
        src.step()
        dst, _, _ = _muon_and_adamw(normuon=not saved_on)
        with pytest.raises(ValueError, match="normuon"):
            dst.load_state_dict(src.state_dict())
        assert dst.param_groups[0]["normuon"] is (not saved_on)


# ------------------------------------------------------------------ add_param_group


def test_failed_add_param_group_keeps_a_working_plan(monkeypatch):
    """A group refused after the step plan was rebuilt (here: creating its NorMuon moments
    fails) leaves the plan of the groups that remain: the next step runs."""
    import muon.normuon

    w = _w(16, 8)
    opt = Muon([w])
    before = opt.plan.fingerprint

    def fail(_opt):
        raise RuntimeError("no memory for the moments")

    monkeypatch.setattr(muon.normuon, "init_state", fail)
    with pytest.raises(RuntimeError, match="moments"):
        opt.add_param_group({"params": [_w(8, 8, seed=1)], "normuon": True})
    monkeypatch.undo()
    assert opt.plan.fingerprint == before and len(opt.param_groups) == 1
    _grad(w)
    start = w.detach().clone()
    opt.step()
    assert not torch.equal(w, start)
