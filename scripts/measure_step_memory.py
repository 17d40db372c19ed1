"""Measured per-rank step peak of `python train.py` against recipes.step_memory's estimate.

For each activation-checkpointing mode the script runs `train.py` (CPU gloo world) for a few
steps with memory measured on step 1 and step 3, reads the per-rank `step_peak_mib` of step 3
(optimizer state already allocated, as in every later step) from the run's metrics.jsonl, and
computes the estimate for the same composed config in a fake process group of the same size.

    python scripts/measure_step_memory.py --preset small --world-size 4 --ep 2 \
        --out step_memory.json

Prints per mode: measured max over ranks, the estimate, their ratio, and the estimate's parts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from recipes.units import MiB

ROOT = Path(__file__).resolve().parents[1]  # where train.py is


def overrides(args, mode: str) -> list[str]:
    """The train.py overrides of one measured run."""
    return [
        f"model={args.preset}",
        f"mesh.world_size={args.world_size}",
        f"mesh.ep={args.ep}",
        f"train.activation_checkpointing={mode}",
        f"train.param_dtype={args.param_dtype}",
        "train.steps=3",
        "metrics.memory_every=2",
        "checkpoint.every=0",
        "checkpoint.export_hf=false",
        "logger=none",
        *args.extra,
    ]


def measure(args, mode: str, root: Path) -> tuple[list[float], list[float]]:
    """Per-rank step peak and optimizer-step peak delta (MiB) of step 3 of a train.py run."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides(args, mode), f"run.root={root}"]
    env = dict(os.environ, WANDB_MODE="offline")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    (metrics,) = root.rglob("metrics.jsonl")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    step3 = next(m for m in lines if m["step"] == 3)
    ranks = range(args.world_size)
    peaks = [step3[f"memory/rank_{r}/step_peak_mib"] for r in ranks]
    return peaks, [step3[f"memory/rank_{r}/optim_peak_delta_mib"] for r in ranks]


def estimate(args, modes: list[str]) -> dict[str, object]:
    """The estimates of every mode, from the config train.py composes."""
    from recipes.step_memory import compose_train_config, estimate_for_config

    return {
        mode: estimate_for_config(
            compose_train_config(overrides(args, mode)),
            world_size=args.world_size,
            device_type="cpu",
        )
        for mode in modes
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="model preset (conf/model)")
    ap.add_argument("--world-size", type=int, default=4, help="ranks of the CPU world")
    ap.add_argument("--ep", type=int, default=2, help="expert-parallel degree")
    ap.add_argument("--param-dtype", default="float32", help="train.param_dtype")
    ap.add_argument("--modes", nargs="+", default=["none", "full"], help="activation ckpt modes")
    ap.add_argument("--extra", nargs="*", default=[], help="more train.py overrides")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    estimates = estimate(args, args.modes)
    rows = []
    for mode in args.modes:
        with tempfile.TemporaryDirectory() as tmp:
            peaks, optim = measure(args, mode, Path(tmp))
        est = estimates[mode]
        planned_optim = est.parts["optimizer transient (plans)"] / MiB
        row = {
            "mode": mode,
            "measured_mib": peaks,
            "measured_max_mib": max(peaks),
            "estimate_mib": est.total / MiB,
            "ratio": est.total / MiB / max(peaks),
            "optim_measured_mib": optim,
            "optim_planned_mib": planned_optim,
            "optim_ratio": planned_optim / max(optim),
            "parts_mib": {k: v / MiB for k, v in est.parts.items()},
        }
        rows.append(row)
        print(
            f"activation_checkpointing={mode}: measured step peak (max over ranks) "
            f"{max(peaks):.1f} MiB (ranks: {', '.join(f'{p:.1f}' for p in peaks)}); "
            f"estimate {row['estimate_mib']:.1f} MiB; estimate/measured {row['ratio']:.3f}; "
            f"optimizer step beyond its start: measured {max(optim):.2f} MiB (max over ranks), "
            f"planned transient {planned_optim:.2f} MiB, {row['optim_ratio']:.3f}"
        )
        print(est.format())
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
