"""W&B runs as users expect them, read back from the offline run files train.py leaves.

One `python train.py -m optim=muon,adamw` (2 CPU ranks, 2 steps, W&B offline) is checked for
system metrics, the git commit, max/min run summaries, the strategy-neutral remainder keys,
an AdamW run without Muon keys, and the dashboard's keys. MetricsLog itself (a real offline
W&B run, no training) shows the switches and that a resumed run sends no step twice.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from models.glm import GLMConfig
from recipes import wandb_dashboard as dashboard
from recipes.config import Config, to_plain
from recipes.metrics import MetricsLog
from tests import wandb_records
from tests.train_cli import train_py

ROOT = Path(__file__).resolve().parents[2]


def _offline(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*"))


def _commit() -> str:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() if done.returncode == 0 else ""


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict[str, Path]:
    """Run dirs of one muon and one adamw job, trained by train.py with W&B offline."""
    root = tmp_path_factory.mktemp("wandb-runs")
    args = ["-m", "optim=muon,adamw", "mesh.world_size=2", "mesh.ep=2"]
    args += ["train.steps=2", "train.warmup_steps=1", "metrics.memory_every=1"]
    args += ["metrics.progress=false", "data.seq_len=8", "data.batch_size=1"]
    args += ["checkpoint.every=0", "checkpoint.export_hf=false", "logger=wandb"]
    args += ["optim.qk_clip_tau=0.05"]  # below the tiny model's first logits: both runs clip
    proc = train_py(args, root, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dirs = {d.name: d for d in (root / "default").iterdir()}
    return {o: next(d for n, d in dirs.items() if f"optim-{o}" in n) for o in ("muon", "adamw")}


def test_offline_run_holds_system_metrics_commit_and_peak_summaries(sweep):
    (offline,) = _offline(sweep["muon"])
    run = wandb_records.read(offline)
    # System metrics: at least the sample W&B takes at the start (CPU utilisation needs two).
    assert run.stats, "no system metrics"
    assert {"memory_percent", "proc.memory.rssMB", "proc.cpu.threads"} <= run.stats[0].keys()
    assert run.git_commit == _commit()  # this checkout's commit, though launched from elsewhere
    # Summaries: peaks for memory and time, the lowest loss; equal to what metrics.jsonl holds.
    lines = [json.loads(x) for x in (sweep["muon"] / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert run.metrics["loss"] == "min" and run.metrics["step_s/max"] == "max"
    assert run.metrics["memory/rank_1/optim_peak_delta_mib"] == "max"
    assert run.metrics["muon/wait_s/max"] == "max" and "tokens_per_s" not in run.metrics
    assert run.summary["loss"] == {"min": min(m["loss"] for m in lines)}
    # Held-out evaluation at the end of the run (eval.every > steps): its lowest value.
    assert run.metrics["val/loss"] == "min" and "val/loss" not in lines[0]
    assert run.summary["val/loss"] == {"min": lines[-1]["val/loss"]}
    assert run.summary["final/val_loss"] == lines[-1]["val/loss"]
    for key in ("step_s/max", "optim_s/max", "memory/rank_0/step_peak_mib", "muon/ns_s/max"):
        assert run.summary[key] == {"max": max(m[key] for m in lines)}, key
    assert run.summary["final/tokens_per_s"] > 0
    # The remainder exchange under strategy-neutral names, equal to its path's counters.
    for m in lines:
        assert m["muon/remainder/bytes_sent"] == m["muon/pad_all2all/bytes_sent"] > 0
        assert m["muon/remainder/bytes_sent/max"] >= m["muon/remainder/bytes_sent/min"]
    assert run.config["optim"]["remainder_strategy"] == "pad_all2all"


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_qk_clip_runs_under_both_optimizers_and_logs_max_logits(sweep, optim):
    lines = [json.loads(x) for x in (sweep[optim] / "metrics.jsonl").read_text().splitlines()]
    layers = GLMConfig().num_hidden_layers
    for m in lines:
        per_layer = [m[f"attn/max_logit/layer_{i:02d}"] for i in range(layers)]
        assert m["attn/max_logit"] == max(per_layer) > 0
    # the first step's logits (tiny init, 8 tokens: ~0.09) exceed tau = 0.05, so it clipped
    assert lines[0]["attn/max_logit"] > 0.05 and lines[0]["attn/qk_clipped"] >= 1


def test_adamw_run_carries_no_muon_keys(sweep):
    (offline,) = _offline(sweep["adamw"])
    run = wandb_records.read(offline)
    shared = {"name", "lr", "weight_decay", "betas", "eps", "qk_clip_tau", "qk_clip_alpha"}
    assert run.config["optim"].keys() == shared
    assert run.history and not any(k.startswith("muon/") for row in run.history for k in row)
    assert OmegaConf.load(sweep["adamw"] / "config.yaml").optim.keys() == run.config["optim"].keys()


def test_every_dashboard_key_is_logged_by_a_real_run(sweep):
    run = wandb_records.read(_offline(sweep["muon"])[0])
    logged = {k for row in run.history for k in row}
    workspace = dashboard.build_workspace("team", "moe-muon-recipes", "strategies", "test")
    panels = [p for section in workspace.sections for p in section.panels]
    assert len(panels) == len(dashboard.PANELS) >= 10
    for panel in panels:
        if getattr(panel, "metric_regex", None):
            matched = {k for k in logged if re.fullmatch(panel.metric_regex, k)}
            # one line per rank, or per decoder layer
            lines = 2 if "rank_" in panel.metric_regex else GLMConfig().num_hidden_layers
            assert len(matched) == lines, (panel.title, matched)
        elif hasattr(panel, "y"):
            assert set(panel.y) <= logged, (panel.title, set(panel.y) - logged)
        else:  # bar charts read run summaries
            assert set(panel.metrics) <= run.summary.keys(), panel.title
    grouping = workspace.runset_settings.groupby
    assert [g.name for g in grouping] == ["optim.remainder_strategy"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/wandb_dashboard.py"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "muon/remainder/bytes_sent/max" in out.stdout and "optim.remainder_strategy" in out.stdout
    )


def _config(**logger) -> dict:
    cfg = to_plain(OmegaConf.structured(Config))
    cfg["logger"].update(logger)
    return cfg


def _log(run_dir: Path, config: dict, start: int, steps: range) -> None:
    """One training process's logging; W&B's service ends with it, as when train.py exits
    (the service writes the offline file after `finish` returns)."""
    import wandb

    # W&B names an offline run dir by the second it starts and the run id: a restart of the
    # same run within one second (never the case for train.py) would share the first's dir.
    time.sleep(1.0)
    sink = MetricsLog(run_dir, config, start)
    for step in steps:
        sink.log(step, {"loss": 0.1 * step, "step_s": 1.0 / step})
    sink.close()
    wandb.teardown()


def test_resumed_run_sends_no_step_twice_and_switches_turn_off(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    config = _config(system_metrics=False, git=False)
    _log(tmp_path, config, 0, range(1, 4))  # logged 3 steps; its last checkpoint was step 2
    _log(tmp_path, config, 2, range(3, 5))  # the restart resumes from step 2
    first, second = (wandb_records.read(d) for d in _offline(tmp_path))
    assert first.run_id == second.run_id  # one W&B run
    assert [r["_step"] for r in first.history] == [1, 2, 3]
    assert [r["_step"] for r in second.history] == [4]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    # W&B's summaries cover what each process sent (setting them by hand would turn them into
    # plain last values in W&B 0.31), so the restarted part reports its own peaks.
    assert first.summary["step_s"] == {"max": 1.0} and second.summary["step_s"] == {"max": 0.25}
    assert not first.stats and not first.git_commit  # logger.system_metrics / logger.git off
    _log(tmp_path, config, 0, range(1, 2))  # starting over (checkpoint.resume=false): a new run
    assert len({wandb_records.read(d).run_id for d in _offline(tmp_path)}) == 2
