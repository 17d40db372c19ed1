"""Run-level guards through `python train.py` (2 CPU ranks, ep=1, the tiny preset's smallest
batches): a run whose steps all skip stops with status 1 and no export, keeping its last
trained checkpoint (a NaN checkpoint, and an lr that overflows the weights); a loss stuck at
a uniform guess warns; a second start on a held run directory is refused before any rank."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from recipes import checkpoint
from recipes.runlock import LOCK_NAME
from tests.train_cli import train_py


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    from recipes.data import build_stdlib_tokens

    path = tmp_path_factory.mktemp("token-cache")
    build_stdlib_tokens(str(path))
    return str(path)


def _args(cache: str, *extra: str) -> list[str]:
    small = ["mesh.world_size=2", "mesh.ep=1", "data.seq_len=32", "data.batch_size=2"]
    small += [f"data.cache_dir={cache}", "train.warmup_steps=1", "logger=none"]
    return [*small, "metrics.progress=false", "metrics.memory_every=1000", *extra]


def _steps(root: Path) -> list[int]:
    (run_dir,) = (root / "default").iterdir()
    return [
        int(c.name.removeprefix("step_")) for c in checkpoint.committed(run_dir / "checkpoints")
    ]


def _files(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def test_steps_skipped_in_a_row_stop_the_run_and_a_held_run_directory_refuses(cache, tmp_path):
    """optim.lr=1e30: step 1 trains and overflows the weights, every later step skips. With
    train.max_skipped_in_row=3 the run stops after step 4 (status 1, the message names the
    last trained checkpoint, no export); checkpoint.keep=1 still keeps step 1 beside step 3.
    Then, while another process holds the run directory's lock, the same command is refused
    naming it, before any rank starts (a dead holder's lock: tests/unit/test_runlock.py)."""
    args = _args(cache, "optim.lr=1e30", "train.steps=30", "train.max_skipped_in_row=3")
    args += ["checkpoint.every=1", "checkpoint.keep=1"]
    proc = train_py(args, tmp_path)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "default").iterdir()
    first = checkpoint.step_dir(run_dir / "checkpoints", 1)
    assert (
        "train.py: stopped: 3 steps in a row skipped (steps 2-4: non-finite gradients or "
        "updates; train.max_skipped_in_row=3)"
    ) in proc.stderr, proc.stderr[-3000:]
    assert "the run stopped at step 4 without a checkpoint of it or an export" in proc.stderr
    assert f"the last checkpoint whose step trained: {first}" in proc.stderr
    assert _steps(tmp_path) == [1, 3] and not (run_dir / "hf").exists()
    assert [checkpoint.trained(c) for c in checkpoint.committed(run_dir / "checkpoints")] == [
        True,
        False,
    ]
    assert (run_dir / LOCK_NAME).read_text() == ""  # released at exit

    code = f"from recipes.runlock import hold; hold({str(run_dir)!r}); print('held', flush=True)"
    holder = subprocess.Popen(
        [sys.executable, "-c", code + "; import time; time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
    )
    try:
        assert holder.stdout.readline() == "held\n"
        refused = train_py(args, tmp_path)
        assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
        assert (
            f"train.py: run directory {run_dir} is in use by pid {holder.pid} on host "
            f"{socket.gethostname()}"
        ) in refused.stderr, refused.stderr[-2000:]
        assert "[rank" not in refused.stdout + refused.stderr  # no rank started
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()


def _poison(ckpt: Path) -> None:
    """Every floating-point weight of a checkpoint NaN, written back in DCP's format."""
    state = checkpoint.read_model_state(ckpt)
    nan = {
        k: v.float().fill_(float("nan")) if v.is_floating_point() else v for k, v in state.items()
    }
    dcp.save(nan, storage_writer=FileSystemWriter(ckpt / "model"), no_dist=True)


def test_a_nan_checkpoint_stops_the_run_leaving_the_last_good_checkpoint_and_export(
    cache, tmp_path
):
    """A run of 6 steps (checkpoints 4 and 6, its export); step 6 deleted and step 4's
    weights made NaN, the same command resumes from step 4: it exits non-zero, writes no
    export over the previous one and still holds step 4 (checkpoint.keep=1 would have rotated
    it away), whatever stopped it."""
    args = _args(cache, "train.steps=6", "train.max_skipped_in_row=2", "checkpoint.every=2")
    first = train_py(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir,) = (tmp_path / "default").iterdir()
    assert _steps(tmp_path) == [4, 6]
    exported = _files(run_dir / "hf")
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(checkpoint.step_dir(ckpts, 6))
    _poison(checkpoint.step_dir(ckpts, 4))
    again = train_py([*args, "checkpoint.every=1", "checkpoint.keep=1"], tmp_path)
    assert again.returncode != 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _files(run_dir / "hf") == exported
    assert 4 in _steps(tmp_path)
    assert all(not checkpoint.trained(c) for c in checkpoint.committed(ckpts)[1:])
    assert "[summary] start a run from this export" not in again.stdout


def test_a_loss_stuck_at_the_uniform_guess_warns(cache, tmp_path):
    """optim.lr=1e6: 5.5632 at step 1, then ln 256 = 5.5452 from step 3 on (finite, nothing
    skipped): a warning once train.divergence_steps=3 such steps have passed (step 5); the
    checkpoints written from then on are untrained, so keep=1 keeps step 4 (the last trained
    one) beside step 6."""
    args = _args(cache, "optim.lr=1e6", "train.steps=6", "train.divergence_steps=3")
    args += ["checkpoint.every=1", "checkpoint.keep=1", "checkpoint.export_hf=false"]
    proc = train_py(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "default").iterdir()
    warning = "the loss diverged: loss 5.5452 at step 5, at a uniform guess's ln(vocab) = 5.5452"
    assert warning in proc.stdout + proc.stderr, proc.stdout[-3000:]
    assert warning in (run_dir / "logs" / "rank_0.log").read_text()
    assert _steps(tmp_path) == [4, 6]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [round(m["loss"], 4) for m in lines[2:]] == [5.5452] * 4
    assert torch.isfinite(torch.tensor([m["loss"] for m in lines])).all()
