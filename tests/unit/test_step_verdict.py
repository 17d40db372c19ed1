"""muon.verdict.StepVerdict on its own (single process): a step's verdict stays on the device
until asked, earlier steps' unread verdicts are summed there, a census skip counts at once, and
refusals are learnt from the census's sums or read when asked first."""

import torch

from muon.verdict import StepVerdict


def _refused(refusals: list, written: list[int], ranks: int) -> int:
    """How many positions fewer than `ranks` wrote (what `muon.verdict.refusals_learnt`
    counts, without the names)."""
    return sum(w < ranks for w in written)


def _step(v: StepVerdict, oks: list[list[bool]], finite: bool = True, on_host: int = 0) -> None:
    """One step as `Muon.step` drives its verdict, the census writing every position;
    `on_host` updates refused by the hyperparameters (AdamW's)."""
    v.settle()
    refusals = v.take_refusals()
    v.learn(refusals, [1] * sum(len(ok) for _, _, ok in refusals), 1)
    v.census(finite)
    if finite:
        v.start_update()
        if on_host:
            v.refuse_on_host(on_host)
        for ok in oks:
            v.record(None, None, torch.tensor(ok))
        v.finish_update()


def test_unread_steps_are_summed_on_the_device_and_counted_when_asked():
    v = StepVerdict(_refused)
    assert not v.last_step_skipped and v.skipped_steps == 0 and v.step_skipped is False
    _step(v, [[True, True]])
    _step(v, [[True], [False]])
    flag = v.step_skipped
    assert isinstance(flag, torch.Tensor) and flag.dim() == 0 and bool(flag)
    _step(v, [[False]])
    _step(v, [[True]])
    assert not v.last_step_skipped
    assert v.skipped_steps == 2


def test_a_census_skip_counts_at_once_and_a_read_verdict_is_not_counted_twice():
    v = StepVerdict(_refused)
    _step(v, [[False]])
    assert v.last_step_skipped  # read: `settle` counts the value it found
    _step(v, [], finite=False)
    assert v.step_skipped is True and v.last_step_skipped
    assert v.skipped_steps == 2
    _step(v, [[True]])
    assert v.skipped_steps == 2 and not v.last_step_skipped


def test_refusals_are_read_when_asked_before_the_next_census():
    v = StepVerdict(_refused)
    _step(v, [[True, False], [False]], on_host=2)
    assert v.refused_updates == 4  # 2 on the host, counted at once; 2 read from the verdicts
    assert v.take_refusals() == []  # read once: the next census carries none
    assert v.last_step_skipped
    _step(v, [[True]], on_host=1)  # refused on the host alone: the step is skipped too
    assert v.last_step_skipped and v.refused_updates == 5
