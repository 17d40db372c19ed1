"""scripts/bench_context.py at a small size: the indexer's per-rank work under each layout.

Runs the script as a user does (a subprocess: gloo worlds of cp = 2 and 4 ranks, a sequence of
2048 tokens, index_topk 64, 1 MiB query chunks, so each rank's runs of 256 or more tokens span
several chunks) and checks what is deterministic: the files it writes, every rank's rows, the
FLOP counts (head-tail's top-k scoring balanced within 2%, contiguous's busiest rank above
1.5x the mean at cp = 4, as the causal model says), the targets those give, and the
`keep_gathered=False` variants run or named as not run. Timings are not asserted.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.bench.context import regather_supported

ROOT = Path(__file__).resolve().parents[2]
CPS, S = (2, 4), 2048


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("context")
    cmd = [sys.executable, "-W", "ignore", str(ROOT / "scripts" / "bench_context.py")]
    cmd += ["--cp", ",".join(map(str, CPS)), "--seq-len", str(S), "--topk", "64"]
    cmd += ["--chunk-mib", "1", "--repeats", "1", "--timeout", "300", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout, json.loads((out / "results.json").read_text())


def _ranks(result: dict, cp: int, variant: str) -> list[dict]:
    return [r for r in result["rows"] if r["cp"] == cp and r["variant"] == variant]


def _busiest_over_mean(ranks: list[dict], key: str) -> float:
    values = [r[key] for r in ranks]
    return max(values) / (sum(values) / len(values))


def test_outputs_written(bench):
    out, stdout, result = bench
    assert "| cp | variant | tokens / rank |" in stdout
    assert any(line.startswith(("- PASS", "- MISS")) for line in stdout.splitlines())
    assert (out / "tables.md").read_text().startswith("    python scripts/bench_context.py")
    png = (out / "context.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(result["rows"])
    for cp in CPS:
        for variant in ("head_tail", "contiguous"):
            ranks = _ranks(result, cp, variant)
            assert sorted(r["rank"] for r in ranks) == list(range(cp))
            for r in ranks:
                assert r["tokens"] == S // cp and r["cpu_s"] > 0 and r["peak_mib"] > 0
                assert 0 < r["saved_mib"] <= r["peak_mib"]
                assert 0 < r["topk_gflop"] < r["indexer_gflop"] < r["layer_gflop"]


def test_head_tail_balances_the_indexer_and_contiguous_does_not(bench):
    _, _, result = bench
    for cp in CPS:
        head, cont = _ranks(result, cp, "head_tail"), _ranks(result, cp, "contiguous")
        assert _busiest_over_mean(head, "topk_gflop") <= 1.02
        assert _busiest_over_mean(head, "causal_keys") <= 1.02
        # the causal model: the last chunk's rank scores (2 cp - 1) / cp times the mean
        ideal = (2 * cp - 1) / cp
        assert _busiest_over_mean(cont, "causal_keys") == pytest.approx(ideal, rel=0.02)
        assert _busiest_over_mean(cont, "topk_gflop") == pytest.approx(ideal, rel=0.05)
        # apart from the indexer's top-k scoring, every rank runs the same FLOPs
        layers = [r["layer_gflop"] - r["topk_gflop"] for r in head + cont]
        assert layers == pytest.approx([layers[0]] * len(layers), rel=1e-12)
    cont4 = _ranks(result, 4, "contiguous")
    assert _busiest_over_mean(cont4, "topk_gflop") > 1.5
    verdicts = {t["target"]: t["ok"] for t in result["targets"]}
    for cp in CPS:
        assert verdicts[f"cp={cp} head_tail: top-k score FLOPs busiest / mean"] is True
    assert verdicts["cp=4 contiguous: top-k score FLOPs busiest / mean"] is True


def test_regather_variants_run_or_are_named(bench):
    _, stdout, result = bench
    for cp in CPS:
        for layout in ("head_tail", "contiguous"):
            rows = _ranks(result, cp, f"{layout} re-gather")
            if regather_supported():
                assert sorted(r["rank"] for r in rows) == list(range(cp))
                kept = _ranks(result, cp, layout)
                assert max(r["saved_mib"] for r in rows) < max(r["saved_mib"] for r in kept)
                assert [r["topk_gflop"] for r in rows] == [r["topk_gflop"] for r in kept]
            else:
                assert len(rows) == 1 and "keep_gathered" in rows[0]["skipped"]
    if not regather_supported():
        assert "Not run: head_tail re-gather at cp = 2, 4" in stdout
