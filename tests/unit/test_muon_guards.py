"""Muon rejects what it cannot do: group keys, group edits, state dicts (muon/validate.py,
muon/optimizer.py). Single process, CPU, fast."""

import copy

import pytest
import torch
from torch import nn

from muon import Muon
from muon.validate import ADAMW_GROUP_KEYS, MUON_GROUP_KEYS


def _w(*shape, seed=0):
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


# ----------------------------------------------------------------------------- group keys


@pytest.mark.parametrize(
    "group, key, names",
    [
        ({"num_experts": 4}, "num_experts", ["num_blocks"]),
        ({"split_size": [16, 16]}, "split_size", list(MUON_GROUP_KEYS)),  # a typo
        ({"algorithm": "adamw", "maximize": True}, "maximize", list(ADAMW_GROUP_KEYS)),
        ({"algorithm": "adamw", "amsgrad": True}, "amsgrad", list(ADAMW_GROUP_KEYS)),
        ({"algorithm": "adamw", "weight_decy": 0.1}, "weight_decy", list(ADAMW_GROUP_KEYS)),
        ({"algorithm": "adamw", "momentum": 0.9}, "momentum", ["betas"]),
        ({"betas": (0.9, 0.99)}, "betas", list(MUON_GROUP_KEYS)),
    ],
    ids=[
        "renamed",
        "muon-unknown",
        "maximize",
        "amsgrad",
        "typo",
        "muon-key-in-adamw",
        "adamw-key",
    ],
)
def test_unknown_group_keys_are_rejected_by_name(group, key, names):
    """Every key of every group is checked, in the constructor and in add_param_group; the
    message names the key and the accepted keys (a renamed key its new name)."""
    for build in (
        lambda: Muon([{"params": [_w(32, 16)], **group}]),
        lambda: Muon([_w(8, 8)]).add_param_group({"params": [_w(32, 16)], **group}),
    ):
        with pytest.raises(ValueError) as info:
            build()
        msg = str(info.value)
        assert repr(key) in msg, msg
        for name in names:
            assert name in msg, msg


def test_accepted_keys_and_scheduler_keys_pass():
    w, b = _w(32, 16), nn.Parameter(torch.zeros(16))
    opt = Muon(
        [
            {"params": [w], "num_blocks": 2, "ns_dtype": "float32"},
            {"params": [b], "algorithm": "adamw", "lr": 1e-3, "betas": (0.8, 0.9), "eps": 1e-6},
        ]
    )
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # writes "initial_lr"
    opt.add_param_group({"params": [_w(8, 8)], "initial_lr": 0.1})
    assert set(opt.param_groups[1]) <= set(ADAMW_GROUP_KEYS) | {"initial_lr"}


# ----------------------------------------------------------------------------- add_param_group


@pytest.mark.parametrize(
    "bad",
    [
        lambda w: {"params": [_w(30, 16)], "num_blocks": 4},  # 4 does not divide 30 rows
        lambda w: {"params": [_w(32, 16)], "lr": -1.0},
        lambda w: {"params": [nn.Parameter(torch.zeros(8))]},  # a vector in a Muon group
        lambda w: {"params": [w]},  # already in the optimizer
    ],
    ids=["num_blocks", "lr", "vector", "duplicate"],
)
def test_rejected_param_group_leaves_optimizer_unchanged(bad):
    """A rejected group is not kept: groups, state and plan are as before, and the same
    parameters can be added again in a valid group."""
    w = _w(16, 8)
    opt = Muon([w], ns_dtype="float32")
    before = (len(opt.param_groups), len(opt.state), opt.plan.fingerprint)
    group = bad(w)
    with pytest.raises(ValueError):
        opt.add_param_group(group)
    assert (len(opt.param_groups), len(opt.state), opt.plan.fingerprint) == before
    if group["params"][0] is not w:  # its parameter can still be added, and is then trained
        new = group["params"][0]
        algorithm = "adamw" if new.ndim == 1 else "muon"
        opt.add_param_group({"params": [new], "algorithm": algorithm})
        new.grad = torch.ones_like(new)
        w.grad = torch.ones_like(w)
        start = new.detach().clone()
        opt.step()
        assert not torch.equal(new, start)


# ----------------------------------------------------------------------------- AdamW lr


