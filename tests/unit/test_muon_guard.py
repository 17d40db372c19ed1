"""The update check (`muon.guard`): a parameter whose written value `X * decay - lr * U` could
pass its dtype's range (or holds NaN) is refused: it keeps its value (no decay) and gets a zero
update; the others are decayed exactly as an in-place multiply by the Python scalar would,
whatever the batch's shapes. Over the slots of one stacked tensor (`slot_peaks`,
`zero_unfit_slots_`) it finds and writes the same, bit for bit."""

import pytest
import torch

from muon import guard


def _check_write(X, U, lr, decay, u_peaks=None):
    """This rank's verdicts, then the decay and zeros (`muon.phases.write_`'s order)."""
    ok = guard.fits(X, guard.peaks(U) if u_peaks is None else u_peaks, lr, decay)
    guard.zero_unfit_(U, ok)
    guard.decay_(X, ok, decay)
    return ok


@pytest.mark.parametrize("shapes", [[(4, 3)] * 3, [(4, 3), (2, 5), (7,)]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_only_the_updates_that_fit_are_written(shapes, dtype):
    gen = torch.Generator().manual_seed(0)
    X = [torch.randn(s, generator=gen).clamp(-3, 3).to(dtype) for s in shapes]
    U = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    U = [(u / u.float().abs().amax()).to(dtype) for u in U]  # peaks of 1 (rounded: at most 1)
    U[1][0] = float("nan")  # a NaN fails, whatever lr
    U[0][0] = 4.0  # lr * 4 is twice the dtype's largest value
    lr = 0.5 * torch.finfo(dtype).max  # fits a peak of 1 beside |X| <= 3
    before = [x.clone() for x in X]
    decay = 1 - 0.01 * 0.1
    ok = _check_write(X, U, lr, decay)
    assert ok.tolist() == [False, False, True]
    assert torch.equal(X[0], before[0]) and torch.equal(X[1], before[1])
    want = before[2].clone()
    want.mul_(decay)  # the rounding of an in-place mul by the Python scalar
    assert torch.equal(X[2], want)
    assert not U[0].any() and not U[1].any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decay", [1.0, 1 - 0.01 * 0.1])
def test_the_stacked_check_writes_what_the_per_parameter_check_writes(dtype, decay):
    """Slots in a permuted order, a slot of no parameter and padding rows (zeros, as the
    exchange paths leave them), a NaN, an overflow: the same verdicts, parameters and updates."""
    gen = torch.Generator().manual_seed(1)
    S, rows, pad, C = 5, 3, 2, 4
    U_S = torch.zeros(S, rows + pad, C, dtype=dtype)
    U_S[:, :rows] = torch.randn(S, rows, C, generator=gen).clamp(-1, 1).to(dtype)
    U_S[4] = 0  # the slot of no parameter
    slots = [2, 0, 3, 1]  # parameter k's update is in slot slots[k]
    U_S[0, 1, 2] = float("nan")  # parameter 1
    U_S[3, 0, 0] = 8.0  # parameter 2: lr * 8 overflows
    lr = 0.25 * torch.finfo(dtype).max
    X = [torch.randn(rows, C, generator=gen).clamp(-3, 3).to(dtype) for _ in slots]
    X_ref = [x.clone() for x in X]
    U_ref = [U_S[s, :rows].clone() for s in slots]
    ref = _check_write(X_ref, U_ref, lr, decay)
    by_slot = guard.slot_peaks(U_S).unbind()
    ok = guard.fits(X, torch.stack([by_slot[s] for s in slots]), lr, decay)
    ok_S = torch.stack([ok[slots.index(s)] if s in slots else torch.tensor(True) for s in range(S)])
    guard.zero_unfit_slots_(U_S, ~ok_S)
    guard.decay_(X, ok, decay)
    assert ref.tolist() == ok.tolist() == [True, False, False, True]
    for k, s in enumerate(slots):
        assert torch.equal(X[k], X_ref[k]), k
        assert torch.equal(U_S[s, :rows], U_ref[k]), k


def test_the_value_written_is_checked_not_the_update_alone():
    """float16 at 40000 with lr * |U| = 65000: the update alone fits 65504, the value written
    (up to 105000) does not (it wrote infinities); a parameter far from the range passes. An lr
    past float16's range would be clamped to 65504 (a smaller update than asked): refused,
    unless the update is zero."""
    X = [torch.full((2, 2), 40000.0).half(), torch.full((2, 2), 1.0).half()]
    U = [torch.full((2, 2), 1.0).half(), torch.full((2, 2), 1.0).half()]
    assert _check_write(X, U, 65000.0, 1.0).tolist() == [False, True]
    X = [torch.ones(2, 2).half(), torch.ones(2, 2).half()]
    U = [torch.full((2, 2), 0.5).half(), torch.zeros(2, 2).half()]
    assert _check_write(X, U, 1e5, 1.0).tolist() == [False, True]
