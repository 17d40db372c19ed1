"""Held-out evaluation through `python train.py`: val/loss in metrics.jsonl, validation samples
disjoint from the training samples, the same samples after a resume, training unchanged."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from recipes.config import from_yaml
from recipes.data import TokenStream, token_files
from recipes.evaluate import Evaluator

ROOT = Path(__file__).resolve().parents[2]
WORLD, BATCH, SEQ, EVAL_BATCHES = 2, 2, 32, 2


def _source(root: Path) -> Path:
    """40 .py files of seeded random words: no 33-token run repeats across files by chance."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(500)]
    root.mkdir()
    for i in range(40):
        (root / f"m{i:02d}.py").write_text(" ".join(rng.choice(words, 120)) + "\n")
    return root


def _train(run_dir: Path, source: Path, cache: Path, *extra: str) -> None:
    args = [f"hydra.run.dir={run_dir}", f"data.path={source}", f"data.cache_dir={cache}"]
    args += [f"mesh.world_size={WORLD}", f"data.batch_size={BATCH}", f"data.seq_len={SEQ}"]
    args += ["data.val_fraction=0.2", f"eval.batches={EVAL_BATCHES}", "train.schedule=constant"]
    args += ["train.warmup_steps=0", "checkpoint.export_hf=false", "logger=none"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, *extra],
        cwd=run_dir.parent,
        env=dict(os.environ, WANDB_MODE="offline"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_eval_is_held_out_resumes_on_the_same_samples_and_leaves_training_alone(tmp_path):
    source, cache = _source(tmp_path / "src"), tmp_path / "cache"
    whole, split = tmp_path / "whole", tmp_path / "split"
    _train(whole, source, cache, "train.steps=4", "eval.every=2")
    # The same run in two parts: no evaluation up to the checkpoint at step 2, then resumed.
    _train(split, source, cache, "train.steps=2", "eval.every=0")
    _train(split, source, cache, "train.steps=4", "eval.every=2")

    rows = _rows(whole)
    assert [r["step"] for r in rows if "val/loss" in r] == [2, 4]  # every 2 steps, the end
    assert all(r["val/bpb"] * np.log(2) == pytest.approx(r["val/loss"]) for r in rows[1::2])
    resumed = _rows(split)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # Evaluating at step 2 changed nothing the training computes (bit-identical losses) ...
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    # ... and the resumed run evaluated the same samples: the same weights give the same loss.
    assert resumed[3]["val/loss"] == rows[3]["val/loss"]

    # By content: no validation sample is found in the training text and no trained sample in
    # the validation text (the held-out files are whole files).
    cfg = from_yaml((whole / "config.yaml").read_text())
    files = token_files(cfg.data)
    train_text = np.fromfile(files.train, dtype=np.uint8).tobytes()
    val_text = np.fromfile(files.val, dtype=np.uint8).tobytes()
    val = TokenStream(files.val, "uint8", SEQ, cfg.train.seed, 256)
    ev = Evaluator(val, EVAL_BATCHES, BATCH, 1.0)
    val_samples = [x for r in range(WORLD) for x, _ in ev.samples(r, WORLD)]
    assert sum(len(x) for x in val_samples) == EVAL_BATCHES * WORLD * BATCH
    train = TokenStream(files.train, "uint8", SEQ, cfg.train.seed, 256)
    trained, _ = train.batch(0, 4 * WORLD * BATCH)  # every sample of the 4 steps
    for row in (r for x in val_samples for r in x):
        assert bytes(row.tolist()) not in train_text
    for row in trained:
        assert bytes(row.tolist()) not in val_text
