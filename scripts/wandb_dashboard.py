"""Build the W&B workspace that compares Muon's remainder strategies, as code.

    python scripts/wandb_dashboard.py --entity TEAM --project moe-muon-recipes --group strategies
    python scripts/wandb_dashboard.py --dry-run

The workspace shows the runs of one W&B group (the `strategies` experiment's runs, one per
`optim.remainder_strategy`) grouped by that config key, so every panel draws one line (mean,
min/max band) per strategy: step and optimizer time of the slowest rank, waiting on
collectives vs Newton-Schulz, per-rank memory, bytes the remainder exchange sends, training
and held-out loss, the largest attention logit (QK-clip's S, overall and per layer), and bar
charts of the run summaries (peaks: train.py defines max summaries for memory and time).
`--by optim.name --group optimizers` shows the optimizer study instead.
Every metric key here is one that `train.py` logs (`tests/e2e/test_wandb.py` checks them against
a real offline run). `--dry-run` prints the panels and needs neither the network nor a login;
without it the workspace is saved through the W&B API (`wandb login` first) and its URL printed.
"""

from __future__ import annotations

import argparse
import sys

from recipes.wandb_dashboard import GROUP_KEY, build_workspace, describe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entity", help="W&B entity (team or user) that owns the project")
    ap.add_argument("--project", default="moe-muon-recipes", help="W&B project")
    ap.add_argument("--group", default="strategies", help="W&B group of the runs ('' for all)")
    ap.add_argument("--name", default="Muon remainder strategies", help="workspace view name")
    ap.add_argument(
        "--by", default=GROUP_KEY, help=f"config key the runs are grouped by ({GROUP_KEY})"
    )
    ap.add_argument("--dry-run", action="store_true", help="print the panels; save nothing")
    args = ap.parse_args(argv)
    group = args.group or None
    if not args.entity and not args.dry_run:
        ap.error("--entity is required to save the workspace (or pass --dry-run)")
    # Built in a dry run too (no network), so it checks what a save would send.
    workspace = build_workspace(args.entity or "ENTITY", args.project, group, args.name, args.by)
    print(describe(group, args.by))
    if args.dry_run:
        return 0
    workspace.save()
    print(f"saved: {workspace.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
