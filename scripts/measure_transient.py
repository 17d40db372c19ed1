"""The optimizer step's transient per rank (a warm step's peak beyond the momentum state),
measured by the memory meter and planned by `muon.batch_cost.window_peak_bytes`, on 19
FSDP2-sharded float32 matrices (13.4 M parameters, bf16 Newton-Schulz) on 4 gloo ranks, per
variant of the optimizer's options; `--baseline DIR` measures the same with the `muon`
package of another checkout (`git archive <commit> muon | tar -x -C DIR`: DIR holds `muon/`
only, the measuring code stays this tree's).

    python scripts/measure_transient.py --out transient_out
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.bench.transient import MODEL, measure_rank, table
from recipes.world import run_world

VARIANTS = {
    "pad_all2all": {"remainder_strategy": "pad_all2all"},
    "agrs": {"remainder_strategy": "agrs"},
    "ragged_all_to_all": {"remainder_strategy": "ragged_all_to_all"},
    "pad_all2all + NorMuon": {"remainder_strategy": "pad_all2all", "normuon": True},
    "pad_all2all + max_inflight=1": {"remainder_strategy": "pad_all2all", "max_inflight": 1},
    "pad_all2all + float32 NS": {"remainder_strategy": "pad_all2all", "ns_dtype": "fp32"},
    # one unit per batch: the smallest batches the plan can cut
    "pad_all2all + memory_budget=1 MiB": {
        "remainder_strategy": "pad_all2all",
        "memory_budget": 1 << 20,
    },
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    ap.add_argument("--repeats", type=int, default=2, help="measured steps (the least counts)")
    ap.add_argument("--baseline", default=None, help="a directory holding another muon/")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and tables.md")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    cfg = dict(shapes=MODEL, variants={n: VARIANTS[n] for n in names}, repeats=args.repeats)
    after = run_world(measure_rank, 4, cfg, backend=None, timeout_s=1800)
    before = None
    if args.baseline:
        code = str(Path(args.baseline).resolve())
        before = run_world(measure_rank, 4, cfg, backend=None, timeout_s=1800, pythonpath=code)
    text = table(after, before)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(dict(after=after, before=before)))
        (args.out / "tables.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
