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
training.png into `--out`, and prints the tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from muon.cost import GRAM_MIN_ROWS, effective_algorithm, ns_flops
from muon.newton_schulz import NS_COEFFICIENTS, band_top, newton_schulz
from recipes.bench.report import markdown_table
from recipes.bench.world import run_world

# GLM-5.2 block shapes (hidden 6144, dense FFN 12288, expert intermediate 2048, 256 experts,
# router [256, 6144]); batch = blocks per batched call.
GLM_SHAPES = [
    ("expert gate/up block", 2048, 6144, 8),
    ("expert down block", 6144, 2048, 8),
    ("dense gate/up", 12288, 6144, 2),
    ("dense down", 6144, 12288, 2),
    ("router", 256, 6144, 2),
    ("square (attention-like)", 6144, 6144, 2),
]
# newton_schulz keyword sets: "fixed" (torch.optim.Muon's iteration) is the baseline of the
# "vs fixed" columns; GRAM is the Gram variant the summary compares with the standard iteration.
GRAM = "polar_express gram"
VARIANTS = {
    "fixed": dict(coefficients="fixed"),
    "tuned": dict(coefficients="tuned"),
    "polar_express": dict(coefficients="polar_express"),
    "polar_express sym": dict(coefficients="polar_express", symmetric=True),
    "polar_express gram": dict(coefficients="polar_express", algorithm="gram"),
    "polar_express gram sym": dict(coefficients="polar_express", algorithm="gram", symmetric=True),
    # one restart, before step 2 (the default restarts are muon.newton_schulz.GRAM_RESTARTS)
    "polar_express gram r2": dict(coefficients="polar_express", algorithm="gram", restarts=(2,)),
    "fixed gram": dict(coefficients="fixed", algorithm="gram"),
    "polar_express fp32": dict(coefficients="polar_express", dtype=torch.float32),
    "polar_express gram fp32": dict(
        coefficients="polar_express", algorithm="gram", dtype=torch.float32
    ),
}
# Muon-level variants (ns_coefficients, ns_algorithm) for training and the W=4 step; the
# first is the baseline of the "vs fixed" columns.
OPT_VARIANTS = {
    "fixed standard": ("fixed", "standard"),
    "tuned standard": ("tuned", "standard"),
    "polar_express standard": ("polar_express", "standard"),
    "polar_express gram": ("polar_express", "gram"),
    "polar_express auto": ("polar_express", "auto"),  # muon.Muon's and the recipe's default
}
DEFAULT = "polar_express auto"
BULK = 1e-3
SECTIONS = ("train", "step", "crossover", "quality", "conditioning")  # what --skip may name


def _shapes(text: str) -> list[tuple[str, int, int, int]]:
    """`--shapes`: "LABEL=ROWSxCOLS[xBATCH],..." as GLM_SHAPES-like rows (batch default 2)."""
    out = []
    for item in filter(None, text.split(",")):
        label, _, dims = item.rpartition("=")
        parts = dims.split("x")
        if not label or len(parts) not in (2, 3) or not all(p.isdigit() and int(p) for p in parts):
            raise argparse.ArgumentTypeError(
                f"--shapes item {item!r}: expected LABEL=ROWSxCOLS or LABEL=ROWSxCOLSxBATCH "
                "with positive integers, e.g. expert_up=2048x6144x8"
            )
        r, c, b = (int(p) for p in (parts + ["2"])[:3])
        out.append((label, r, c, b))
    if not out:
        raise argparse.ArgumentTypeError("--shapes: give at least one LABEL=ROWSxCOLS[xBATCH]")
    return out


