"""scripts/compare_optimizers.py on hand-written run directories: the best setting per group,
the steps to the reference's best final held-out loss, seeds averaged, bad sets rejected."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import yaml

from recipes.compare_optimizers import compare
from recipes.runs import discover

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_optimizers.py"
PNG = b"\x89PNG\r\n\x1a\n"


def _load():
    spec = importlib.util.spec_from_file_location("compare_optimizers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compare_optimizers", mod)
    spec.loader.exec_module(mod)
    return mod


def _run(root: Path, name: str, optim: str, lr: float, rate: float, **config) -> Path:
    """A run dir whose val/loss falls as 4 - rate * step, evaluated every 10 steps to 40."""
    cfg = {
        "optim": {"name": optim, "lr": lr},
        "model": {"preset": "small"},
        "data": {"source": "stdlib", "seq_len": 16, "batch_size": 2},
        "train": {"steps": 40, "seed": 0, "grad_accum_steps": 1},
        "eval": {"every": 10, "batches": 2},
        "mesh": {"world_size": 2},
    }
    for dotted, value in config.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for step in range(1, 41):
        row = {"step": step, "loss": 5.0, "step_s": 1.0 if optim == "muon" else 0.8}
        row |= {"optim_s": 0.25 if optim == "muon" else 0.1, "tokens_per_s": 64 / row["step_s"]}
        if step % 10 == 0:
            row["val/loss"] = 4.0 - rate * step
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_best_settings_steps_to_target_and_seeds(tmp_path):
    mod = _load()
    root = tmp_path / "runs"
    _run(root, "m1", "muon", 0.01, 0.02)
    _run(root, "m2a", "muon", 0.02, 0.04, train__seed=0)  # best muon: two seeds, averaged
    _run(root, "m2b", "muon", 0.02, 0.02, train__seed=1)
    _run(root, "a1", "adamw", 0.001, 0.01)
    _run(root, "a2", "adamw", 0.003, 0.02)  # best adamw: 4.0 - 0.8 = 3.2 at step 40
    out = tmp_path / "out"
    assert mod.main([str(root), "--out", str(out), "--reference", "adamw"]) == 0
    with open(out / "best.csv") as f:
        best = {r["group"]: r for r in csv.DictReader(f)}
    muon, adamw = best["muon"], best["adamw"]
    assert (muon["setting"], muon["runs"], adamw["setting"]) == ("0.02", "2", "0.003")
    assert float(muon["val_loss"]) == pytest.approx(4.0 - 0.03 * 40)  # mean of the two seeds
    # muon's mean curve 4 - 0.03 s first reaches 3.2 at an evaluated step: 30 (26.7 exactly)
    assert (muon["steps_to_target"], adamw["steps_to_target"]) == ("30", "40")
    assert float(muon["vs_reference"]) == pytest.approx(0.75)
    assert int(muon["tokens_to_target"]) == 30 * 2 * 2 * 16
    assert float(muon["optim_share"]) == pytest.approx(0.25)
    assert float(adamw["tokens_per_s"]) == pytest.approx(80.0)
    with open(out / "settings.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    assert (out / "val_loss.png").read_bytes().startswith(PNG)
    assert (
        "Target: the best final val_loss of `adamw` (3.2000)" in (out / "optimizers.md").read_text()
    )
    # Without --reference the target is the group whose best is the highest: adamw here too.
    result = compare(discover([root]), tmp_path / "out2", "optim.name", "optim.lr")
    assert {r["reference"] for r in result["table"]} == {"adamw"}


def test_runs_that_are_not_comparable_are_rejected(tmp_path):
    mod = _load()
    root = tmp_path / "runs"
    _run(root, "m", "muon", 0.02, 0.04)
    _run(root, "a", "adamw", 0.003, 0.02, data__batch_size=4)
    with pytest.raises(SystemExit, match=r"runs differ in data.batch_size \(2, 4\)"):
        mod.main([str(root), "--out", str(tmp_path / "out")])
    (root / "a" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    with pytest.raises(SystemExit, match="no val/loss logged"):
        mod.main([str(root), "--out", str(tmp_path / "out")])
    other = tmp_path / "other"
    _run(other, "m", "muon", 0.02, 0.04)
    with pytest.raises(SystemExit, match="--reference adamw: no such group"):
        mod.main([str(other), "--out", str(tmp_path / "out"), "--reference", "adamw"])


def test_an_existing_output_is_refused_unless_force(tmp_path, capsys):
    """A taken `--out` (here a file) is refused before any run is read; `--force` replaces it."""
    mod = _load()
    root = tmp_path / "runs"
    _run(root, "m", "muon", 0.02, 0.04)
    _run(root, "a", "adamw", 0.003, 0.02)
    out = tmp_path / "out"
    out.write_text("not a directory")
    with pytest.raises(SystemExit) as err:
        mod.main([str(root), "--out", str(out)])
    assert err.value.code == 2 and out.read_text() == "not a directory"
    assert f"--out {out}: exists and is a file; pass --force" in capsys.readouterr().err
    assert mod.main([str(root), "--out", str(out), "--force"]) == 0
    assert (out / "optimizers.md").is_file()
