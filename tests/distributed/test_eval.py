"""Held-out evaluation in the training loop (one 2-rank gloo world, three runs): val/loss in
metrics.jsonl, the validation samples disjoint from the training samples by content, the same
samples after a resume, and the training losses unchanged by evaluating."""

import json
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from recipes.config import Config
from recipes.data import TokenStream, token_files
from recipes.evaluate import Evaluator
from tests.harness import run_world

WORLD, BATCH, SEQ, EVAL_BATCHES = 2, 2, 32, 2


def _cfg(source: str, cache: str, *overrides: str):
    base = [f"mesh.world_size={WORLD}", "mesh.ep=2", f"data.seq_len={SEQ}"]
    base += [f"data.batch_size={BATCH}", f"data.path={source}", f"data.cache_dir={cache}"]
    base += ["data.val_fraction=0.2", f"eval.batches={EVAL_BATCHES}", "train.schedule=constant"]
    base += ["train.warmup_steps=0", "checkpoint.export_hf=false", "logger.backend=none"]
    base += ["metrics.progress=false"]
    return OmegaConf.merge(
        OmegaConf.structured(Config), OmegaConf.from_dotlist([*base, *overrides])
    )


def _three_runs_world(source: str, cache: str, root: str):
    import torch

    from recipes.trainer import Trainer

    def train(run: str, *overrides: str):
        cfg = _cfg(source, cache, *overrides)
        (Path(root) / run).mkdir(exist_ok=True)
        Trainer(cfg, Path(root) / run, torch.device("cpu")).train()

    train("whole", "train.steps=4", "eval.every=2")
    # The same run in two parts: no evaluation up to the checkpoint at step 2, then resumed.
    train("split", "train.steps=2", "eval.every=0")
    train("split", "train.steps=4", "eval.every=2")


def _source(root: Path) -> Path:
    """40 .py files of seeded random words: no 33-byte run repeats across files by chance."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(500)]
    root.mkdir()
    for i in range(40):
        (root / f"m{i:02d}.py").write_text(" ".join(rng.choice(words, 120)) + "\n")
    return root


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_is_held_out_resumes_on_the_same_samples_and_leaves_training_alone(tmp_path):
    source, cache = _source(tmp_path / "src"), tmp_path / "cache"
    run_world(_three_runs_world, WORLD, str(source), str(cache), str(tmp_path))

    rows = _rows(tmp_path / "whole")
    assert [r["step"] for r in rows if "val/loss" in r] == [2, 4]  # every 2 steps, the end
    for r in rows[1::2]:  # byte tokens: bits per byte = loss / ln 2
        assert r["val/bpb"] * np.log(2) == pytest.approx(r["val/loss"], rel=1e-12)
    resumed = _rows(tmp_path / "split")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    # Evaluating at step 2 changed nothing the training computes (bit-identical losses) ...
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    # ... and the resumed run evaluated the same samples: the same weights give the same loss.
    assert resumed[3]["val/loss"] == rows[3]["val/loss"]

    # By content: no validation sample is found in the training text and no trained sample in
    # the validation text (the held-out files are whole files).
    cfg = _cfg(str(source), str(cache))
    files = token_files(cfg.data)
    train_text = np.fromfile(files.train, dtype=np.uint8).tobytes()
    val_text = np.fromfile(files.val, dtype=np.uint8).tobytes()
    val = TokenStream(files.val, "uint8", SEQ, cfg.train.seed, 256)
    ev = Evaluator(val, EVAL_BATCHES, BATCH, 1.0)
    val_rows = [row for r in range(WORLD) for x, _ in ev.samples(r, WORLD) for row in x]
    assert len(val_rows) == EVAL_BATCHES * WORLD * BATCH
    train = TokenStream(files.train, "uint8", SEQ, cfg.train.seed, 256)
    trained, _ = train.batch(0, 4 * WORLD * BATCH)  # every sample of the 4 steps
    for row in val_rows:
        assert bytes(row.tolist()) not in train_text
    for row in trained:
        assert bytes(row.tolist()) not in val_text
