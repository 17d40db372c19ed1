"""`python train.py model=mla_tiny mesh.cp=2`: context parallelism through the recipe.

A cp = 2 run on 4 ranks has 2 data-parallel groups, so it reads the same sequences in the same
order as a cp = 1 run on 2 ranks: both must train the same curve (training and validation
losses, the MTP loss and the indexer's KL), with Muon on mla_tiny (DSA, IndexShare, an MTP layer,
ep = 2) and Muon Split. Then the resume: the cp = 2 run's checkpoint at step 2, with the last
one removed, continues at cp = 1 on 2 ranks and at cp = 4 on 8 ranks (the data-parallel size
kept: the world changes with cp), and each continued curve equals the uninterrupted one; the
cp = 2 run also exported its weights in the transformers layout.

Tolerance: Newton-Schulz in float32 (`optim.ns_dtype=float32`) and float32 compute; the runs
differ only in the order of float32 sums (the attention's keys gathered, the gradients
reduce-scattered over 4 ranks instead of 2), ~1e-7 relative per step, which 4 Muon steps at
lr <= 4e-3 keep below 1e-5 on the losses (observed ~1e-6); rtol 1e-4 leaves margin and still
catches a wrong position, mask or loss scale (> 1e-2 from step 1). The indexer's KL (~3e-5)
is a sum of near-cancelling terms p log p - p log q, each up to 1/e, over 16 kept keys: float32
leaves up to 16 x 0.37 x 2^-24 ~ 3.5e-7 absolute on it, so it is compared with atol 4e-7
(~1% of the KL; a wrong kept key moves it by its own size).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.train_cli import train_py

KEYS = ("loss", "mtp_loss", "indexer_kl")
BASE = [
    "model=mla_tiny",
    "optim.ns_dtype=float32",
    "optim.muon_split=on",
    "train.steps=4",
    "train.warmup_steps=1",
    "data.batch_size=2",
    "eval.every=2",
    "eval.batches=1",
    "checkpoint.every=2",
    "checkpoint.keep=3",
    "logger=none",
]


def _run(args: list[str], root: Path) -> str:
    proc = train_py([*BASE, *args], root, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _curve(root: Path, name: str) -> dict[str, list[float]]:
    (run_dir,) = (root / name).iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {k: [r[k] for r in rows if k in r] for k in (*KEYS, "val/loss")}
    curve["step"] = [r["step"] for r in rows if "loss" in r]
    return curve


def _same(got: dict, want: dict) -> None:
    assert got["step"] == want["step"]
    for key in (*KEYS, "val/loss"):
        atol = 4e-7 if key == "indexer_kl" else 0.0
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=atol, err_msg=key)


def test_cp2_trains_as_cp1_and_resumes_at_cp1_and_cp4(tmp_path):
    _run(["mesh.world_size=2", "run.name=cp1"], tmp_path)
    _run(["mesh.world_size=4", "mesh.cp=2", "run.name=cp2"], tmp_path)
    cp1, cp2 = _curve(tmp_path, "cp1"), _curve(tmp_path, "cp2")
    assert cp2["step"] == [1, 2, 3, 4] and len(cp2["val/loss"]) == 2
    _same(cp2, cp1)
    assert cp2["loss"][-1] < cp2["loss"][0]
    (run_dir,) = (tmp_path / "cp2").iterdir()
    assert (run_dir / "hf" / "config.json").is_file()
    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert [p.name[-1] for p in ckpts] == ["2", "4"], ckpts
    shutil.rmtree(ckpts[-1])
    saved = tmp_path / "cp2_step2"
    shutil.copytree(tmp_path / "cp2", saved)
    for world, cp in ((2, 1), (8, 4)):
        shutil.rmtree(tmp_path / "cp2")
        shutil.copytree(saved, tmp_path / "cp2")
        out = _run([f"mesh.world_size={world}", f"mesh.cp={cp}", "run.name=cp2"], tmp_path)
        assert "resumed from" in out and "global batch" not in out, out[-2000:]
        again = _curve(tmp_path, "cp2")
        _same(again, cp2)


def test_packed_documents_under_cp_train_as_cp1(tmp_path):
    """data.pack=true: the stdlib corpus's documents packed into each sequence (positions
    restarting per document), cp = 2 on 4 ranks against cp = 1 on 2: the same curve."""
    short = ["data.pack=true", "train.steps=2", "eval.every=2", "checkpoint.every=0"]
    short += ["checkpoint.export_hf=false"]
    _run(["mesh.world_size=2", "run.name=packed1", *short], tmp_path)
    _run(["mesh.world_size=4", "mesh.cp=2", "run.name=packed2", *short], tmp_path)
    _same(_curve(tmp_path, "packed2"), _curve(tmp_path, "packed1"))
