"""The update guard over a batch (`muon.guard.guard_batch`): a parameter whose update does not
fit its dtype keeps its value (no decay) and gets a zero update; the others are decayed exactly
as an in-place multiply by the Python scalar would, whatever the batch's shapes."""

import pytest
import torch

from muon.guard import guard_batch


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
