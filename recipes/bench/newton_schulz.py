"""The Newton-Schulz variants measured block by block: time, FLOPs and quality.

`bench_shapes` times every `VARIANTS` entry (a `muon.newton_schulz.newton_schulz` keyword set)
on batches of GLM-5.2-like blocks (`GLM_SHAPES`, or chosen ones) and measures their quality
against the float64 SVD (`quality`); `crossover` finds where Gram starts to pay on 1:3 blocks;
`conditioning` compares the standard iteration with the default on ill-conditioned bf16
blocks; `momentum_quality` measures every variant on momentum blocks captured from training
(`newton_schulz_train`). Times come from `timing.block_clock` and `timing.calibrated_medians`.
scripts/bench_newton_schulz.py is the command line; `newton_schulz_report` writes the tables.
"""

from __future__ import annotations

import math

import torch

from muon.coefficients import NS_COEFFICIENTS, band_top
from muon.cost import effective_algorithm, ns_flops
from muon.newton_schulz import newton_schulz
from recipes.bench.timing import block_clock, calibrated_medians

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
BULK = 1e-3
CROSSOVER_ROWS = (32, 64, 96, 128, 192, 256)
# (rows, cols, condition number, rank or None): the ill-conditioned blocks of `conditioning`
CONDITIONING = [
    (512, 1536, 1e2, None),
    (512, 1536, 1e3, None),
    (512, 1536, 1e4, None),
    (512, 1536, 1e2, 128),
    (1024, 3072, 1e2, None),
]
#: bf16 slack beyond the band (tests/unit/test_newton_schulz.py)
BF16_SLACK = 0.04


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


def bench_shapes(
    *,
    device: str,
    scale: int,
    repeats: int,
    shapes: list[tuple[str, int, int, int]] | None = None,
    variants: list[str] | None = None,
    with_quality: bool = True,
    peak_tflops: float | None = None,
) -> list[dict]:
    """Per block shape (`shapes`, default `GLM_SHAPES`; dims divided by `scale`) and variant
    (`variants`, default all): time and FLOPs per block, the share of `peak_tflops`, and the
    quality on Gaussian blocks when `with_quality`."""
    clock = block_clock(device)
    gen = torch.Generator().manual_seed(0)
    chosen = {v: VARIANTS[v] for v in variants or VARIANTS}
    rows = []
    for name, r, c, batch in shapes or GLM_SHAPES:
        m, n = r // scale, c // scale
        G = torch.randn(batch, m, n, generator=gen).to(device)
        fns = {v: (lambda kw=kw, G=G: newton_schulz(G, **kw)) for v, kw in chosen.items()}
        times = calibrated_medians(clock, fns, repeats, per_call=batch)
        base = times.get("fixed")
        for v, kw in chosen.items():
            t = times[v]
            fkw = {k: kw[k] for k in ("symmetric", "restarts") if k in kw}
            asked = kw.get("algorithm", "standard")
            runs = effective_algorithm(m, n, 5, asked, **fkw)  # what newton_schulz runs
            algo = runs if runs == asked else f"{runs} (fallback)"
            flops = ns_flops(m, n, algorithm=runs, **fkw)
            q = quality(G, newton_schulz(G, **kw)) if with_quality else {}
            extra = {} if base is None else {"time_vs_fixed": t / base}
            if peak_tflops:
                extra["peak_share"] = flops / t / 1e12 / peak_tflops
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


def crossover(*, device: str, repeats: int) -> list[dict]:
    """Gram / standard time (Polar Express, bf16) on 1:3 blocks of growing size: where Gram's
    extra calls stop costing more than its FLOPs save (`GRAM_MIN_ROWS` of "auto")."""
    clock, gen, rows = block_clock(device), torch.Generator().manual_seed(1), []
    for m in CROSSOVER_ROWS:
        G = torch.randn(8, m, 3 * m, generator=gen).to(device)
        t = calibrated_medians(
            clock,
            {
                a: (lambda a=a, G=G: newton_schulz(G, coefficients="polar_express", algorithm=a))
                for a in ("standard", "gram")
            },
            repeats,
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


def _ill_conditioned(m, n, cond, rank, gen):
    """[m, n] with random singular vectors and singular values log-spaced from 1 to 1/cond
    (those after `rank` zero), and its polar factor."""
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=gen))
    s = torch.logspace(0, -math.log10(cond), m)
    r = m if rank is None else rank
    s[r:] = 0
    return (U * s) @ V.T, U[:, :r] @ V[:, :r].T


def conditioning(*, device: str, repeats: int, cond_scale: int) -> list[dict]:
    """The standard iteration vs the default on the ill-conditioned bf16 blocks of
    `CONDITIONING` (dims divided by `cond_scale`)."""
    clock, gen, rows = block_clock(device), torch.Generator().manual_seed(2), []
    top = band_top(NS_COEFFICIENTS["polar_express"], 5) + BF16_SLACK
    for m, n, cond, rank in CONDITIONING:
        k = cond_scale
        m, n, rank = m // k, n // k, rank and rank // k
        G, polar = _ill_conditioned(m, n, cond, rank, gen)
        G, polar = G.to(device), polar.to(device)
        fns = {
            a: (lambda a=a, G=G: newton_schulz(G, coefficients="polar_express", algorithm=a))
            for a in ("standard", "auto")
        }
        times = calibrated_medians(clock, fns, repeats, per_call=1)
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
