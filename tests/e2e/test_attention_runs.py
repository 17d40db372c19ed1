"""scripts/attention_runs.py on run directories shaped like train.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run_dir(root: Path, tau, logits: list[float]) -> None:
    run = root / f"tau={tau}"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"optim:\n  qk_clip_tau: {tau}\n")
    rows = [
        {"step": i + 1, "loss": 5.0 - i, "attn/max_logit": v, "attn/qk_clipped": float(v > 1)}
        for i, v in enumerate(logits)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _script(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "scripts/attention_runs.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_table_per_run(tmp_path):
    _run_dir(tmp_path, "null", [0.5, 1.5, 2.5, 3.5])
    _run_dir(tmp_path, 1.0, [0.5, 1.2, 1.1, 1.05])
    out = _script(str(tmp_path), "--key", "optim.qk_clip_tau", "--every", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| optim.qk_clip_tau | steps | attn/max_logit every 2 steps")
    assert "| 1.0 | 4 | 1.2 1.05 | 1.20 | 1.05 | 3 | 2.0000 | 2.0000 |" in lines
    assert "| None | 4 | 1.5 3.5 | 3.50 | 3.50 | 3 | 2.0000 | 2.0000 |" in lines


def test_bad_input_names_the_problem(tmp_path):
    _run_dir(tmp_path, 1.0, [0.5])
    assert "no key 'optim.nope'" in _script(str(tmp_path), "--key", "optim.nope").stderr
    assert "no metrics.jsonl" in _script(str(tmp_path / "x"), "--key", "optim.lr").stderr
    assert "--every 0" in _script(str(tmp_path), "--key", "optim.lr", "--every", "0").stderr
