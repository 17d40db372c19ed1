"""The whole-step estimate with full activation checkpointing (`recipes/step_memory.py`)
against the measured step peak of a `train.py` run (`scripts/measure_step_memory.py`: step 3,
max over ranks), and its optimizer-step transient against the optimizer region's measured
peak: within 5% on `small` and `mla_tiny`. What the estimate leaves out (uneven
routing: the busier EP rank holds a few % more; small flags and norms) and what it rounds up
(DSA's shared kept keys) stay inside that on these presets (measured 0.996-1.027 at the
sizes docs/scale.md shows, 1.001 for `small` on 2 ranks)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "measure_step_memory.py"
CASES = {
    # (preset, ranks, extra train.py overrides): the cheapest sizes that keep activations
    # the larger part of the step
    "small": ("small", 2, ["data.seq_len=64"]),
    "mla_tiny": ("mla_tiny", 4, []),
}


@pytest.mark.parametrize("name", CASES)
def test_checkpointed_step_estimate_within_5_percent(name, tmp_path):
    preset, ranks, extra = CASES[name]
    out = tmp_path / "step.json"
    args = [sys.executable, str(SCRIPT), "--preset", preset, "--world-size", str(ranks)]
    args += ["--ep", "2", "--modes", "full", "--out", str(out)]
    if extra:
        args += ["--extra", *extra]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert abs(row["ratio"] - 1) <= 0.05, row
    # the optimizer step's part: its planned transient (the replayed window) against the
    # measured peak of the trainer's optimizer region beyond its start (clipping, Muon,
    # QK-clip; measured 0.998 on small, 0.955 on mla_tiny, whose 0.28 MiB is mostly flags)
    assert abs(row["optim_ratio"] - 1) <= 0.05, row


@pytest.mark.parametrize("keep", ["false", "true"])
def test_cp2_step_estimate_within_15_percent(keep, tmp_path):
    """mla_tiny at mesh.cp=2 on 4 ranks, the gathered key side kept or gathered again: the
    estimate counts the local tokens' activations, the gathered key side and its gradient
    (recipes/context_memory.py) within 15% of the measured peak, without and with activation
    checkpointing (measured 1.056 / 1.067 without, 1.089 with: the estimate rounds DSA's kept
    keys and the [T, S] masks up)."""
    out = tmp_path / "step.json"
    args = [sys.executable, str(SCRIPT), "--preset", "mla_tiny", "--world-size", "4"]
    args += ["--ep", "2", "--modes", "none", "full", "--out", str(out)]
    args += ["--extra", "mesh.cp=2", f"model.cp_keep_gathered={keep}"]
    proc = subprocess.run(args, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["none", "full"]
    for row in rows:
        assert abs(row["ratio"] - 1) <= 0.15, row
