"""Compare Muon remainder strategies across training runs: a table (markdown + CSV) and plots.

    python scripts/compare_strategies.py outputs/strategies --out compare/
    python scripts/compare_strategies.py RUN_DIR [RUN_DIR ...] --out compare/
    python scripts/compare_strategies.py --wandb ENTITY/PROJECT --group strategies --out compare/

Inputs (either or both):
- Hydra run directories of `train.py` (`metrics.jsonl` + `config.yaml`, or `.hydra/config.yaml`);
  a directory above them (a sweep, `run.root`) is searched for them. A W&B offline run lives in
  its run directory (`wandb/offline-run-*`) and holds the same rows as its `metrics.jsonl`.
- `--wandb ENTITY/PROJECT` (optionally `--group`): runs from the W&B API (online).

Runs are grouped by `optim.remainder_strategy` of their resolved config (`--by` picks another
config key, e.g. `--by optim.name`). Per run, from the logged steps (step 1, which builds
optimizer state, is left out when later steps exist; so are memory-profiled steps for the
timings, when unprofiled ones exist):
- step time, optimizer time: median over steps of `step_s/max` / `optim_s/max` (slowest rank)
- per-rank peak memory: each rank's largest `memory/rank_<k>/<key>` over the profiled steps,
  then max and min over ranks, for `step_peak_mib` and `optim_peak_delta_mib` (the optimizer
  step's transient: what the strategy changes)
- bytes moved: `muon/bytes_sent/max` and `/min` over ranks (per step), in MiB
- the last training loss and the last held-out loss (`val/loss`)
Runs of one strategy are averaged (`runs` column).

Output in `--out`: `comparison.md`, `comparison.csv` (per strategy), `runs.csv` (per run),
`step_time.png`, `optim_time.png`, `memory_per_rank.png`, `bytes_sent.png`. An `--out` that
exists and is not empty is refused before any run is read; `--force` replaces it.
"""

from __future__ import annotations

import argparse
import sys

from recipes.compare_strategies import DEFAULT_KEY, compare
from recipes.runs import add_source_arguments, read_sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(ap)
    ap.add_argument(
        "--by",
        "--key",
        dest="key",
        default=DEFAULT_KEY,
        help=f"config key to group by ({DEFAULT_KEY})",
    )
    args = ap.parse_args(argv)
    runs = read_sources(ap, args)
    result = compare(runs, args.out, args.key)
    print((args.out / "comparison.md").read_text())
    print("wrote", ", ".join(result["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
