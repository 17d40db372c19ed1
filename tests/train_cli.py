"""`python train.py` as a subprocess, the way users run it: the one helper every test uses.

Runs in `root` with `run.root=root` appended (so runs land in the test's directory) and W&B
offline (never the network)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _command(args: list[str], root: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args, f"run.root={root}"]


def _env() -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")


def start_train_py(args: list[str], root: Path, **popen) -> subprocess.Popen:
    """Start train.py (stdout and stderr merged unless `popen` says otherwise)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, **popen}
    return subprocess.Popen(_command(args, root), cwd=root, env=_env(), text=True, **popen)


def train_py(args: list[str], root: Path, *, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run train.py to its end; stdout and stderr kept apart (the caller checks the status)."""
    return subprocess.run(
        _command(args, root), cwd=root, env=_env(), capture_output=True, text=True, timeout=timeout
    )
