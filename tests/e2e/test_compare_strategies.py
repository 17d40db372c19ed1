"""scripts/compare_strategies.py: runs grouped by optim.remainder_strategy into tables and plots.

Fast tests use hand-written run directories (both config layouts) and a stand-in for the W&B
API. The slow test reads the three short real runs of the shared sweep (`tests/conftest.py`:
`python train.py -m optim.remainder_strategy=...` on 4 CPU ranks, W&B offline) and compares
them from metrics.jsonl and, through the API stand-in, from the rows their W&B offline runs
hold: the two must agree.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from recipes.compare_strategies import compare
from recipes.runs import discover, read_wandb_api

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compare_strategies.py"
MiB = 1 << 20
PNG = b"\x89PNG\r\n\x1a\n"


def _load():
    spec = importlib.util.spec_from_file_location("compare_strategies", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compare_strategies", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _history(strategy: str, world: int = 2) -> list[dict]:
    """Four logged steps like recipes.trainer writes them; steps 1 and 3 are memory-profiled."""
    scale = {"agrs": 3.0, "pad_all2all": 2.0, "ragged_all_to_all": 1.0}[strategy]
    rows = []
    for step in (1, 2, 3, 4):
        row = {
            "step": step,
            "loss": 5.0 - 0.1 * step,
            "step_s": 0.5,
            "optim_s": 0.1,
            # step 1 (state building) and profiled step 3 are slow and must not count
            "step_s/max": 9.0 if step in (1, 3) else 1.0 * scale + 0.1 * step,
            "optim_s/max": 9.0 if step in (1, 3) else 0.1 * scale,
            "tokens_per_s": 100.0,
            "muon/bytes_sent": scale * MiB,
            "muon/bytes_sent/max": scale * MiB,
            "muon/bytes_sent/min": scale * MiB / 2,
        }
        if step in (1, 3):
            for k in range(world):
                row[f"memory/rank_{k}/step_peak_mib"] = 10.0 * scale + k + step
                row[f"memory/rank_{k}/optim_peak_delta_mib"] = scale * (k + 1)
                row[f"memory/rank_{k}/optim_peak_mib"] = 5.0
        rows.append(row)
    return rows


def _hydra_run(root: Path, name: str, strategy: str, hydra_layout: bool = False) -> Path:
    run = root / name
    cfg = {"optim": {"name": "muon", "remainder_strategy": strategy}, "mesh": {"world_size": 2}}
    cfg_path = run / (".hydra/config.yaml" if hydra_layout else "config.yaml")
    cfg_path.parent.mkdir(parents=True)
    cfg_path.write_text(yaml.safe_dump(cfg))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _history(strategy)))
    return run


def test_table_groups_by_strategy_and_skips_warmup_and_profiled_steps(tmp_path):
    sweep = tmp_path / "sweep"
    _hydra_run(sweep, "a1", "agrs")
    _hydra_run(sweep, "a2", "agrs", hydra_layout=True)
    _hydra_run(sweep, "p", "pad_all2all")
    _hydra_run(sweep, "r", "ragged_all_to_all")
    runs = discover([sweep])
    assert sorted(r.name for r in runs) == ["a1", "a2", "p", "r"]
    out = tmp_path / "out"
    result = compare(runs, out)
    table = {row["strategy"]: row for row in result["table"]}
    assert list(table) == list(STRATEGIES)
    assert table["agrs"]["runs"] == 2
    # median of steps 2 and 4 only (step 1 builds state, step 3 was profiled)
    assert table["agrs"]["step_s"] == pytest.approx(3.3)
    assert table["ragged_all_to_all"]["optim_s"] == pytest.approx(0.1)
    # per-rank peaks: each rank's max over profiled steps, then max/min over ranks
    assert table["agrs"]["step_peak_mib_max"] == pytest.approx(30 + 1 + 3)
    assert table["agrs"]["step_peak_mib_min"] == pytest.approx(30 + 0 + 3)
    assert table["pad_all2all"]["optim_peak_delta_mib_max"] == pytest.approx(4.0)
    assert table["pad_all2all"]["optim_peak_delta_mib_min"] == pytest.approx(2.0)
    assert table["agrs"]["bytes_sent_mib_max"] == pytest.approx(3.0)
    assert table["agrs"]["bytes_sent_mib_min"] == pytest.approx(1.5)
    with open(out / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["strategy"] for r in rows] == list(STRATEGIES)
    assert float(rows[0]["step_s"]) == pytest.approx(3.3)
    with open(out / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 4
    md = (out / "comparison.md").read_text()
    assert "| agrs | 2 |" in md and "optim.remainder_strategy" in md
    for png in ("step_time.png", "optim_time.png", "memory_per_rank.png", "bytes_sent.png"):
        assert (out / png).read_bytes()[:8] == PNG


def test_by_another_key_titles_and_labels_its_groups_by_that_key(tmp_path):
    """`--by optim.name`: the table is titled and its group column named by that key, not
    as remainder strategies."""
    _hydra_run(tmp_path / "sweep", "m", "agrs")
    adamw = _hydra_run(tmp_path / "sweep", "a", "agrs")
    (adamw / "config.yaml").write_text(yaml.safe_dump({"optim": {"name": "adamw"}}))
    out = tmp_path / "out"
    result = compare(discover([tmp_path / "sweep"]), out, "optim.name")
    assert [r["optim.name"] for r in result["table"]] == ["adamw", "muon"]
    md = (out / "comparison.md").read_text()
    assert md.startswith("# Training runs, grouped by `optim.name`")
    assert "remainder strategies" not in md and "strategy" not in md.split("\n")[2]
    with open(out / "comparison.csv") as f:
        assert next(csv.reader(f))[0] == "optim.name"


def test_missing_strategy_key_is_an_error(tmp_path):
    run = _hydra_run(tmp_path, "x", "agrs")
    (run / "config.yaml").write_text(yaml.safe_dump({"optim": {"name": "adamw"}}))
    with pytest.raises(ValueError, match="optim.remainder_strategy"):
        compare(discover([run]), tmp_path / "out")


def test_wandb_offline_run_points_to_its_run_dir(tmp_path):
    offline = tmp_path / "run" / "wandb" / "offline-run-20260101_000000-abc123"
    offline.mkdir(parents=True)
    (offline / "run-abc123.wandb").write_bytes(b":W&B")
    with pytest.raises(ValueError, match="metrics.jsonl has the same rows"):
        discover([offline])


class FakeRun:
    """What `wandb.Api().runs()` yields, as far as the script reads it."""

    def __init__(self, run_id: str, config: dict, rows: list[dict]):
        self.id, self.name = run_id, f"run-{run_id}"
        self.config = {**config, "_wandb": {}}
        self._rows = rows

    def scan_history(self):
        return iter(self._rows)


class FakeApi:
    def __init__(self, runs: list[FakeRun]):
        self._runs = runs

    def runs(self, path, filters=None):
        assert path == "team/proj" and filters == {"group": "strategies"}
        return self._runs


def test_wandb_api_runs(tmp_path):
    fakes = [
        FakeRun(
            f"id{i}",
            {"optim": {"remainder_strategy": s}},
            [
                {**{k: v for k, v in r.items() if k != "step"}, "_step": r["step"]}
                for r in _history(s)
            ],
        )
        for i, s in enumerate(STRATEGIES)
    ]
    runs = read_wandb_api("team/proj", "strategies", api=FakeApi(fakes))
    result = compare(runs, tmp_path / "out")
    assert [r["strategy"] for r in result["table"]] == list(STRATEGIES)
    assert result["table"][0]["step_s"] == pytest.approx(3.3)


# ------------------------------------------------------------------ three short real runs
def test_three_real_runs_make_a_table_and_plots(strategy_sweep, tmp_path):
    runs_root, _ = strategy_sweep  # tests/conftest.py: 4 ranks, ep=2, 3 steps, W&B offline
    out = tmp_path / "out"
    cmp = subprocess.run(
        [sys.executable, str(SCRIPT), str(runs_root), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    with open(out / "comparison.csv") as f:
        table = {r["strategy"]: r for r in csv.DictReader(f)}
    assert list(table) == list(STRATEGIES)
    for s, row in table.items():
        assert row["runs"] == "1", s
        for col in ("step_s", "optim_s", "step_peak_mib_max", "optim_peak_delta_mib_max"):
            assert float(row[col]) > 0, (s, col, row)
        assert float(row["step_peak_mib_max"]) >= float(row["step_peak_mib_min"]) > 0
    sent = {s: float(table[s]["bytes_sent_mib_max"]) for s in STRATEGIES}
    # AGRS gathers the whole remainder on every rank, the padded all-to-all sends every slot,
    # the ragged one only real shards (at W=2 the remainder is one matrix: agrs == pad)
    assert sent["agrs"] >= sent["pad_all2all"] >= sent["ragged_all_to_all"] > 0, sent
    assert sent["agrs"] > sent["ragged_all_to_all"], sent
    for png in ("step_time.png", "optim_time.png", "memory_per_rank.png", "bytes_sent.png"):
        assert (out / png).read_bytes()[:8] == PNG

    # W&B holds the same rows: the runs as the W&B API would serve them after `wandb sync`
    # (the stand-in reads their offline files) give the same table as metrics.jsonl.
    from tests import wandb_records

    offline = sorted(runs_root.glob("*/wandb/offline-run-*"))
    assert len(offline) == 3
    fakes = []
    for d in offline:
        run = wandb_records.read(d)
        fakes.append(FakeRun(run.run_id, run.config, run.history))
    from_wandb = compare(
        read_wandb_api("team/proj", "strategies", api=FakeApi(fakes)), tmp_path / "out_wandb"
    )
    for row in from_wandb["table"]:
        ref = table[row["strategy"]]
        assert row["runs"] == 1
        for col in ("step_s", "optim_s", "optim_peak_delta_mib_max", "bytes_sent_mib_max"):
            assert row[col] == pytest.approx(float(ref[col]), rel=1e-9), col
    # one strategy-neutral key for the remainder exchange, whatever the strategy
    for d in offline:
        assert "muon/remainder/bytes_sent/max" in wandb_records.read(d).history[-1]


def test_an_existing_output_is_refused_unless_force(tmp_path, capsys):
    """A taken `--out` is refused before any run is read (the old files stay); `--force`
    replaces it whole; an `--out` holding a run it reads is refused even with `--force`."""
    mod = _load()
    sweep = tmp_path / "sweep"
    for strategy in STRATEGIES:
        _hydra_run(sweep, strategy, strategy)
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.png").write_text("an old plot")
    with pytest.raises(SystemExit) as err:
        mod.main([str(sweep), "--out", str(out)])
    message = capsys.readouterr().err.splitlines()[-1]
    assert err.value.code == 2 and f"--out {out}: exists and is a non-empty directory" in message
    assert "--force" in message and sorted(p.name for p in out.iterdir()) == ["stale.png"]
    assert mod.main([str(sweep), "--out", str(out), "--force"]) == 0
    assert not (out / "stale.png").exists() and (out / "comparison.csv").is_file()
    with pytest.raises(SystemExit):
        mod.main([str(sweep / "agrs"), "--out", str(sweep), "--force"])
    assert "holds the input" in capsys.readouterr().err and (sweep / "agrs").is_dir()
