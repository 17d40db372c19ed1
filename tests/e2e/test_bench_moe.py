"""docs/models.md's bench_moe table: its dispatched-op and host-read counts are what
scripts/bench_moe.py counts now (counts, so a change to the MoE layer's ops shows here)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "models.md"


def _documented_counts() -> dict[tuple[int, int, str], tuple[int, int]]:
    """(experts, tokens, kernel) -> (dispatched ops, host reads), from the table under the
    line `python scripts/bench_moe.py`."""
    text = DOC.read_text()
    table = text[text.index("\npython scripts/bench_moe.py\n") :].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        experts, tokens, kernel, _, _, ops, reads, _ = (
            c.strip() for c in line.strip("|").split("|")
        )
        rows[int(experts), int(tokens), kernel] = (int(ops), int(reads))
    return rows


def test_documented_moe_counts_are_current(tmp_path):
    documented = _documented_counts()
    assert len(documented) == 6  # 16 and 64 experts, three kernels each
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "scripts" / "bench_moe.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_moe", mod)
    spec.loader.exec_module(mod)
    rows = mod.main(["--rounds", "1", "--warmup", "0", "--out", str(tmp_path)])  # the doc's sizes
    counted = {(r["experts"], r["tokens"], r["kernel"]): (r["ops"], r["host_reads"]) for r in rows}
    assert counted == documented
