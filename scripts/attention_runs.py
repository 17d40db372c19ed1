"""Summarize train.py runs by one config key: the largest attention logit over the run and the
loss, the figures behind QK-clip's and Muon Split's defaults (docs/attention_muon.md).

    python train.py -m optim.qk_clip_tau=null,1.0 run.root=runs/qkclip ...
    python scripts/attention_runs.py runs/qkclip --key optim.qk_clip_tau

Per run (a directory holding `metrics.jsonl` and `config.yaml`, searched below each path):
`attn/max_logit` every `--every` steps, its maximum over the run and over the last quarter of
the steps, `attn/qk_clipped` summed over the run, and the loss at the last step and averaged
over the last quarter. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _config_value(run: Path, key: str):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    missing = object()
    value = OmegaConf.select(cfg, key, default=missing)
    if value is missing:
        raise SystemExit(f"{run}: config.yaml has no key {key!r}")
    return value


def summarize(run: Path, key: str, every: int) -> dict:
    """The figures of one run directory."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if not rows or "attn/max_logit" not in rows[0]:
        raise SystemExit(f"{run}: metrics.jsonl has no attn/max_logit (metrics.attn_max_logit)")
    logits = [r["attn/max_logit"] for r in rows]
    tail = max(1, len(rows) // 4)
    return {
        key: _config_value(run, key),
        "steps": len(rows),
        "max_logit_every": [round(v, 2) for v in logits[every - 1 :: every]],
        "max_logit_max": max(logits),
        "max_logit_last_quarter": max(logits[-tail:]),
        "qk_clipped": sum(r.get("attn/qk_clipped", 0.0) for r in rows),
        "loss_last": rows[-1]["loss"],
        "loss_last_quarter": sum(r["loss"] for r in rows[-tail:]) / tail,
    }


def table(runs: list[dict], key: str, every: int) -> str:
    """The runs as a markdown table."""
    head = [key, "steps", f"attn/max_logit every {every} steps", "max", "max, last 1/4"]
    head += ["groups clipped", "loss (last)", "loss (last 1/4)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [str(r[key]), str(r["steps"]), " ".join(map(str, r["max_logit_every"]))]
        cells += [f"{r['max_logit_max']:.2f}", f"{r['max_logit_last_quarter']:.2f}"]
        cells += [
            f"{r['qk_clipped']:.0f}",
            f"{r['loss_last']:.4f}",
            f"{r['loss_last_quarter']:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="run dirs or directories above them")
    ap.add_argument("--key", required=True, help="config key that tells the runs apart")
    ap.add_argument("--every", type=int, default=4, help="print attn/max_logit every N steps")
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error(f"--every {args.every}: must be >= 1")
    runs = sorted(
        {m.parent for p in args.paths for m in p.rglob("metrics.jsonl")}, key=lambda d: str(d)
    )
    if not runs:
        ap.error(f"no metrics.jsonl below {', '.join(map(str, args.paths))}")
    print(table([summarize(r, args.key, args.every) for r in runs], args.key, args.every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