def test_adamw_group_without_lr_takes_adamw_default_not_muon_lr():
    """An AdamW group without its own lr uses `adamw_lr` (default 3e-3, the same as
    muon.param_groups), not Muon's lr."""
    b = nn.Parameter(torch.zeros(4))
    opt = Muon([{"params": [_w(8, 8)]}, {"params": [b], "algorithm": "adamw"}], lr=0.02)
    assert opt.param_groups[1]["lr"] == 3e-3
    opt = Muon([{"params": [b], "algorithm": "adamw"}], lr=0.02, adamw_lr=1e-4)
    assert opt.param_groups[0]["lr"] == 1e-4
    b.grad = torch.ones_like(b)
    opt.step()  # the first AdamW step moves each entry by lr (bias-corrected m / sqrt(v) = 1)
    torch.testing.assert_close(b.detach(), torch.full((4,), -1e-4), rtol=1e-4, atol=0)


# ----------------------------------------------------------------------------- load_state_dict


def _pair(**kw):
    """Two optimizers on equal copies of one [32, 16] matrix and a bias."""
    made = []
    for group_kw in ({}, kw):
        w, b = _w(32, 16, seed=1), nn.Parameter(torch.zeros(16))
        groups = [{"params": [w], **group_kw}, {"params": [b], "algorithm": "adamw"}]
        made.append((Muon(groups, ns_dtype="float32"), w, b))
    return made


def _step(opt, w, b, seed):
    gen = torch.Generator().manual_seed(seed)
    w.grad, b.grad = torch.randn(32, 16, generator=gen), torch.randn(16, generator=gen)
    opt.step()


def test_load_state_dict_replans_when_planning_keys_change():
    """Loading groups with another num_blocks / ns_dtype re-plans: the next step equals that of
    an optimizer built with the loaded groups (block rows and wire dtype included)."""
    for kw in ({"num_blocks": 4}, {"ns_dtype": "bfloat16"}):
        (a, wa, ba), (b, wb, bb) = _pair(**kw)
        _step(b, wb, bb, seed=2)
        with torch.no_grad():
            wa.copy_(wb), ba.copy_(bb)
        a.load_state_dict(copy.deepcopy(b.state_dict()))  # torch shares same-device tensors
        (pa,), (pb,) = a.plans[0][1], b.plans[0][1]
        assert (pa.num_blocks, pa.wire_dtype) == (pb.num_blocks, pb.wire_dtype), kw
        _step(a, wa, ba, seed=3)
        _step(b, wb, bb, seed=3)
        assert torch.equal(wa, wb) and torch.equal(ba, bb), kw


@pytest.mark.parametrize(
    "edit, name",
    [
        (lambda sd: sd["param_groups"][0].update(num_blocks=3), "num_blocks"),  # 32 rows
        (lambda sd: sd["param_groups"][0].update(lr=-1.0), "lr"),
        (lambda sd: sd["param_groups"][1].update(betas=(1.5, 0.9)), "betas"),
        (lambda sd: sd["param_groups"][0].update(num_experts=4), "num_experts"),
        (lambda sd: sd["param_groups"][0].update(algorithm="adamw"), "algorithm"),
        (lambda sd: sd["state"][0].update(momentum_buffer=torch.zeros(16, 32)), "momentum_buffer"),
    ],
    ids=["num_blocks", "lr", "betas", "unknown-key", "algorithm", "state-shape"],
)
def test_load_state_dict_validates_before_loading(edit, name):
    """A bad state dict is refused, naming the key, and nothing of it is loaded."""
    (a, _, _), (b, _, _) = _pair()
    sd = b.state_dict()
    edit(sd)
    before = (copy.deepcopy(a.param_groups[0]["lr"]), a.plan.fingerprint)
    with pytest.raises(ValueError) as info:
        a.load_state_dict(sd)
    assert name in str(info.value), str(info.value)
    assert (a.param_groups[0]["lr"], a.plan.fingerprint) == before


def test_param_appended_in_place_is_an_error_at_the_next_step():
    """A parameter appended to a group's list would be skipped silently (never planned, no
    state): the next step refuses, naming the group and add_param_group."""
    opt = Muon([_w(8, 8)])
    extra = _w(8, 8, seed=1)
    opt.param_groups[0]["params"].append(extra)
    extra.grad = torch.ones_like(extra)
    with pytest.raises(RuntimeError, match=r"param_groups\[0\]\['params'\].*add_param_group"):
        opt.step()