def _names(allowed, flag: str):
    """An argparse type: a comma-separated subset of `allowed`, each name checked."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{flag}: unknown {', '.join(map(repr, bad))}; allowed: {', '.join(allowed)}"
            )
        return names

    return parse


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
        type=_names(SECTIONS, "--skip"),
        default=[],
        help=f"comma-separated sections to skip: {','.join(SECTIONS)} (quality: no SVD figures)",
    )
    p.add_argument(
        "--shapes",
        type=_shapes,
        default=None,
        help="blocks to time instead of GLM-5.2's: LABEL=ROWSxCOLS[xBATCH],... (/ --scale)",
    )
    p.add_argument(
        "--variants",
        type=_names(tuple(VARIANTS), "--variants"),
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


# ------------------------------------------------------------------------------ quality
def quality(G: torch.Tensor, O: torch.Tensor) -> dict:
    """Quality of O = NS(G) for a batch [B, m, n] against float64 SVD figures of G."""
    G, O = G.double().cpu(), O.double().cpu()
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    gains = torch.einsum("bmk,bmn,bkn->bk", U, O, Vh)  # u_i^T O v_i
    bulk = S.norm(dim=-1, keepdim=True) * BULK <= S
    sv = torch.linalg.svdvals(O)
    small = O @ O.mT if O.size(-2) <= O.size(-1) else O.mT @ O
    eye = torch.eye(small.size(-1), dtype=torch.float64)
    polar = U @ Vh
    return dict(
        bulk_max_dev=(gains - 1).abs()[bulk].max().item(),
        sigma_min=sv.min().item(),
        ortho_err=((small - eye).norm(dim=(-2, -1)) / math.sqrt(small.size(-1))).max().item(),
        polar_dist=((O - polar).norm(dim=(-2, -1)) / polar.norm(dim=(-2, -1))).max().item(),
    )


def _timer(device: str):
    if device == "cpu":
        return time.process_time

    def wall():
        torch.cuda.synchronize()
        return time.perf_counter()

    return wall


def bench_shapes(args) -> list[dict]:
    scale = args.scale or (16 if args.device == "cpu" else 1)
    clock = _timer(args.device)
    gen = torch.Generator().manual_seed(0)
    variants = {v: VARIANTS[v] for v in args.variants or VARIANTS}
    rows = []
    for name, r, c, batch in args.shapes or GLM_SHAPES:
        m, n = r // scale, c // scale
        G = torch.randn(batch, m, n, generator=gen).to(args.device)
        fns = {v: (lambda kw=kw, G=G: newton_schulz(G, **kw)) for v, kw in variants.items()}
        times = _interleaved(clock, fns, args.repeats, per_call=batch)
        base = times.get("fixed")
        for v, kw in variants.items():
            t = times[v]
            fkw = {k: kw[k] for k in ("symmetric", "restarts") if k in kw}
            asked = kw.get("algorithm", "standard")
            runs = effective_algorithm(m, n, 5, asked, **fkw)  # what newton_schulz runs
            algo = runs if runs == asked else f"{runs} (fallback)"
            flops = ns_flops(m, n, algorithm=runs, **fkw)
            q = {} if "quality" in args.skip else quality(G, newton_schulz(G, **kw))
            extra = {} if base is None else {"time_vs_fixed": t / base}
            if args.peak_tflops:
                extra["peak_share"] = flops / t / 1e12 / args.peak_tflops
            rows.append(
                dict(
                    shape=name,
                    rows=m,
                    cols=n,
                    batch=batch,
                    variant=v,
                    algorithm=algo,
                    ms_per_block=t * 1e3,
                    gflop_per_block=flops / 1e9,
                    tflop_per_s=flops / t / 1e12,
                    **extra,
                    **{f"random_{k}": x for k, x in q.items()},
                )
            )
    std = {(r["shape"], r["variant"]): r for r in rows}
    for r in rows:  # Gram against the standard iteration with the same coefficients
        base_name = r["variant"].replace(" sym", "").replace(" r2", "")
        same = std.get((r["shape"], base_name.replace(" gram", "")))
        if same is not None:
            r["time_vs_standard_same_coefs"] = r["ms_per_block"] / same["ms_per_block"]
    return rows


def momentum_quality(momentum: dict[str, torch.Tensor]) -> list[dict]:
    """Quality of every variant on the momentum blocks captured from training."""
    rows = []
    for key, G in momentum.items():
        for v, kw in VARIANTS.items():
            q = quality(G, newton_schulz(G, **kw))
            rows.append(
                dict(
                    shape=f"momentum {key}",
                    rows=G.size(-2),
                    cols=G.size(-1),
                    batch=G.size(0),
                    variant=v,
                    **{f"momentum_{k}": x for k, x in q.items()},
                )
            )
    return rows


CROSSOVER_ROWS = (32, 64, 96, 128, 192, 256)


def _interleaved(clock, fns: dict, repeats: int, per_call: int) -> dict[str, float]:
    """Median seconds per block of each function, in interleaved rounds; each sample repeats
    the call until it lasts ~50 ms per function (short samples are dominated by the clock's and
    the allocator's noise)."""
    times = {k: [] for k in fns}
    t0 = clock()
    for f in fns.values():  # warm-up
        f()
    calls = max(1, math.ceil(0.05 * len(fns) / max(clock() - t0, 1e-9)))
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = clock()
            for _ in range(calls):
                f()
            times[k].append((clock() - t0) / (per_call * calls))
    return {k: statistics.median(v) for k, v in times.items()}


def crossover(args) -> list[dict]:
    """Gram / standard time (Polar Express, bf16) on 1:3 blocks of growing size: where Gram's
    extra calls stop costing more than its FLOPs save (`GRAM_MIN_ROWS` of "auto")."""
    clock, gen, rows = _timer(args.device), torch.Generator().manual_seed(1), []
    for m in CROSSOVER_ROWS:
        G = torch.randn(8, m, 3 * m, generator=gen).to(args.device)
        t = _interleaved(
            clock,
            {
                a: (lambda a=a, G=G: newton_schulz(G, coefficients="polar_express", algorithm=a))
                for a in ("standard", "gram")
            },
            args.repeats,
            per_call=8,
        )
        rows.append(
            dict(
                dims=f"{m}x{3 * m}",
                standard_ms=t["standard"] * 1e3,
                gram_ms=t["gram"] * 1e3,
                ratio=t["gram"] / t["standard"],
                auto=effective_algorithm(m, 3 * m, 5, "auto"),
            )
        )
    return rows


# (rows, cols, condition number, rank or None): section 4's ill-conditioned blocks
CONDITIONING = [
    (512, 1536, 1e2, None),
    (512, 1536, 1e3, None),
    (512, 1536, 1e4, None),
    (512, 1536, 1e2, 128),
    (1024, 3072, 1e2, None),
]
#: bf16 slack beyond the band (tests/unit/test_newton_schulz.py)
BF16_SLACK = 0.04


def _ill_conditioned(m, n, cond, rank, gen):
    """[m, n] with random singular vectors and singular values log-spaced from 1 to 1/cond
    (those after `rank` zero), and its polar factor."""
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=gen))
    s = torch.logspace(0, -math.log10(cond), m)
    r = m if rank is None else rank
    s[r:] = 0
    return (U * s) @ V.T, U[:, :r] @ V[:, :r].T


