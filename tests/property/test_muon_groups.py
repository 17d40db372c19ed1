"""Properties of Muon groups on generated input (tests/property/muon_cases.py): a parameter
2-D, 3-D (experts) or of uneven rows, in float32, bf16 or float16; `num_blocks` and
`split_sizes` valid or not (tuples, lists, sets, wrong sums, zeros); every hyperparameter
with values of every type (bools, strings, NaN, infinities, negatives, huge); the optimizer-wide
options (`enable_all2all`, `expert_aware`, `max_inflight`, `memory_budget`,
`remainder_strategy`) likewise.

Either the optimizer refuses, with an error naming a key whose value the documented contract
refuses (and then such a key exists), or the contract accepts the group and one step from a
zero parameter equals the per-block reference (`muon_cases.reference_step`, whose docstring
derives the bound), with no row whose reference update is nonzero left without an update; a
step whose update does not fit the parameter's dtype is marked skipped and changes nothing.
"""

from __future__ import annotations

import warnings

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from muon import Muon
from tests.property.muon_cases import (
    invalid_keys,
    invalid_options,
    muon_groups,
    options,
    reference_step,
)


def _build(param, group, opts):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return Muon([{"params": [param], **group}], **opts)


def check_group(shape, dtype, group, seed, opts=None):
    param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
    opts = opts or {}
    bad = invalid_keys(shape, group) | invalid_options(opts)
    try:
        opt = _build(param, group, opts)
    except (ValueError, TypeError) as e:
        event("refused")
        assert bad, f"refused a valid group {group}: {e}"
        assert any(repr(k) in str(e) or f"{k}:" in str(e) or k in str(e) for k in bad), (
            f"{e} names none of {sorted(bad)}"
        )
        return
    assert not bad, f"accepted {sorted(bad)} in {group}"
    gen = torch.Generator().manual_seed(seed)
    param.grad = torch.randn(shape, generator=gen).to(dtype)
    want, tol, fits = reference_step(shape, dtype, group, param.grad)
    opt.step()
    event(
        "skipped"
        if opt.last_step_skipped
        else f"stepped {dtype} ns {opt.param_groups[0]['ns_dtype']}"
    )
    assert opt.last_step_skipped == (not fits), (opt.last_step_skipped, fits)
    got = param.detach()
    if not fits:
        assert not got.any()
        return
    err = (got.double() - want.double()).abs()
    assert (err <= tol).all(), f"max err {err.max().item():.3g}, tol there {tol[err.argmax()]}"
    rows_want = want.reshape(-1, shape[-1]).ne(0).any(1)
    rows_got = got.reshape(-1, shape[-1]).ne(0).any(1)
    assert rows_got[rows_want].all(), "a row with a reference update was left without one"


@settings(max_examples=4 * settings.default.max_examples)
@given(muon_groups(), st.integers(0, 2**16), options())
@example(((10, 6), torch.float32, {"split_sizes": (5, 3, 2)}), 0, {})  # MLA: nope + rope odd
@example(((12, 4), torch.float32, {"split_sizes": (4, 4)}), 0, {})  # equal, not covering
@example(((10, 4), torch.float32, {"split_sizes": {6, 4}}), 0, {})  # a set
@example(((8, 4), torch.float32, {"nesterov": "False"}), 0, {})
@example(((8, 4), torch.float32, {"ns_steps": True}), 0, {})
@example(((8, 4), torch.float32, {"eps": float("inf")}), 0, {})
@example(((8, 4), torch.float32, {"lr": float("inf")}), 0, {})
@example(((8, 4), torch.float16, {"lr": 1e6}), 0, {})  # the update overflows float16: skipped
@example(((10, 6), torch.float16, {"split_sizes": (5, 3, 2), "lr": 1e6}), 0, {})
@example(((8, 4), torch.float32, {}), 0, {"enable_all2all": "False", "max_inflight": True})
@example(((8, 4), torch.float32, {"ns_coefficients": [(float("nan"), 1.0, 1.0)]}), 0, {})
@example(((1, 1, 1), torch.float32, {"eps": 1e300}), 0, {})  # found: clamp overflowed bf16
def test_group_is_the_reference_or_a_named_error(case, seed, opts):
    check_group(*case, seed, opts)
