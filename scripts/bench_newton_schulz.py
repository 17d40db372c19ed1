"""Benchmark the Newton-Schulz variants: time, FLOPs and quality per GLM shape, plus training.

    python scripts/bench_newton_schulz.py --scale 8 --out bench_ns    # CPU: GLM-5.2 shapes / 8
    python scripts/bench_newton_schulz.py --device cuda --scale 1     # the real shapes on a GPU
    python scripts/bench_newton_schulz.py --device cuda --shapes up=2048x6144x8,sq=8192x6144 \
        --variants "polar_express,polar_express gram" --skip train,step,crossover,quality \
        --peak-tflops 989    # chosen blocks only: time and TFLOP/s against the device's peak

Sections (all in one run, so the ratios come from one machine state):
1. Per GLM-5.2 block shape (scaled down by `--scale`) and variant: time per block of a batched
   bf16 call (CPU: process time of one thread, the median of `--repeats` interleaved rounds of
   samples of >= ~50 ms, so other load on the machine does not enter; CUDA: synchronized wall
   time), the FLOPs of `muon.cost.ns_flops` (Gram's fallback included), and quality
   against the float64 SVD: max |sigma - 1| over the bulk (the gain u_i^T O v_i along each
   input singular direction whose singular value is >= 1e-3 of the Frobenius norm, the range
   Polar Express is built for), the smallest singular value of the output,
   ||O O^T - I||_F / sqrt(min dim) and the relative distance to the polar factor U V^T.
   Quality on Gaussian blocks of the shape, and on the momentum blocks of a tiny GLM after
   `--train-steps` steps of training (section 3).
2. Where Gram starts to pay: Gram / standard time on 1:3 blocks from 32 to 256 rows (what
   `GRAM_MIN_ROWS`, the threshold of `ns_algorithm="auto"`, rests on).
3. Training: the tiny GLM preset, one process, `--train-steps` steps of Muon per optimizer
   variant, seed (`--train-seeds`) and learning rate (`--train-lrs`: the variants put singular
   values at different heights, so one lr can favour one of them) on this Python's standard
   library as bytes; the mean loss curves and the final losses per seed.
4. Ill-conditioned bf16 blocks (`conditioning`): the standard iteration and the default
   (`ns_algorithm="auto"`) on 512x1536 and 1024x3072 blocks with singular values log-spaced
   over a condition number of 1e2-1e4 (and a rank-deficient one): the output's largest singular
   value, how many exceed the band plus bf16 slack, the distance to the polar factor and the
   time. These shapes follow `--cond-scale`, not `--scale`: they are where Gram left the band.
5. The W=4 optimizer step: a gloo world, FSDP2-sharded 1:3 matrices, `muon.Muon.step` per
   variant (interleaved), with the quality of the applied update (lr 1, no momentum, so the
   update is the orthogonalized gradient).

A summary at the top of tables.md states the comparisons the defaults are chosen by.
Writes results.json, tables.md, newton_schulz.png (time ratio and quality per shape) and
training.png into `--out`, and prints the tables. What it measures with lives in
`recipes.bench.newton_schulz` (sections 1, 2, 4), `recipes.bench.newton_schulz_optim` (3, 5)
and `recipes.bench.newton_schulz_report` (the summary, tables and plots).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recipes.bench.cli import command_line, names_arg, shapes_arg
from recipes.bench.newton_schulz import VARIANTS
from recipes.bench.newton_schulz_report import markdown, plot
from recipes.bench.newton_schulz_run import run

SECTIONS = ("train", "step", "crossover", "quality", "conditioning")  # what --skip may name


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--scale", type=int, default=None, help="divide GLM dims (default 16 on CPU)")
    p.add_argument("--repeats", type=int, default=11, help="timed rounds per shape")
    p.add_argument("--train-steps", type=int, default=300, help="tiny GLM steps per variant")
    p.add_argument("--train-seeds", type=int, default=3, help="tiny GLM runs per variant")
    p.add_argument(
        "--train-lrs", default="0.01,0.02", help="comma-separated Muon lrs of the training runs"
    )
    p.add_argument("--step-world", type=int, default=4, help="ranks of the optimizer-step world")
    p.add_argument("--step-shape", default="384x1152", help="matrix shape of the step world")
    p.add_argument("--step-count", type=int, default=8, help="matrices in the step world")
    p.add_argument("--step-repeats", type=int, default=5, help="timed steps per variant")
    p.add_argument(
        "--cond-scale", type=int, default=1, help="divide the ill-conditioned blocks' dims"
    )
    p.add_argument(
        "--skip",
        type=names_arg(SECTIONS, "--skip"),
        default=[],
        help=f"comma-separated sections to skip: {','.join(SECTIONS)} (quality: no SVD figures)",
    )
    p.add_argument(
        "--shapes",
        type=shapes_arg,
        default=None,
        help="blocks to time instead of GLM-5.2's: LABEL=ROWSxCOLS[xBATCH],... (/ --scale)",
    )
    p.add_argument(
        "--variants",
        type=names_arg(tuple(VARIANTS), "--variants"),
        default=None,
        help="comma-separated newton_schulz variants to time (default: all)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the device's dense peak TFLOP/s in the bench dtype: adds a share-of-peak column",
    )
    p.add_argument("--out", default="bench_ns", help="output directory")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the sections not skipped, write results.json, tables.md and the plots; the results."""
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args, command_line("bench_newton_schulz.py", argv or None))
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "tables.md").write_text(md)
    plot(res, out)
    print(md)
    return res


if __name__ == "__main__":
    main()
