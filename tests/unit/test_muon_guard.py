"""The update guard over a batch (`muon.guard.guard_batch`): a parameter whose update does not
fit its dtype keeps its value (no decay) and gets a zero update; the others are decayed exactly
as an in-place multiply by the Python scalar would, whatever the batch's shapes. Over the slots
of one stacked tensor (`guard_stacked`) it writes the same, bit for bit."""

import pytest
import torch

from muon.guard import guard_batch, guard_stacked


@pytest.mark.parametrize("shapes", [[(4, 3)] * 3, [(4, 3), (2, 5), (7,)]])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_only_the_updates_that_fit_are_written(shapes, dtype):
    gen = torch.Generator().manual_seed(0)
    X = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    U = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    U = [(u / u.float().abs().amax()).to(dtype) for u in U]  # peaks of 1 (rounded: at most 1)
    U[1][0] = float("nan")  # a NaN fails, whatever lr
    U[0][0] = 4.0  # lr * 4 is twice the dtype's largest value
    lr = 0.5 * torch.finfo(dtype).max  # fits a peak of 1
    before = [x.clone() for x in X]
    decay = 1 - 0.01 * 0.1
    verdicts = []
    out = guard_batch(X, U, lr, decay, verdicts)
    assert verdicts[0].tolist() == [False, False, True]
    assert torch.equal(X[0], before[0]) and torch.equal(X[1], before[1])
    want = before[2].clone()
    want.mul_(decay)  # the rounding of an in-place mul by the Python scalar
    assert torch.equal(X[2], want)
    assert not out[0].any() and not out[1].any() and torch.equal(out[2], U[2])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("decay", [1.0, 1 - 0.01 * 0.1])
def test_the_stacked_guard_writes_what_the_per_parameter_guard_writes(dtype, decay):
    """Slots in a permuted order, a slot of no parameter and padding rows (zeros, as the
    exchange paths leave them), a NaN, an overflow: the same verdicts, parameters and updates."""
    gen = torch.Generator().manual_seed(1)
    S, rows, pad, C = 5, 3, 2, 4
    U_S = torch.zeros(S, rows + pad, C, dtype=dtype)
    U_S[:, :rows] = torch.randn(S, rows, C, generator=gen).clamp(-1, 1).to(dtype)
    U_S[4] = 0  # the slot of no parameter
    slots = [2, 0, 3, 1]  # parameter k's update is in slot slots[k]
    U_S[0, 1, 2] = float("nan")  # parameter 1
    U_S[3, 0, 0] = 4.0  # parameter 2: lr * 4 overflows
    lr = 0.5 * torch.finfo(dtype).max
    X = [torch.randn(rows, C, generator=gen).to(dtype) for _ in slots]
    X_ref = [x.clone() for x in X]
    U_ref = [U_S[s, :rows].clone() for s in slots]
    ref, got = [], []
    guard_batch(X_ref, U_ref, lr, decay, ref)
    guard_stacked(X, U_S, slots, lr, decay, got)
    assert ref[0].tolist() == [True, False, False, True]
    assert got[0].tolist() == [
        ref[0][slots.index(s)].item() if s in slots else True for s in range(S)
    ]
    for k, s in enumerate(slots):
        assert torch.equal(X[k], X_ref[k]), k
        assert torch.equal(U_S[s, :rows], U_ref[k]), k
    assert not U_S[:, rows:].any() and not U_S[4].any()
