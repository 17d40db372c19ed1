"""The run guard's decisions (recipes.guards) and the rotation that keeps the last trained
checkpoint (recipes.checkpoint.rotate), on plain numbers and directories: no world."""

import json
import logging
import math

import pytest
import torch

from recipes import checkpoint
from recipes.bench.probe import DeviceProbe
from recipes.guards import RunGuard
from recipes.metrics import DeviceValues

LN_256 = math.log(256)


def _guard(**kw) -> RunGuard:
    args = {"max_skipped_in_row": 3, "divergence_steps": 4, "on_divergence": "warn"}
    return RunGuard(**(args | kw), vocab_size=256, rank=0)


def _run(guard: RunGuard, losses, skipped=None) -> int | None:
    """Feed one step per loss; the step the guard stops at (None: it never does)."""
    for step, loss in enumerate(losses, start=1):
        guard.count(bool(skipped and skipped[step - 1]), DeviceValues())
        if guard.halts(step, {"loss": loss}, saving=False):
            return step
    return None


def test_skips_in_a_row_stop_the_run_a_trained_step_resets_the_count():
    guard = _guard()
    # two skips, a trained step, then three skips: the third in a row stops (step 6)
    assert _run(guard, [5.0] * 8, skipped=[1, 1, 0, 1, 1, 1, 0, 0]) == 6
    assert guard.stop_reason.startswith("3 steps in a row skipped (steps 4-6")
    assert "train.max_skipped_in_row=3" in guard.stop_reason
    assert _run(_guard(max_skipped_in_row=0), [5.0] * 8, skipped=[1] * 8) is None  # 0: never


def test_the_streak_on_the_device_is_read_with_the_figures_or_before_a_save():
    """Muon's verdict is a device tensor: the streak stays one (in the step's values) until a
    read; a save reads it itself, so no checkpoint follows the N-th skip."""
    guard = _guard()
    probe = DeviceProbe()
    for step in (1, 2, 3):
        values = DeviceValues()
        verdict = torch.tensor(True)
        probe.mark(verdict)  # on the device
        with probe.tracking(), probe.region("count") as counted:
            guard.count(verdict, values)
            if step < 3:  # a step not logged: no figures, no stop
                assert not guard.halts(step, {}, saving=False)
        assert counted.n_syncs == 0 and isinstance(guard.streak, torch.Tensor)
    figures = {k: v[0] for k, v in values.read().items()}
    assert figures == {"skipped_in_row": 3.0}
    guard.take(figures)
    assert figures == {} and guard.streak == 3
    assert guard.halts(3, {}, saving=False)

    saving = _guard()
    for _ in range(3):
        saving.count(torch.tensor(True), DeviceValues())
    assert saving.halts(3, {}, saving=True) and saving.streak == 3


def test_state_says_whether_the_step_trained_and_a_resume_continues_the_streak():
    guard = _guard(max_skipped_in_row=5)
    _run(guard, [5.6, 5.0, 4.0])
    assert guard.state() == {"skipped_in_row": 0, "trained": True}
    _run(guard, [4.0], skipped=[1])
    assert guard.state() == {"skipped_in_row": 1, "trained": False}
    again = _guard(max_skipped_in_row=2)
    again.resume(guard.state())
    assert _run(again, [4.0], skipped=[1]) == 1  # 1 saved + 1 more = 2
    nan = _guard()
    _run(nan, [5.6, float("nan")])
    assert nan.state()["trained"] is False  # a non-finite last loss


def test_a_loss_stuck_at_the_uniform_guess_warns_after_k_steps(caplog):
    """optim.lr=1e6 on tiny: 5.5632 at step 1, then ln 256 = 5.5452 on every step."""
    guard = _guard()
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert _run(guard, [5.5632] + [LN_256] * 10) is None  # warn: the run goes on
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned  # once per episode
    assert "at a uniform guess's ln(vocab) = 5.5452 since step 2" in warned[0]
    assert "step 5" in warned[0]  # steps 2..5: K = 4
    assert guard.state()["trained"] is False


def test_an_exploding_loss_warns_and_can_stop_the_run(caplog):
    """AdamW at optim.lr=1e6 reaches 1e13; a healthy curve (5.56 falling, noisy) never warns;
    a loss at ln(vocab) from the first step (a model that has not left its init) does not."""
    with caplog.at_level(logging.WARNING, logger="recipes"):
        assert _run(_guard(), [5.56, 5.2, 4.6, 4.8, 4.3, 4.5, 3.8, 3.9, 3.6]) is None
        assert _run(_guard(), [LN_256 + 1e-3] * 10) is None
        assert not caplog.records
        assert _run(_guard(), [5.56, 5.0, 9.0, 1e6, 1e13, 1e13]) is None
    assert "above max(first loss 5.5600, ln(vocab) 5.5452) by more than 5%" in caplog.text
    stop = _guard(on_divergence="stop")
    assert _run(stop, [5.56, 5.0, 9.0, 1e6, 1e13, 1e13]) == 6  # bad from step 3: K = 4
    assert (
        "the loss diverged" in stop.stop_reason and "train.on_divergence=stop" in stop.stop_reason
    )
    recovered = _guard(on_divergence="stop")
    assert _run(recovered, [5.56, 9.0, 9.0, 9.0, 4.0, 9.0, 9.0, 9.0, 4.0]) is None


def _committed(root, step: int, trained: bool | None) -> None:
    ckpt = checkpoint.step_dir(root, step)
    ckpt.mkdir(parents=True)
    state = {"step": step} | ({} if trained is None else {"trained": trained})
    (ckpt / "trainer.json").write_text(json.dumps(state))
    (ckpt / checkpoint.COMMITTED).write_text(f"{step}\n")


@pytest.mark.parametrize(
    ("flags", "keep", "left"),
    [
        # the newest `keep` and the last trained one; untrained ones before it go
        ([True, True, False, False, False], 2, [2, 4, 5]),
        ([True, True, True, True], 2, [3, 4]),  # all trained: the newest `keep`, as before
        ([None, False, False], 1, [1, 3]),  # written before the flag: trained
        ([False, False, False], 1, [3]),  # none trained: nothing more to keep
    ],
)
def test_rotation_keeps_the_last_checkpoint_whose_step_trained(tmp_path, flags, keep, left):
    for step, flag in enumerate(flags, start=1):
        _committed(tmp_path, step, flag)
    checkpoint.rotate(tmp_path, keep)
    assert [int(c.name.removeprefix("step_")) for c in checkpoint.committed(tmp_path)] == left


def test_a_replaced_run_keeps_its_export(tmp_path):
    """checkpoint.resume=false sets the old run aside whole: its hf/ too, so the new run's
    export never overwrites it."""
    _committed(tmp_path / "checkpoints", 6, True)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    aside = checkpoint.set_aside(tmp_path)
    assert aside == tmp_path / "replaced-1"
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "hf", "metrics.jsonl"]
    assert (aside / "hf" / "config.json").read_text() == "{}" and not (tmp_path / "hf").exists()
