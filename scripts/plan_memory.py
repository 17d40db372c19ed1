"""Dry-run Muon planner: per-rank bytes moved and peak buffers at cluster scale, on one CPU.

Builds the model on the meta device inside torch's fake process group of `--world-size` ranks,
parallelizes it with the real `models.glm.infra.parallelize` (EP + FSDP2), and constructs the real
`muon.Muon` once per remainder strategy; the optimizer's own plans are read through the cost
model (`muon.cost`), no parameter memory is allocated (`recipes.planning.plan`; the text and
budget check: `recipes.planning_report`).

    python scripts/plan_memory.py --model glm52 --world-size 512 --ep 8
    python scripts/plan_memory.py --model glm52 --world-size 512 --ep 8 --no-expert-aware \
        --budget-gib 80 --json plan.json

Per shape group (one bucket of same-shape matrices on one mesh) it prints the parameter count,
the path(s), the batch sizes and the remainder size, then for each remainder strategy, on a busy
rank (one that orthogonalizes a matrix of the group's remainder batch, or of the group when it
has none) and an idle rank (one that does not) of the FSDP group:

- sent:   bytes the rank sends for all the group's batches, both directions (`bytes_sent`)
- coll:   the largest receive buffer of one collective (`collective_buffer_bytes`); for AGRS
          the all-gather output, the buffer of the GLM-5.2 out-of-memory
- peak:   the largest per-batch peak (`peak_bytes`): exchange buffers alive at once, NS inputs
          included (`exchange_buffer_bytes`) + on the local path one parameter's Nesterov
          input + Newton-Schulz temporaries (`ns_workspace_bytes`)

The footer adds, for the `--rank` view, the resident parameter + gradient + optimizer-state
bytes of the rank's shards and a step bound: the largest sum of per-batch peaks over
`max_inflight` consecutive batches (`window_peak_bytes`: the runtime keeps that many alive).
`--budget-gib` marks every figure above the budget with "!". `--step` adds the whole-step
estimate (`recipes.planning_step`), of one rank of a `--cp` group under context parallelism.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models.glm import get_preset
from muon.plan import REMAINDER_CHOICES
from recipes.context_memory import cp_error
from recipes.dtypes import DTYPES
from recipes.planning import TOKENS_PER_STEP, plan_from_args
from recipes.planning_report import format_report
from recipes.planning_step import step_from_args


def _parser() -> argparse.ArgumentParser:
    from models.glm.model.presets import PRESET_NAMES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm52", choices=PRESET_NAMES, help="model preset")
    ap.add_argument("--world-size", type=int, default=512, help="ranks in the (fake) world")
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel degree")
    ap.add_argument("--rank", type=int, default=0, help="which rank's view (default 0)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="parameter dtype")
    ap.add_argument("--ns-dtype", default="bf16", choices=sorted(DTYPES), help="Newton-Schulz")
    ap.add_argument(
        "--ns-algorithm",
        default="auto",
        choices=("auto", "gram", "standard"),
        help="Muon(ns_algorithm=...): the iteration whose FLOPs and temporaries are counted",
    )
    ap.add_argument(
        "--no-expert-aware",
        dest="expert_aware",
        action="store_false",
        help="Muon(expert_aware=False): exchange fused experts as whole matrices",
    )
    ap.add_argument("--router", default="adamw", choices=("adamw", "muon"), help="router group")
    ap.add_argument(
        "--no-nesterov", dest="nesterov", action="store_false", help="no Nesterov input copies"
    )
    ap.add_argument("--max-inflight", type=int, default=3, help="Muon(max_inflight=...)")
    ap.add_argument("--budget-gib", type=float, default=None, help="flag what exceeds this")
    ap.add_argument(
        "--strategy",
        action="append",
        choices=REMAINDER_CHOICES,
        help="remainder strategies to plan (repeatable; default all and auto)",
    )
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        default=TOKENS_PER_STEP,
        help="tokens per training step, for the NS share of a step (default 4M)",
    )
    ap.add_argument(
        "--muon-split",
        action="store_true",
        help="Muon Split: attention projections per head block (optim.muon_split=on)",
    )
    ap.add_argument("--normuon", action="store_true", help="NorMuon on (its moments as state)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    ap.add_argument(
        "--step", action="store_true", help="also the whole-step per-rank memory estimate"
    )
    ap.add_argument("--seq-len", type=int, default=4096, help="--step: tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=1, help="--step: sequences per rank")
    ap.add_argument(
        "--cp",
        type=int,
        default=1,
        help="mesh.cp: cp consecutive ranks share each sequence (head-tail), the attention's "
        "key side all-gathered; divides --world-size, 2 x cp divides --seq-len",
    )
    ap.add_argument(
        "--cp-keep-gathered",
        action="store_true",
        help="--step: model.cp_keep_gathered (each layer keeps its gathered key side for "
        "backward instead of gathering it again)",
    )
    ap.add_argument(
        "--indexer-training",
        choices=("kl", "frozen"),
        default=None,
        help="DSA models: the indexer trained by its KL loss or frozen (no gradient, not in "
        "the optimizer); default: the preset's",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 1 when `--budget-gib` is given and any figure the report shows
    is above it (with `--step`: either checkpointing mode's step peak)."""
    ap = _parser()
    args = ap.parse_args(argv)
    if why := cp_error(args.world_size, args.seq_len, args.cp):
        ap.error(f"--cp {why} (--world-size {args.world_size}, --seq-len {args.seq_len})")
    overrides = {}
    if args.indexer_training is not None:
        if not get_preset(args.model).uses_dsa:
            ap.error(f"--indexer-training: --model {args.model} has no sparse-attention indexer")
        overrides["indexer_training"] = args.indexer_training
    report = plan_from_args(args, strategies=tuple(args.strategy or REMAINDER_CHOICES), **overrides)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    fits = True
    if args.step:  # recipes.step_memory: params, grads, state, activations, FSDP2 buffers
        text, fits = step_from_args(args, overrides)
        print(text)
    return 1 if report["over_budget"] or not fits else 0


if __name__ == "__main__":
    sys.exit(main())
