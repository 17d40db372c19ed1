"""The sections of `scripts/bench_newton_schulz.py` run in turn: the timed shapes first (in a
fresh process), the crossover and ill-conditioned blocks, the tiny GLM training runs and their
momentum matrices' quality, the optimizer-step world."""

from __future__ import annotations

import argparse
import platform

import torch

from recipes.bench.newton_schulz import bench_shapes, conditioning, crossover, momentum_quality
from recipes.bench.newton_schulz_optim import step_world, train


def run(args: argparse.Namespace, command: str) -> dict:
    """The sections `args` does not skip, in the order that keeps the timings clean; the
    results (what results.json holds)."""
    if args.device == "cpu":
        torch.set_num_threads(1)  # process time of one thread: unaffected by other load
    skip = set(args.skip)
    res: dict = dict(
        command=command,
        machine=f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}",
    )
    # timing first, in a fresh process: measured after the training runs, the Gram / standard
    # ratio of the first shape moved between 0.76 and 0.83 from run to run
    res["shapes"] = bench_shapes(
        device=args.device,
        scale=args.scale or (16 if args.device == "cpu" else 1),
        repeats=args.repeats,
        shapes=args.shapes,
        variants=args.variants,
        with_quality="quality" not in skip,
        peak_tflops=args.peak_tflops,
    )
    if "crossover" not in skip:
        res["crossover"] = crossover(device=args.device, repeats=args.repeats)
    if "conditioning" not in skip:
        res["conditioning"] = conditioning(
            device=args.device, repeats=args.repeats, cond_scale=args.cond_scale
        )
    print("timing done", flush=True)
    if "train" not in skip:
        lrs = [float(x) for x in args.train_lrs.split(",")]
        res["train"], momentum = train(steps=args.train_steps, seeds=args.train_seeds, lrs=lrs)
        print(f"training done: {res['train']['final_loss']}", flush=True)
        res["shapes"] += momentum_quality(momentum)
    for r in res["shapes"]:
        r["dims"] = f"{r['rows']}x{r['cols']}"
    if "step" not in skip:
        rows, cols = (int(x) for x in args.step_shape.split("x"))
        res["step"] = step_world(
            world=args.step_world,
            shape=(rows, cols),
            count=args.step_count,
            repeats=args.step_repeats,
        )
    return res
