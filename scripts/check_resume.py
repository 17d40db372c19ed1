"""Does a resumed run continue its reference run? Compares two run dirs of `train.py`.

    python scripts/check_resume.py REF_DIR RESUMED_DIR --from-step 25

REF_DIR trained without interruption; RESUMED_DIR is a copy of it cut back to its checkpoint at
`--from-step` (later checkpoints removed) and then run again with the same command. Checks:
- RESUMED_DIR/train.log says it resumed from `step_<from-step>`;
- metrics.jsonl of both hold the same steps, one line each (the resumed run truncated the lines
  past its checkpoint and logged every later step once);
- the first resumed step's loss, a forward pass on the restored weights and the restored data
  position, equals the reference's to `--first-rtol` (default 2e-3: on CUDA, atomics in the
  expert combine and attention backward add in a varying order, bf16 compute rounds to 2^-8,
  and the loss averages thousands of tokens; a wrong weight or a wrong batch moves it by more);
- later losses, which also need the optimizer state and the schedule, stay within
  `--rtol` on average (default 2e-2: that rounding compounds over the steps).
`--exact` asks for bit-equal losses instead (a deterministic CPU run). Exit 1 on a failed check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.tables import as_shown


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", type=Path, help="the uninterrupted run dir")
    p.add_argument("resumed", type=Path, help="the resumed run dir")
    p.add_argument("--from-step", type=int, required=True, help="the checkpoint resumed from")
    p.add_argument("--first-rtol", type=float, default=2e-3, help="first resumed step's loss")
    p.add_argument("--rtol", type=float, default=2e-2, help="mean over the later steps")
    p.add_argument("--exact", action="store_true", help="every loss bit-equal")
    return p.parse_args(argv)


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"check_resume.py: {path} does not exist (did the run start?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    if len(set(steps)) != len(steps):
        raise SystemExit(f"check_resume.py: {path} logs a step twice: {steps}")
    return {r["step"]: r["loss"] for r in rows}


def check(args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for every check of the module docstring."""
    ref, res = _losses(args.ref), _losses(args.resumed)
    log = args.resumed / "train.log"
    text = log.read_text() if log.is_file() else ""
    tag = f"step_{args.from_step:08d}"
    after = [s for s in sorted(ref) if s > args.from_step]
    out = [
        ("resumed from the checkpoint", "resumed from" in text and tag in text, f"{log}: {tag}"),
        ("same steps logged", sorted(ref) == sorted(res), f"{len(ref)} vs {len(res)} steps"),
    ]
    if not after or not out[-1][1]:
        return out + [("steps after the checkpoint", False, f"none after {args.from_step}")]
    rel = {s: abs(res[s] - ref[s]) / max(abs(ref[s]), 1e-12) for s in after}
    first = after[0]
    if args.exact:
        return out + [
            (
                "every loss equal",
                all(rel[s] == 0 for s in after),
                f"max rel {max(rel.values()):.2e}",
            )
        ]
    mean = sum(rel[s] for s in after[1:]) / max(1, len(after) - 1)
    return out + [
        (
            f"step {first} loss",
            as_shown(rel[first], ".2e") <= args.first_rtol,  # judged as printed
            f"{res[first]:.6f} vs {ref[first]:.6f}: rel {rel[first]:.2e} (<= {args.first_rtol:g})",
        ),
        (
            f"steps {first + 1}-{after[-1]} loss",
            as_shown(mean, ".2e") <= args.rtol,
            f"mean rel {mean:.2e} (<= {args.rtol:g}), max {max(rel.values()):.2e}",
        ),
    ]


def main(argv=None) -> int:
    results = check(parse_args(argv))
    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
