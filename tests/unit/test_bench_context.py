"""The context-parallel benchmark's pieces: the targets' verdicts and the summary from rows,
the not-run line, and its command line refusing bad values."""

import importlib.util
from pathlib import Path

import pytest

from recipes.bench.context import variant_name
from recipes.bench.context_report import skipped_note, summary_rows, targets

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "bench_context", ROOT / "scripts/bench_context.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(cp: int, layout: str, keep: bool, topk: list[float], cpu: list[float], saved=10.0):
    return [
        {
            "cp": cp,
            "variant": variant_name(layout, keep),
            "layout": layout,
            "keep_gathered": keep,
            "rank": rank,
            "tokens": 64,
            "cpu_s": cpu[rank],
            "wall_s": 1.0,
            "peak_mib": 20.0,
            "saved_mib": saved,
            "topk_gflop": topk[rank],
            "indexer_gflop": topk[rank] + 1.0,
            "layer_gflop": topk[rank] + 5.0,
            "causal_keys": 100,
        }
        for rank in range(cp)
    ]


def test_targets_pass_miss_and_not_run():
    rows = _rows(4, "head_tail", True, [1.0, 1.0, 1.0, 1.05], [1.0, 1.0, 1.0, 1.0])
    rows += _rows(4, "contiguous", True, [0.25, 0.75, 1.25, 1.75], [1.0, 1.0, 1.0, 1.0])
    rows += _rows(4, "head_tail", False, [1.0, 1.0, 1.0, 1.05], [1.0, 1.0, 1.0, 1.0], saved=8.0)
    rows.append({**_rows(4, "contiguous", False, [1.0] * 4, [1.0] * 4)[0], "skipped": "no"})
    got = {t["target"]: t["ok"] for t in targets(rows)}
    assert got["cp=4 head_tail: top-k score FLOPs busiest / mean"] is False  # 1.037 > 1.02
    assert got["cp=4 contiguous: top-k score FLOPs busiest / mean"] is True  # 1.75 > 1.5
    assert got["cp=4 head_tail: CPU time busiest / mean"] is True
    assert got["cp=4 head_tail: re-gather / keep, MiB saved for backward"] is True  # 0.8
    assert got["cp=4 contiguous: re-gather / keep, MiB saved for backward"] is None
    summary = {s["variant"]: s for s in summary_rows(rows)}
    assert summary["contiguous"]["topk_ratio"] == pytest.approx(1.75)
    assert "contiguous re-gather" not in summary


def test_contiguous_target_only_from_cp_4_and_verdicts_as_printed():
    rows = _rows(2, "head_tail", True, [1.0, 1.0399], [1.0, 1.0])  # 1.0196 prints 1.020
    rows += _rows(2, "contiguous", True, [0.5, 1.5], [1.0, 1.0])
    got = {t["target"]: t["ok"] for t in targets(rows)}
    assert got["cp=2 head_tail: top-k score FLOPs busiest / mean"] is True
    assert not any("contiguous: top-k" in name for name in got)


def test_skipped_note_names_variants_cps_and_reason():
    rows = [
        {"cp": cp, "variant": "head_tail re-gather", "skipped": "no keep_gathered"} for cp in (2, 4)
    ]
    assert skipped_note(rows) == "Not run: head_tail re-gather at cp = 2, 4 (no keep_gathered)."
    assert skipped_note(_rows(2, "head_tail", True, [1.0, 1.0], [1.0, 1.0])) == ""


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--cp", "2,x"], "--cp: positive ints"),
        (["--layouts", "zigzag"], "--layouts: unknown 'zigzag'"),
        (["--gather", "never"], "--gather: unknown 'never'"),
        (["--seq-len", "1000", "--cp", "16"], "must be a multiple of 2 x cp"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ],
)
def test_command_line_refuses_bad_values(argv, message, capsys):
    with pytest.raises(SystemExit):
        _script().parse_args(argv)
    assert message in capsys.readouterr().err
