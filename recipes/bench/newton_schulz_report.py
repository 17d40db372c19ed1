"""The report of scripts/bench_newton_schulz.py: the summary, markdown tables and plots.

`summary` states the comparisons the defaults are chosen by, computed from one run's results
(`newton_schulz`, `newton_schulz_optim`); `markdown` writes them above one table per section;
`plot` draws the time ratio and quality per shape, and the training curves.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from muon.cost import GRAM_MIN_ROWS, effective_algorithm
from recipes.bench.newton_schulz import BF16_SLACK, GRAM
from recipes.bench.newton_schulz_optim import DEFAULT, OPT_VARIANTS
from recipes.tables import markdown_table


def _per_shape(res: dict) -> list[str]:
    """Per shape: Gram against the standard iteration (time, FLOPs, quality), what auto runs."""
    by = _timed(res)
    lines = []
    for s in list(dict.fromkeys(s for s, _ in by)):
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
    return lines


def _timed(res: dict) -> dict:
    return {(r["shape"], r["variant"]): r for r in res["shapes"] if "ms_per_block" in r}


def _crossover(res: dict) -> list[str]:
    faster = [r["dims"] for r in res.get("crossover", []) if r["ratio"] < 1]
    if not faster:
        return []
    return [
        f"- 1:3 blocks where Gram is faster than the standard iteration: {', '.join(faster)}"
        f' ("auto" runs Gram from {GRAM_MIN_ROWS} rows).'
    ]


def _polar_vs_fixed(res: dict) -> list[str]:
    by = _timed(res)
    shapes = list(dict.fromkeys(s for s, _ in by))
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
    if not compared:
        return []
    return [
        f"- Polar Express vs fixed, same 5 steps: lower orthogonality error on "
        f"{len(pe_better)} of {len(compared)} shapes."
    ]


def _conditioning(res: dict) -> list[str]:
    if not res.get("conditioning"):
        return []
    c = res["conditioning"]
    auto, std = (
        [r for r in c if r["algorithm"] == "auto"],
        [r for r in c if r["algorithm"] == "standard"],
    )
    left = sum(r["above_band"] > 0 for r in auto)
    return [
        f"- Ill-conditioned bf16 blocks ({len(auto)} cases, condition 1e2-1e4, one "
        f"rank-deficient): the default leaves the band on {left} "
        f"(largest singular value at most {max(r['sigma_max'] for r in auto):.3f}; standard "
        f"{max(r['sigma_max'] for r in std):.3f}), distance to the polar factor "
        f"{statistics.mean(r['polar_dist'] for r in auto):.4f} vs "
        f"{statistics.mean(r['polar_dist'] for r in std):.4f} (mean), "
        f"{statistics.mean(r['time_vs_standard'] for r in auto):.2f}x the standard's time."
    ]


def _training(res: dict) -> list[str]:
    if "train" not in res:
        return []
    t, base, lines = res["train"], next(iter(OPT_VARIANTS)), []
    for lr in t["lrs"]:
        f, d = f"{base}, lr {lr:g}", f"{DEFAULT}, lr {lr:g}"
        lo, hi = min(t["final_loss_per_seed"][f]), max(t["final_loss_per_seed"][f])
        lines.append(
            f"- Training, tiny GLM, lr {lr:g}, mean of {t['seeds']} seeds: the default ends "
            f"at {t['final_loss'][d]:.4f}, {base} at {t['final_loss'][f]:.4f} (its seeds "
            f"{lo:.4f}..{hi:.4f})."
        )
    return lines


def _step(res: dict) -> list[str]:
    if "step" not in res:
        return []
    rows = {r["variant"]: r for r in res["step"]["rows"]}
    base, new = rows["fixed standard"], rows[DEFAULT]
    return [
        f"- Muon.step at W={res['step']['world']}, default ({DEFAULT}) vs fixed standard: "
        f"{new['cpu_vs_fixed']:.2f}x the CPU time, {new['wall_vs_fixed']:.2f}x the wall "
        f"time; update distance to the polar factor {new['polar_dist']:.4f} vs "
        f"{base['polar_dist']:.4f}."
    ]


#: the summary's comparisons, in order: each one's lines from a run's results (none if the
#: run has not measured it)
_SUMMARY = (_per_shape, _crossover, _polar_vs_fixed, _conditioning, _training, _step)


def summary(res: dict) -> list[str]:
    """The comparisons the variants are chosen by, computed from the tables of this run."""
    return [line for comparison in _SUMMARY for line in comparison(res)]


def _training_rows(t: dict) -> list[dict]:
    return [
        dict(
            variant=k,
            loss=v,
            lo=min(t["final_loss_per_seed"][k]),
            hi=max(t["final_loss_per_seed"][k]),
            s=t["seconds"][k],
        )
        for k, v in t["final_loss"].items()
    ]


def _training_title(t: dict) -> str:
    return (
        f"### Training: tiny GLM, {len(next(iter(t['curves'].values())))} steps, "
        f"{t['seeds']} seeds; final loss = mean of the last {t['tail_steps']} steps"
    )


def _step_title(s: dict) -> str:
    return (
        f"### Muon.step at W={s['world']}: {s['count']} FSDP2-sharded "
        f"{s['shape'][0]}x{s['shape'][1]} matrices (slowest rank, median)"
    )


def _momentum_rows(res: dict) -> list[dict]:
    return [r for r in res["shapes"] if "momentum_polar_dist" in r]


#: tables.md's sections, in order: (shown for these results, title, rows, columns), the
#: columns as `markdown_table` takes them (header, key, format)
_SECTIONS: list[tuple[Callable, Callable, Callable, list]] = [
    (
        lambda res: True,
        lambda res: "### Time, FLOPs and quality on random (Gaussian) blocks",
        lambda res: [r for r in res["shapes"] if "ms_per_block" in r],
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
    (
        lambda res: "crossover" in res,
        lambda res: (
            "### Where Gram starts to pay: 1:3 blocks of growing size "
            "(Polar Express, bf16, batch 8)"
        ),
        lambda res: res["crossover"],
        [
            ("block", "dims", ""),
            ("standard ms/block", "standard_ms", ".3f"),
            ("gram ms/block", "gram_ms", ".3f"),
            ("gram / standard", "ratio", ".2f"),
            ("auto runs", "auto", ""),
        ],
    ),
    (
        lambda res: bool(res.get("conditioning")),
        lambda res: "### Ill-conditioned bf16 blocks: standard vs the default (Polar Express)",
        lambda res: res["conditioning"],
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
    (
        lambda res: bool(_momentum_rows(res)),
        lambda res: "### Quality on momentum blocks of the tiny GLM after training",
        _momentum_rows,
        [
            ("blocks", "shape", ""),
            ("variant", "variant", ""),
            ("bulk max abs(s-1)", "momentum_bulk_max_dev", ".3f"),
            ("s_min", "momentum_sigma_min", ".3f"),
            ("orth err", "momentum_ortho_err", ".4f"),
            ("dist to polar", "momentum_polar_dist", ".4f"),
        ],
    ),
    (
        lambda res: "train" in res,
        lambda res: _training_title(res["train"]),
        lambda res: _training_rows(res["train"]),
        [
            ("variant", "variant", ""),
            ("final loss, mean of seeds", "loss", ".4f"),
            ("lowest seed", "lo", ".4f"),
            ("highest seed", "hi", ".4f"),
            ("seconds, all seeds", "s", ".1f"),
        ],
    ),
    (
        lambda res: "step" in res,
        lambda res: _step_title(res["step"]),
        lambda res: res["step"]["rows"],
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


def markdown(res: dict) -> str:
    """tables.md of a run: the machine and command, the summary, one table per section."""
    parts = [f"Machine: {res['machine']}. Command: `{res['command']}`.", ""]
    parts += ["### Summary", "", *summary(res)]
    for shown, title, rows, columns in _SECTIONS:
        if shown(res):
            parts += ["", title(res), "", markdown_table(rows(res), columns)]
    return "\n".join(parts) + "\n"


def plot(res: dict, out: Path) -> None:
    """newton_schulz.png (time vs fixed and distance to the polar factor per shape) and, with
    training, training.png (the mean loss curves) into `out`."""
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
