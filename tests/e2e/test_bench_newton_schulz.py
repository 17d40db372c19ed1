"""scripts/bench_newton_schulz.py end to end on tiny settings: every section writes its rows."""

import importlib
import json
import sys
from pathlib import Path

import pytest

from recipes.bench import newton_schulz as ns
from recipes.bench.newton_schulz_optim import OPT_VARIANTS
from recipes.bench.newton_schulz_report import summary

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_newton_schulz.py"


def test_bench_writes_tables_and_plots(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    bench = importlib.import_module("bench_newton_schulz")
    argv = ["--scale", "64", "--repeats", "1", "--train-steps", "3", "--train-seeds", "2"]
    argv += ["--train-lrs", "0.02", "--step-world", "2"]
    argv += ["--step-shape", "32x96", "--step-count", "2", "--step-repeats", "1"]
    argv += ["--cond-scale", "4"]  # 128x384 and 256x768: still Gram under "auto"
    res = bench.main([*argv, "--out", str(tmp_path)])
    for name in ("results.json", "tables.md", "newton_schulz.png", "training.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "results.json").read_text())["shapes"] == res["shapes"]
    # the summary the docs quote is the one computed from these results, one line per shape and
    # comparison: every shape, Polar Express vs fixed, one per learning rate, the step world,
    # the crossover line when Gram was faster anywhere (its wording is not tested) and the
    # ill-conditioned blocks' line
    tables = (tmp_path / "tables.md").read_text()
    lines = summary(res)
    assert all(line in tables for line in lines)
    faster = any(r["ratio"] < 1 for r in res["crossover"])
    assert len(lines) == len(ns.GLM_SHAPES) + 1 + len(res["train"]["lrs"]) + 1 + faster + 1
    assert [r["dims"] for r in res["crossover"]] == [f"{m}x{3 * m}" for m in ns.CROSSOVER_ROWS]
    assert len(res["conditioning"]) == 2 * len(ns.CONDITIONING)
    assert "Ill-conditioned bf16 blocks (5 cases" in tables
    timed = [r for r in res["shapes"] if "ms_per_block" in r]
    assert len(timed) == len(ns.GLM_SHAPES) * len(ns.VARIANTS)
    assert all(r["ms_per_block"] > 0 and r["gflop_per_block"] > 0 for r in timed)
    square = [r for r in timed if r["rows"] == r["cols"] and "gram" in r["variant"]]
    assert square and all(r["algorithm"] == "standard (fallback)" for r in square)
    assert any(r["shape"].startswith("momentum") for r in res["shapes"])
    assert set(res["train"]["final_loss"]) == {f"{v}, lr 0.02" for v in OPT_VARIANTS}
    assert all(len(v) == 2 for v in res["train"]["final_loss_per_seed"].values())
    assert [r["variant"] for r in res["step"]["rows"]] == list(OPT_VARIANTS)
    # Polar Express is closer to the polar factor than the fixed quintic on every random shape
    by = {(r["shape"], r["variant"]): r for r in timed}
    for shape, *_ in ns.GLM_SHAPES:
        pe, fixed = by[(shape, "polar_express")], by[(shape, "fixed")]
        assert pe["random_ortho_err"] < fixed["random_ortho_err"], shape


def test_chosen_shapes_and_variants_with_the_share_of_peak(tmp_path, capsys):
    """What scripts/gpu_check.sh asks for: explicit blocks, two variants, no quality or other
    sections, TFLOP/s against a given peak."""
    sys.path.insert(0, str(SCRIPT.parent))
    bench = importlib.import_module("bench_newton_schulz")
    argv = ["--scale", "1", "--repeats", "1", "--shapes", "up=64x192x2,sq=48x48"]
    argv += ["--variants", "polar_express,polar_express gram", "--peak-tflops", "0.5"]
    res = bench.main(
        [*argv, "--skip", "train,step,crossover,quality,conditioning", "--out", str(tmp_path)]
    )
    rows = res["shapes"]
    assert [(r["shape"], r["dims"], r["batch"], r["variant"]) for r in rows] == [
        ("up", "64x192", 2, "polar_express"),
        ("up", "64x192", 2, "polar_express gram"),
        ("sq", "48x48", 2, "polar_express"),
        ("sq", "48x48", 2, "polar_express gram"),
    ]
    for r in rows:
        assert r["tflop_per_s"] == pytest.approx(r["gflop_per_block"] / r["ms_per_block"])
        assert r["peak_share"] == pytest.approx(r["tflop_per_s"] / 0.5)
        assert "random_ortho_err" not in r and "time_vs_fixed" not in r  # skipped / not timed
    assert rows[1]["algorithm"] == "gram" and rows[3]["algorithm"] == "standard (fallback)"
    assert "crossover" not in res and "train" not in res and "step" not in res
    tables = (tmp_path / "tables.md").read_text()
    assert "| TFLOP/s | of peak |" in tables and "Where Gram starts to pay" not in tables
    assert tables.count("Gram takes") == 1  # the 1:3 block; the square one runs standard
    for bad, flag in [
        (["--shapes", "up=64"], "--shapes"),
        (["--variants", "polar"], "--variants"),
        (["--skip", "training"], "--skip"),
    ]:
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert flag in capsys.readouterr().err
