"""Properties of `Muon.load_state_dict` on generated groups (tests/property/muon_cases.py):
save a valid optimizer (a Muon group and an AdamW group) after one step, set one key of one
saved group to a generated value (valid, a near miss or junk; for AdamW also a scheduler's
`momentum`), load it into an optimizer built like the saved one.

Either the load refuses, naming the key, and the optimizer's groups are as before; or the
loaded groups are ones the constructor accepts, and the next step equals, bit for bit, that of
a fresh optimizer built with the loaded groups and given the same state (the same arithmetic
on the same plan).
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from muon import Muon
from tests.property.muon_cases import JUNK, VALID, blocks_of, muon_groups, value_for

MUON_KEYS = sorted(VALID) + ["num_blocks", "split_sizes", "algorithm", "param_names"]
NAMES = st.sampled_from([["w"], ["renamed"], ["a", "b"], [3], [None], "w", None])
ADAMW_VALUES = {
    "lr": st.one_of(st.sampled_from([1e-3, 0.0, -1.0, math.inf]), JUNK),
    "weight_decay": st.one_of(st.sampled_from([0.0, 0.1, -1.0]), JUNK),
    "eps": st.one_of(st.sampled_from([1e-8, 0.0, math.nan]), JUNK),
    "betas": st.one_of(st.sampled_from([(0.8, 0.99), [0.9, 0.95], (1.0, 0.9), (0.9,)]), JUNK),
    "momentum": st.one_of(st.sampled_from([0.85, 0.95, 1.5]), JUNK),  # OneCycleLR's beta1
    "algorithm": st.sampled_from(["muon", "sgd"]),
}


@st.composite
def edits(draw):
    """(shape, dtype, Muon group, saved group index, key, value)."""
    shape, dtype, group = draw(muon_groups(valid=True))
    index, key = draw(st.sampled_from([(0, k) for k in MUON_KEYS] + [(1, k) for k in ADAMW_VALUES]))
    if index == 1:
        return shape, dtype, group, 1, key, draw(ADAMW_VALUES[key])
    if key in ("num_blocks", "split_sizes"):
        blocks = draw(blocks_of(shape, draw(st.booleans())))
        value = blocks.get(key, draw(st.sampled_from([None, 1])))
    elif key == "param_names":
        value = draw(NAMES)
    elif key == "algorithm":
        value = draw(st.sampled_from(["adamw", "sgd", None]))
    else:
        value = draw(value_for(key, draw(st.booleans())))
    return shape, dtype, group, 0, key, value


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _build(groups):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Muon(groups)


def _without_params(groups):
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def check_edit(shape, dtype, group, index, key, value):
    def fresh(groups=None):
        gen = torch.Generator().manual_seed(0)
        w = torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
        b = torch.nn.Parameter(torch.zeros(3))
        gs = groups or [group, {"algorithm": "adamw"}]
        return _build([{**gs[0], "params": [w]}, {**gs[1], "params": [b]}]), [w, b]

    saved, params = fresh()
    _grads(params, 1)
    saved.step()
    sd = copy.deepcopy(saved.state_dict())
    sd["param_groups"][index][key] = value
    opt, params = fresh()
    before = repr(_without_params(opt.param_groups))
    try:
        opt.load_state_dict(sd)
    except (ValueError, TypeError) as e:
        event(f"refused ({key})")
        assert key in str(e) or (key == "split_sizes" and "num_blocks" in str(e)), str(e)
        assert repr(_without_params(opt.param_groups)) == before
        return
    event("loaded")
    loaded = _without_params(opt.param_groups)
    # the constructor accepts them, but for an lr of 0 (a scheduler's: loadable, not a new
    # group's), which the load brings back
    built = [{**g, "lr": g["lr"] or 1e-3} for g in copy.deepcopy(loaded)]
    other, other_params = fresh(built)
    assert repr(_without_params(other.param_groups)) == repr(_without_params(built))
    with torch.no_grad():
        for p, q in zip(params, other_params, strict=True):
            q.copy_(p)
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert repr(_without_params(other.param_groups)) == repr(loaded)
    _grads(params, 2), _grads(other_params, 2)
    opt.step(), other.step()
    for p, q in zip(params, other_params, strict=True):
        assert torch.equal(p, q)


@settings(max_examples=4 * settings.default.max_examples)
@given(edits())
@example(((12, 4), torch.float32, {"split_sizes": (6, 6)}, 0, "split_sizes", (4, 4)))
@example(((12, 4), torch.float32, {"split_sizes": (6, 6)}, 0, "split_sizes", (3, 3, 3)))
@example(((12, 4), torch.float32, {"split_sizes": (6, 6)}, 0, "split_sizes", (4, 4, 4)))
@example(((10, 4), torch.float32, {"split_sizes": (6, 4)}, 0, "split_sizes", [7, 3]))
@example(((10, 4), torch.float32, {"split_sizes": (6, 4)}, 0, "split_sizes", {6, 4}))
@example(((8, 4), torch.float32, {}, 0, "normuon", True))  # NorMuon state where none is kept
@example(((8, 4), torch.float32, {"normuon": True}, 0, "normuon", False))
@example(((8, 4), torch.float32, {}, 1, "momentum", 0.85))  # OneCycleLR's cycled beta1
@example(((8, 4), torch.float32, {}, 0, "param_names", ["w"]))  # found: names in one group only
@example(((8, 4), torch.float32, {}, 0, "param_names", None))  # found: a None kept as a key
@example(((1, 1, 1), torch.float32, {}, 1, "lr", 1e300))  # found: AdamW's scale overflowed
@example(((1, 1), torch.float32, {}, 0, "lr", 0))  # a schedule's end: loads, steps as lr 0
# found: NorMuon's moments were checked against the blocks before the load, not the loaded ones
@example(((2, 1), torch.float32, {"num_blocks": 2, "normuon": True}, 0, "num_blocks", 1))
def test_loaded_groups_are_the_reference_or_a_named_error(case):
    check_edit(*case)
