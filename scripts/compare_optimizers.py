"""Compare optimizers (or any config key) on held-out loss: a table of each one's best setting
and the validation-loss curves of every run, against steps, tokens and training time.

    python scripts/compare_optimizers.py outputs/optimizers --by optim.name --setting optim.lr \\
        --reference adamw --out compare/
    python scripts/compare_optimizers.py --wandb ENTITY/PROJECT --group optimizers --out compare/

Runs (train.py run directories, or W&B API runs) are grouped by `--by`; within a group each
value of `--setting` is one setting, and runs of one setting (seeds) are averaged. The runs
must agree on what makes them comparable (model, data, batch, steps, schedule shape, world:
`SAME_KEYS`), else the script stops naming the key. Per setting, from `val/loss` as train.py
logs it every `eval.every` steps and at the end:
- `val_loss`: the final held-out loss (nats per token); `val_bpb` when logged
- `tokens_per_s`: median over steps (step 1, which builds optimizer state, left out)
- `optim_share`: optimizer time over step time, summed over those steps (rank 0's clock)
The best setting of a group is the one with the lowest final `val_loss`. The reference group's
best final loss (`--reference`, default: the group whose best is highest) is the target:
`steps_to_target` is the first evaluated step at which a group's best setting reaches it (so
its resolution is `eval.every`), `tokens_to_target` the tokens trained by then, and `vs_reference`
that step over the reference's own.

Output in `--out`: `optimizers.md`, `best.csv` (best setting per group), `settings.csv` (every
setting), `val_loss.png` (left: against steps, with tokens on the top axis; right: against
training time). An `--out` that exists and is not empty is refused before any run is read;
`--force` replaces it.
"""

from __future__ import annotations

import argparse
import sys

from recipes.compare_optimizers import compare
from recipes.runs import add_source_arguments, read_sources


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_arguments(ap)
    ap.add_argument("--by", default="optim.name", help="config key of the groups (optim.name)")
    ap.add_argument("--setting", default="optim.lr", help="config key of a group's settings")
    ap.add_argument("--reference", help="group whose best final loss is the target")
    args = ap.parse_args(argv)
    runs = read_sources(ap, args)
    try:
        result = compare(runs, args.out, args.by, args.setting, args.reference)
    except ValueError as err:
        sys.exit(f"compare_optimizers.py: {err}")
    print((args.out / "optimizers.md").read_text())
    print("wrote", ", ".join(result["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
