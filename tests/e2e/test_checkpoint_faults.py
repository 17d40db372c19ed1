"""`python train.py` resuming from a damaged latest checkpoint: a flipped byte in one rank's
model shard stops the run naming the file; `checkpoint.fallback=true` resumes from the
previous checkpoint and continues exactly; a checkpoint with NaN weights stops the run with
nothing exported (2 CPU ranks, ep=1, 3 steps)."""

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from recipes import checkpoint, checkpoint_verify
from tests.faults import flip
from tests.train_cli import train_py

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")


def _args(cache: Path) -> list[str]:
    return [
        "mesh.world_size=2",
        "mesh.ep=1",
        "train.steps=3",
        "checkpoint.every=1",
        "checkpoint.keep=3",
        "logger=none",
        "metrics.memory_every=100",
        "metrics.progress=false",
        "eval.every=0",
        "data.seq_len=32",
        "data.batch_size=2",
        f"data.cache_dir={cache}",
        "train.warmup_steps=1",
    ]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["loss"] for m in map(json.loads, lines)}


def _nan_weights(ckpt: Path) -> None:
    """Rewrite the checkpoint's model with one NaN, committed with a matching manifest: the
    files are sound, the weights are not."""
    state = checkpoint.read_model_state(ckpt)
    name = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 1)
    state[name].view(-1)[0] = float("nan")
    for old in (ckpt / "model").iterdir():
        old.unlink()
    dcp.save(state, storage_writer=FileSystemWriter(ckpt / "model"))
    sha = checkpoint_verify.write_manifest(ckpt, [])
    (ckpt / checkpoint.COMMITTED).write_text(checkpoint_verify.commit_text(3, sha))


def test_damaged_latest_checkpoints_stop_the_run_or_fall_back(tmp_path):
    """Step 3 gets NaN weights (its files sound), step 2 a flipped byte in rank 1's model
    shard: the same command stops, exit 1, naming step 3 and exporting nothing; with
    `checkpoint.fallback=true` it refuses both by name, sets them aside and resumes from step
    1 with the losses of the uninterrupted run."""
    from recipes.data import build_stdlib_tokens

    build_stdlib_tokens(str(tmp_path / "cache"))
    args = _args(tmp_path / "cache")
    first = train_py(args, tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    (run_dir,) = (tmp_path / "default").iterdir()
    reference, root = _losses(run_dir), run_dir / "checkpoints"
    _nan_weights(root / "step_00000003")
    flip(root / "step_00000002" / "model" / "__1_0.distcp")
    (run_dir / "hf").rename(tmp_path / "hf-of-the-first-run")

    stopped = train_py(args, tmp_path)
    assert stopped.returncode == 1, stopped.stderr[-4000:]
    said = f"checkpoint {root / 'step_00000003'} refused: non-finite weights (NaN or inf) in 1 "
    assert said in stopped.stderr and "checkpoint.fallback=true" in stopped.stderr, stopped.stderr[
        -4000:
    ]
    assert not (run_dir / "hf").exists() and checkpoint.latest(root).name == "step_00000003"

    resumed = train_py([*args, "checkpoint.fallback=true"], tmp_path)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out[-4000:]
    flipped = "step_00000002 refused: model/__1_0.distcp: contents differ from MANIFEST.json"
    assert flipped in out and f"moved to {root / 'refused-step_00000002'}" in out, out[-4000:]
    assert f"resumed from {root / 'step_00000001'}" in out, out[-4000:]
    assert _losses(run_dir) == reference  # steps 2 and 3 trained again, bit-identical
    assert (run_dir / "hf" / "config.json").is_file()
    assert {p.name for p in root.iterdir()} >= {"refused-step_00000002", "refused-step_00000003"}