def conditioning(args) -> list[dict]:
    """Section 4: the standard iteration vs the default on ill-conditioned bf16 blocks."""
    clock, gen, rows = _timer(args.device), torch.Generator().manual_seed(2), []
    top = band_top(NS_COEFFICIENTS["polar_express"], 5) + BF16_SLACK
    for m, n, cond, rank in CONDITIONING:
        k = args.cond_scale
        m, n, rank = m // k, n // k, rank and rank // k
        G, polar = _ill_conditioned(m, n, cond, rank, gen)
        G, polar = G.to(args.device), polar.to(args.device)
        fns = {
            a: (lambda a=a, G=G: newton_schulz(G, coefficients="polar_express", algorithm=a))
            for a in ("standard", "auto")
        }
        times = _interleaved(clock, fns, args.repeats, per_call=1)
        for a, f in fns.items():
            O = f().float()
            sv = torch.linalg.svdvals(O)
            rows.append(
                dict(
                    block=f"{m}x{n}",
                    condition=f"{cond:g}" + ("" if rank is None else f", rank {rank}"),
                    algorithm=a,
                    sigma_max=sv.max().item(),
                    above_band=int((sv > top).sum()),
                    polar_dist=((O - polar).norm() / polar.norm()).item(),
                    ms=times[a] * 1e3,
                    time_vs_standard=times[a] / times["standard"],
                )
            )
    return rows


# ------------------------------------------------------------------------------ training
def _token_stream(n_bytes: int = 4 << 20) -> torch.Tensor:
    from recipes.data import stdlib_dir, stdlib_files

    data = bytearray()
    for f in stdlib_files(stdlib_dir()):
        data += f.read_bytes()
        if len(data) >= n_bytes:
            break
    return torch.frombuffer(bytearray(data[:n_bytes]), dtype=torch.uint8).long()


