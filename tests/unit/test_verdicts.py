"""Every printed verdict (PASS/MISS/FAIL, "fits") follows from the figure printed next to it:
a value just past a threshold that the table rounds onto it passes, one that rounds past it
fails, and a verdict names what it judged. One test per script that prints a verdict."""

import importlib.util
import json
import sys
from pathlib import Path

from recipes.bench import step_report
from recipes.bench.remainder_report import evaluate_targets
from recipes.step_memory import GiB, StepMemory
from recipes.tables import as_shown

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


def test_as_shown_is_the_printed_number():
    assert as_shown(1.2049, ".2f") == 1.2 and as_shown(1.205001, ".2f") == 1.21
    assert as_shown(0.10049, ".1%") == 0.1 and as_shown(0.1071, ".1%") == 0.107


def test_bench_step_balance_verdict_reads_the_printed_ratio():
    """docs/benchmarks.md once printed `MISS: ... <= 1.2 (1.20)`: 1.2003 shows as 1.20."""
    after = {
        "agrs": {"ns_max_over_mean": 1.2003, "bytes_match_plan": True},
        "auto": {"ns_max_over_mean": 1.2051, "bytes_match_plan": False},
    }
    assert step_report.targets(after) == [
        ("agrs: NS time max/mean <= 1.2 (1.20)", True),
        ("agrs: measured bytes == plan on every rank", True),
        ("auto: NS time max/mean <= 1.2 (1.21)", False),
        ("auto: measured bytes == plan on every rank", False),
    ]


def _row(strategy: str, R: int, busy: float, idle: float, step_ms: float = 10.0) -> dict:
    return dict(
        strategy=strategy,
        R=R,
        busy_peak_mib=busy,
        idle_peak_mib=idle,
        peak_mib=busy,
        step_ms=step_ms,
        ns_only_ms=step_ms,
        step_over_ns_only=1.0,
        bytes_match_plan=True,
        bytes_sent_total=1,
        bytes_lower_bound_total=1,
    )


def test_bench_remainder_ragged_verdict_names_the_R_it_judges():
    """`--remainders 1,3` (no R=2): judged at R=1 and saying so; R=3's 10.7% is listed as not
    judged, so the PASS line no longer contradicts the figures printed beside it."""
    cfg = {"r_values": [1, 3], "strategies": ["ragged_all_to_all", "pad_all2all"]}
    rows = [_row("ragged_all_to_all", 1, 7.06, 0.47), _row("ragged_all_to_all", 3, 7.44, 0.796)]
    rows += [_row("pad_all2all", 1, 8.38, 8.38, 12.0), _row("pad_all2all", 3, 8.38, 8.38, 12.0)]
    (ragged,) = [t for t in evaluate_targets(rows, cfg) if t["target"].startswith("ragged idle")]
    assert ragged["target"] == "ragged idle-rank peak <= 10% of busy-rank peak at R=1"
    assert ragged["status"] == "PASS" and "not judged, other R: R=3: 10.7%" in ragged["detail"]
    cfg["r_values"] = [2]
    rows = [_row("ragged_all_to_all", 2, 10.0, 1.0004), _row("pad_all2all", 2, 8.0, 8.0, 12.0)]
    (ragged,) = [t for t in evaluate_targets(rows, cfg) if t["target"].startswith("ragged idle")]
    assert ragged["status"] == "PASS" and "= 10.0%" in ragged["detail"]  # 10.004% prints 10.0%
    rows[0]["idle_peak_mib"] = 1.006  # prints 10.1%
    (ragged,) = [t for t in evaluate_targets(rows, cfg) if t["target"].startswith("ragged idle")]
    assert ragged["status"] == "MISS" and "= 10.1%" in ragged["detail"]
    # a 0.04 ms difference that both cells print as the same figure is no slower step
    rows = [_row("ragged_all_to_all", 2, 10.0, 0.5, 5.04), _row("pad_all2all", 2, 8, 8, 5.0)]
    (step,) = [t for t in evaluate_targets(rows, cfg) if t["target"].startswith("ragged step")]
    assert step["status"] == "PASS" and "5.0 vs 5.0" in step["detail"]


def test_plan_memory_fits_reads_the_printed_total():
    """`step peak per rank: 141.000 GiB  fits in 141 GiB` for a total 0.0004 GiB above."""
    est = StepMemory(parts={"w": int(141.0004 * GiB)}, resident=["w"])
    assert est.fits(141) and "141.000 GiB  fits in 141 GiB" in est.format(141)
    est = StepMemory(parts={"w": int(141.0006 * GiB)}, resident=["w"])
    assert not est.fits(141) and "141.001 GiB  DOES NOT FIT in 141 GiB" in est.format(141)


def test_check_resume_verdict_reads_the_printed_relative_error(tmp_path):
    """The first resumed loss off by 2.0004e-3 prints `rel 2.00e-03 (<= 0.002)`: PASS."""
    check_resume = _script("check_resume")

    def run(name: str, losses: dict[int, float]) -> Path:
        d = tmp_path / name
        d.mkdir()
        lines = [json.dumps({"step": s, "loss": v}) for s, v in losses.items()]
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (d / "train.log").write_text("resumed from checkpoints/step_00000002\n")
        return d

    ref = run("ref", {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    resumed = run("res", {1: 1.0, 2: 1.0, 3: 1.0 + 2.0004e-3, 4: 1.0})
    args = check_resume.parse_args([str(ref), str(resumed), "--from-step", "2"])
    verdicts = {name: (ok, detail) for name, ok, detail in check_resume.check(args)}
    ok, detail = verdicts["step 3 loss"]
    assert ok and "rel 2.00e-03 (<= 0.002)" in detail
