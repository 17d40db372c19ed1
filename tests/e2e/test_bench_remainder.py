"""scripts/bench_remainder.py at a tiny size: the strategies' memory relations hold, measured.

Runs the script as a user does (a subprocess, W=4 gloo ranks, 256x192 bf16 matrices, R=1 and
3, two timed steps) and checks its outputs: memory relations per strategy (measured with
MemoryMeter by the script), measured bytes equal to the plan's, and the files it writes.
Timings are not asserted: on a shared 2-core machine they are noise at this size.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
W, RS = 4, (1, 3)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "bench_remainder.py"),
        "--world-size",
        str(W),
        "--shape",
        "256x192",
        "--remainders",
        ",".join(map(str, RS)),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--mem-steps",
        "1",
        "--backend",
        "gloo",
        "--timeout",
        "240",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())
    rows = {(r["strategy"], r["R"]): r for r in result["rows"]}
    return out, proc.stdout, result, rows


def test_memory_relations_of_the_strategies(bench):
    _, _, result, rows = bench
    S = rows[("agrs", 1)]["matrix_mib"]
    for R in RS:
        ragged = rows[("ragged_all_to_all", R)]
        assert ragged["busy_ranks"] == R and ragged["idle_ranks"] == W - R
        # ragged: idle ranks hold shards only, far below the busy rank's full matrix + NS
        assert ragged["idle_peak_mib"] < 0.5 * ragged["busy_peak_mib"], ragged
        assert ragged["busy_peak_mib"] >= S
        # padded: every rank, idle or not, holds a full matrix
        pad = rows[("pad_all2all", R)]
        assert pad["idle_peak_mib"] >= S, pad
    one = rows[("ragged_all_to_all", 1)]
    assert one["idle_peak_mib"] < S <= one["busy_peak_mib"], one
    assert one["idle_peak_mib"] < 0.2 * one["busy_peak_mib"], one
    pad_peaks = [rows[("pad_all2all", R)]["peak_mib"] for R in RS]
    assert max(pad_peaks) / min(pad_peaks) <= 1.15, pad_peaks  # flat in R
    agrs_peaks = [rows[("agrs", R)]["peak_mib"] for R in RS]
    assert agrs_peaks[-1] >= 1.3 * agrs_peaks[0], agrs_peaks  # grows with R
    assert agrs_peaks[-1] > max(pad_peaks), (agrs_peaks, pad_peaks)


def test_measured_bytes_equal_the_plan(bench):
    _, _, result, rows = bench
    for row in rows.values():
        assert row["bytes_match_plan"], row
        assert row["bytes_sent_total"] == row["plan_bytes_sent_total"] > 0
    for R in RS:
        ragged = rows[("ragged_all_to_all", R)]
        assert ragged["bytes_sent_total"] == ragged["bytes_lower_bound_total"]
        assert ragged["bytes_sent_total"] < rows[("agrs", R)]["bytes_sent_total"]
    statuses = {t["target"]: t["status"] for t in result["targets"]}
    assert statuses["measured bytes per rank == plan.bytes_sent (every rank, strategy, R)"] == (
        "PASS"
    )


def test_outputs_written(bench):
    out, stdout, result, _ = bench
    assert "| R | agrs ms / peak MiB" in stdout and "| R=1 | ms/step" in stdout
    assert any(line.startswith(("- PASS", "- MISS")) for line in stdout.splitlines())
    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 3 * len(RS)
    assert {r["strategy"] for r in table} == {"agrs", "pad_all2all", "ragged_all_to_all"}
    png = (out / "remainder.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert (out / "tables.md").read_text().startswith("World size 4")
    assert len(result["per_rank"]) == W
    for row in result["rows"]:
        assert row["step_ms"] > 0 and row["ns_only_ms"] > 0