def _train_one(tokens, coefs: str, algo: str, steps: int, seed: int, lr: float):
    """One tiny-GLM run: (losses, seconds, optimizer)."""
    from models.glm import GLMForCausalLM, get_preset
    from muon import Muon, param_groups

    seq, batch = 64, 8
    torch.manual_seed(seed)
    model = GLMForCausalLM(get_preset("tiny"))
    model.init_weights(seed)
    opt = Muon(param_groups(model, lr=lr), ns_coefficients=coefs, ns_algorithm=algo)
    gen = torch.Generator().manual_seed(1000 + seed)
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        start = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        x = torch.stack([tokens[s : s + seq + 1] for s in start.tolist()])
        loss = model.loss(x[:, :-1], x[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - t0, opt


def _momentum_blocks(opt) -> dict[str, torch.Tensor]:
    """The Nesterov inputs of the optimizer's last step, as [blocks, rows, cols] per shape."""
    out = {}
    for g in opt.param_groups:
        if g.get("algorithm") != "muon":
            continue
        for pname, p in zip(g["param_names"], g["params"], strict=True):
            buf = opt.state[p]["momentum_buffer"]
            inp = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
            e = g["num_blocks"]
            key = f"{pname.split('.')[-2]} [{e}x{p.size(0) // e}x{p.size(1)}]"
            out.setdefault(key, inp.reshape(e, p.size(0) // e, -1).float())
    return out


def train(args) -> tuple[dict, dict[str, torch.Tensor]]:
    """Tiny GLM, one process, `--train-seeds` seeds (initialization and data order) per
    optimizer variant: mean loss curves, final losses per seed; the momentum of the first run."""
    tokens = _token_stream()
    tail = max(1, args.train_steps // 10)
    curves, seconds, finals, momentum = {}, {}, {}, {}
    lrs = [float(x) for x in args.train_lrs.split(",")]
    for lr, (variant, (coefs, algo)) in itertools.product(lrs, OPT_VARIANTS.items()):
        name, runs = f"{variant}, lr {lr:g}", []
        for seed in range(args.train_seeds):
            losses, secs, opt = _train_one(tokens, coefs, algo, args.train_steps, seed, lr)
            runs.append(losses)
            seconds[name] = seconds.get(name, 0.0) + secs
            if not momentum:
                momentum = _momentum_blocks(opt)
            del opt
        curves[name] = [statistics.mean(step) for step in zip(*runs, strict=True)]
        finals[name] = [statistics.mean(r[-tail:]) for r in runs]
    return dict(
        curves=curves,
        seconds=seconds,
        final_loss={k: statistics.mean(v) for k, v in finals.items()},
        final_loss_per_seed=finals,
        tail_steps=tail,
        seeds=args.train_seeds,
        lrs=lrs,
    ), momentum


# ------------------------------------------------------------------------------ W=4 step
def _step_worker(cfg: dict) -> dict:
    """One rank of the step world: its step times; rank 0 adds the updates' quality."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from muon import Muon

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    r, c = cfg["shape"]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(r, c, generator=gen) for _ in range(cfg["count"])]
    opts, mods = {}, {}
    for name, (coefs, algo) in OPT_VARIANTS.items():
        holder = nn.Module()
        holder.ps = nn.ParameterList([nn.Parameter(torch.zeros(r, c)) for _ in grads])
        fully_shard(holder, mesh=mesh)
        mods[name] = holder
        opts[name] = Muon(
            list(holder.parameters()),
            lr=1.0,
            momentum=0.0,
            nesterov=False,
            adjust_lr="original",
            ns_coefficients=coefs,
            ns_algorithm=algo,
        )

    def step(name):
        for p, g in zip(mods[name].ps, grads, strict=True):
            rows = p.to_local().size(0)
            lo = rank * math.ceil(r / world)
            p.grad = DTensor.from_local(
                g[lo : lo + rows].clone(),
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
            )
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        opts[name].step()
        return time.perf_counter() - t0, time.process_time() - c0

    times = {n: [] for n in OPT_VARIANTS}
    for n in OPT_VARIANTS:  # warm-up, and the update of one step from zero weights
        step(n)
    updates = {n: [-p.full_tensor() for p in mods[n].ps] for n in OPT_VARIANTS}
    for _ in range(cfg["repeats"]):
        for n in OPT_VARIANTS:
            times[n].append(step(n))
    res = {"times": times}
    if rank == 0:
        G = torch.stack(grads)
        res["quality"] = {n: quality(G, torch.stack(u)) for n, u in updates.items()}
    # leave together: a rank tearing gloo down while a peer still talks to it aborts
    dist.barrier()
    return res


def step_world(args, out_dir: Path) -> dict:
    r, c = (int(x) for x in args.step_shape.split("x"))
    cfg = dict(shape=(r, c), count=args.step_count, repeats=args.step_repeats)
    results = run_world(_step_worker, args.step_world, cfg, timeout_s=3600)
    res = results[0]
    per_rank = [out["times"] for out in results]
    rows = []
    for n in OPT_VARIANTS:
        # slowest rank per step, then the median over steps
        wall = statistics.median(max(t[n][i][0] for t in per_rank) for i in range(cfg["repeats"]))
        cpu = statistics.median(max(t[n][i][1] for t in per_rank) for i in range(cfg["repeats"]))
        rows.append(dict(variant=n, step_ms=wall * 1e3, step_cpu_ms=cpu * 1e3, **res["quality"][n]))
    base = rows[0]
    for row in rows:
        row["cpu_vs_fixed"] = row["step_cpu_ms"] / base["step_cpu_ms"]
        row["wall_vs_fixed"] = row["step_ms"] / base["step_ms"]
    return dict(world=args.step_world, shape=[r, c], count=args.step_count, rows=rows)


# ------------------------------------------------------------------------------ output
def summary(res: dict) -> list[str]:
    """The comparisons the variants are chosen by, computed from the tables of this run."""
    by = {(r["shape"], r["variant"]): r for r in res["shapes"] if "ms_per_block" in r}
    shapes = list(dict.fromkeys(s for s, _ in by))
    lines = []
    for s in shapes:
        if (s, "polar_express") not in by or (s, GRAM) not in by:
            continue  # --variants left one of them out
        std, gram = by[(s, "polar_express")], by[(s, GRAM)]
        default = effective_algorithm(gram["rows"], gram["cols"], 5, "auto")
        if gram["algorithm"] != "gram":
            lines.append(f"- {s} {gram['dims']}: Gram needs no fewer FLOPs; the standard runs.")
            continue
        quality = ""
        if "random_ortho_err" in gram:
            better = gram["random_ortho_err"] <= std["random_ortho_err"]
            quality = (
                f"; orthogonality error {gram['random_ortho_err']:.4f} vs "
                f"{std['random_ortho_err']:.4f} ({'equal or better' if better else 'worse'})"
            )
        lines.append(
            f"- {s} {gram['dims']}: Gram takes {gram['time_vs_standard_same_coefs']:.2f}x the "
            f"time of the standard iteration (same Polar Express coefficients) at "
            f"{gram['gflop_per_block'] / std['gflop_per_block']:.2f}x the FLOPs{quality}; the "
            f"default (auto) runs {default}."
        )
    faster = [r["dims"] for r in res.get("crossover", []) if r["ratio"] < 1]
    if faster:
        lines.append(
            f"- 1:3 blocks where Gram is faster than the standard iteration: {', '.join(faster)}"
            f' ("auto" runs Gram from {GRAM_MIN_ROWS} rows).'
        )
    compared = [
        s
        for s in shapes
        if all("random_ortho_err" in by.get((s, v), {}) for v in ("polar_express", "fixed"))
    ]
    pe_better = [
        s
        for s in compared
        if by[(s, "polar_express")]["random_ortho_err"] < by[(s, "fixed")]["random_ortho_err"]
    ]
    if compared:
        lines.append(
            f"- Polar Express vs fixed, same 5 steps: lower orthogonality error on "
            f"{len(pe_better)} of {len(compared)} shapes."
        )
    if res.get("conditioning"):
        c = res["conditioning"]
        auto, std = (
            [r for r in c if r["algorithm"] == "auto"],
            [r for r in c if r["algorithm"] == "standard"],
        )
        left = sum(r["above_band"] > 0 for r in auto)
        lines.append(
            f"- Ill-conditioned bf16 blocks ({len(auto)} cases, condition 1e2-1e4, one "
            f"rank-deficient): the default leaves the band on {left} "
            f"(largest singular value at most {max(r['sigma_max'] for r in auto):.3f}; standard "
            f"{max(r['sigma_max'] for r in std):.3f}), distance to the polar factor "
            f"{statistics.mean(r['polar_dist'] for r in auto):.4f} vs "
            f"{statistics.mean(r['polar_dist'] for r in std):.4f} (mean), "
            f"{statistics.mean(r['time_vs_standard'] for r in auto):.2f}x the standard's time."
        )
    if "train" in res:
        t, base = res["train"], next(iter(OPT_VARIANTS))
        for lr in t["lrs"]:
            f, d = f"{base}, lr {lr:g}", f"{DEFAULT}, lr {lr:g}"
            lo, hi = min(t["final_loss_per_seed"][f]), max(t["final_loss_per_seed"][f])
            lines.append(
                f"- Training, tiny GLM, lr {lr:g}, mean of {t['seeds']} seeds: the default ends "
                f"at {t['final_loss'][d]:.4f}, {base} at {t['final_loss'][f]:.4f} (its seeds "
                f"{lo:.4f}..{hi:.4f})."
            )
    if "step" in res:
        rows = {r["variant"]: r for r in res["step"]["rows"]}
        base, new = rows["fixed standard"], rows[DEFAULT]
        lines.append(
            f"- Muon.step at W={res['step']['world']}, default ({DEFAULT}) vs fixed standard: "
            f"{new['cpu_vs_fixed']:.2f}x the CPU time, {new['wall_vs_fixed']:.2f}x the wall "
            f"time; update distance to the polar factor {new['polar_dist']:.4f} vs "
            f"{base['polar_dist']:.4f}."
        )
    return lines


def markdown(res: dict) -> str:
    parts = [f"Machine: {res['machine']}. Command: `{res['command']}`.", ""]
    parts += ["### Summary", "", *summary(res), ""]
    shape_rows = [r for r in res["shapes"] if "ms_per_block" in r]
    parts += [
        "### Time, FLOPs and quality on random (Gaussian) blocks",
        "",
        markdown_table(
            shape_rows,
            [
                ("shape", "shape", ""),
                ("block", "dims", ""),
                ("variant", "variant", ""),
                ("runs", "algorithm", ""),
                ("ms/block", "ms_per_block", ".2f"),
                ("vs fixed", "time_vs_fixed", ".2f"),
                ("vs std, same coefs", "time_vs_standard_same_coefs", ".2f"),
                ("GFLOP/block", "gflop_per_block", ".3f"),
                ("TFLOP/s", "tflop_per_s", ".1f"),
                ("of peak", "peak_share", ".2f"),
                ("bulk max abs(s-1)", "random_bulk_max_dev", ".3f"),
                ("s_min", "random_sigma_min", ".3f"),
                ("orth err", "random_ortho_err", ".4f"),
                ("dist to polar", "random_polar_dist", ".4f"),
            ],
        ),
    ]
    if "crossover" in res:
        parts += [
            "",
            "### Where Gram starts to pay: 1:3 blocks of growing size "
            "(Polar Express, bf16, batch 8)",
            "",
            markdown_table(
                res["crossover"],
                [
                    ("block", "dims", ""),
                    ("standard ms/block", "standard_ms", ".3f"),
                    ("gram ms/block", "gram_ms", ".3f"),
                    ("gram / standard", "ratio", ".2f"),
                    ("auto runs", "auto", ""),
                ],
            ),
        ]
    if res.get("conditioning"):
        parts += [
            "",
            "### Ill-conditioned bf16 blocks: standard vs the default (Polar Express)",
            "",
            markdown_table(
                res["conditioning"],
                [
                    ("block", "block", ""),
                    ("condition", "condition", ""),
                    ("ns_algorithm", "algorithm", ""),
                    ("sigma_max", "sigma_max", ".3f"),
                    (f"above band + {BF16_SLACK}", "above_band", ""),
                    ("dist to polar", "polar_dist", ".4f"),
                    ("ms/block", "ms", ".1f"),
                    ("vs standard", "time_vs_standard", ".2f"),
                ],
            ),
        ]
    mom = [r for r in res["shapes"] if "momentum_polar_dist" in r]
    if mom:
        parts += [
            "",
            "### Quality on momentum blocks of the tiny GLM after training",
            "",
            markdown_table(
                mom,
                [
                    ("blocks", "shape", ""),
                    ("variant", "variant", ""),
                    ("bulk max abs(s-1)", "momentum_bulk_max_dev", ".3f"),
                    ("s_min", "momentum_sigma_min", ".3f"),
                    ("orth err", "momentum_ortho_err", ".4f"),
                    ("dist to polar", "momentum_polar_dist", ".4f"),
                ],
            ),
        ]
    if "train" in res:
        t = res["train"]
        rows = [
            dict(
                variant=k,
                loss=v,
                lo=min(t["final_loss_per_seed"][k]),
                hi=max(t["final_loss_per_seed"][k]),
                s=t["seconds"][k],
            )
            for k, v in t["final_loss"].items()
        ]
        parts += [
            "",
            f"### Training: tiny GLM, {len(next(iter(t['curves'].values())))} steps, "
            f"{t['seeds']} seeds; final loss = mean of the last {t['tail_steps']} steps",
            "",
            markdown_table(
                rows,
                [
                    ("variant", "variant", ""),
                    ("final loss, mean of seeds", "loss", ".4f"),
                    ("lowest seed", "lo", ".4f"),
                    ("highest seed", "hi", ".4f"),
                    ("seconds, all seeds", "s", ".1f"),
                ],
            ),
        ]
    if "step" in res:
        s = res["step"]
        parts += [
            "",
            f"### Muon.step at W={s['world']}: {s['count']} FSDP2-sharded "
            f"{s['shape'][0]}x{s['shape'][1]} matrices (slowest rank, median)",
            "",
            markdown_table(
                s["rows"],
                [
                    ("variant", "variant", ""),
                    ("CPU ms", "step_cpu_ms", ".1f"),
                    ("CPU vs fixed", "cpu_vs_fixed", ".2f"),
                    ("wall ms", "step_ms", ".1f"),
                    ("wall vs fixed", "wall_vs_fixed", ".2f"),
                    ("update dist to polar", "polar_dist", ".4f"),
                    ("orth err", "ortho_err", ".4f"),
                ],
            ),
        ]
    return "\n".join(parts) + "\n"


def plot(res: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["shapes"] if "ms_per_block" in r]
    if not all("time_vs_fixed" in r and "random_polar_dist" in r for r in rows):
        return  # --variants without fixed, or --skip quality: the tables hold what was timed
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    timed = list(dict.fromkeys(r["variant"] for r in rows))
    width = 0.8 / len(timed)
    for i, v in enumerate(timed):
        vr = {r["shape"]: r for r in rows if r["variant"] == v}
        xs = [j + i * width for j in range(len(shapes))]
        axes[0].bar(xs, [vr[s]["time_vs_fixed"] for s in shapes], width, label=v)
        axes[1].bar(xs, [vr[s]["random_polar_dist"] for s in shapes], width, label=v)
    for ax, title in zip(
        axes, ("time per block vs fixed", "distance to polar factor"), strict=True
    ):
        ax.set_xticks([j + 0.4 for j in range(len(shapes))], shapes, rotation=20, fontsize=7)
        ax.set_title(title)
    axes[0].axhline(1.0, color="k", lw=0.5)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "newton_schulz.png", dpi=110)
    if "train" in res:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k, v in res["train"]["curves"].items():
            w = 10
            smooth = [statistics.mean(v[max(0, i - w + 1) : i + 1]) for i in range(len(v))]
            ax.plot(smooth, label=f"{k} ({res['train']['final_loss'][k]:.3f})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (mean of 10)")
        ax.set_title(f"tiny GLM, Muon variants, mean of {res['train']['seeds']} seeds")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "training.png", dpi=110)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        torch.set_num_threads(1)  # process time of one thread: unaffected by other load
    skip = set(args.skip)
    res: dict = dict(
        command="python scripts/bench_newton_schulz.py " + " ".join(argv or sys.argv[1:]),
        machine=f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if args.device == 'cuda' else args.device}",
    )
    # timing first, in a fresh process: measured after the training runs, the Gram / standard
    # ratio of the first shape moved between 0.76 and 0.83 from run to run
    res["shapes"] = bench_shapes(args)
    if "crossover" not in skip:
        res["crossover"] = crossover(args)
    if "conditioning" not in skip:
        res["conditioning"] = conditioning(args)
    print("timing done", flush=True)
    if "train" not in skip:
        res["train"], momentum = train(args)
        print(f"training done: {res['train']['final_loss']}", flush=True)
        res["shapes"] += momentum_quality(momentum)
    for r in res["shapes"]:
        r["dims"] = f"{r['rows']}x{r['cols']}"
    if "step" not in skip:
        res["step"] = step_world(args, out)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "tables.md").write_text(md)
    plot(res, out)
    print(md)
    return res


if __name__ == "__main__":
    main()
