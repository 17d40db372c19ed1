"""The dry-run planner's whole-step section (`scripts/plan_memory.py --step`) as text.

Per activation-checkpointing mode (none, full) the estimate of `recipes.step_memory` for the
preset on a CUDA world (bf16 compute, the recipe's defaults otherwise), part by part, against
the budget; with a budget, the smallest `mesh.cp` whose estimate fits (when the asked cp does
not fit, or is above 1). Under context parallelism (`cp` > 1) each mode adds the key side's
collectives per layer and step (`recipes.context_memory.collectives`), and the section ends
with the DSA indexer's scoring work per rank under the head-tail layout training runs and under
a contiguous split (`recipes.context_memory.indexer_balance`).
"""

from __future__ import annotations

from recipes.context_memory import collectives, indexer_balance, layer_share
from recipes.planning_report import fmt_bytes
from recipes.units import GiB


def step_report(
    *,
    preset: str,
    world_size: int,
    ep: int,
    rank: int = 0,
    seq_len: int,
    micro_batch: int,
    budget_gib: float | None = None,
    extra: tuple[str, ...] = (),
    cp: int = 1,
    keep_gathered: bool = False,
) -> tuple[str, bool]:
    """Text of the whole-step estimate of `preset` on `world_size` CUDA ranks with context
    parallelism `cp` (`keep_gathered`: model.cp_keep_gathered), without and with activation
    checkpointing, and whether both fit `budget_gib` (a figure the report shows over the
    budget is a failed check, as everywhere in the planner; the text says which one fits)."""
    from recipes.step_memory import estimate_inputs, estimate_step_memory

    where = f", cp {cp} (head-tail: {seq_len // cp} tokens of each sequence)" if cp > 1 else ""
    lines = [
        f"whole step per rank: {preset}, {world_size} ranks, ep {ep}, rank {rank}, "
        f"micro-batch {micro_batch} x {seq_len} tokens{where}"
    ]
    estimates = []
    for mode in ("none", "full"):
        cfg = planning_config(preset, world_size, ep, seq_len, micro_batch, mode, cp, extra)
        model, opt, kw = estimate_inputs(cfg, world_size=world_size, rank=rank, device_type="cuda")
        kw["keep_gathered"] = keep_gathered
        est = estimate_step_memory(model, opt, **kw)
        estimates.append(est)
        lines += [f" train.activation_checkpointing={mode}:", est.format(budget_gib)]
        if budget_gib is not None and (cp > 1 or not est.fits(budget_gib)):
            lines.append(_smallest_cp(model, opt, kw, world_size, budget_gib))
        if cp > 1:
            lines += _collective_lines(model, kw, micro_batch, seq_len, cp)
    if cp > 1 and model.config.uses_dsa:
        lines += _indexer_lines(model, kw, micro_batch, seq_len, cp)
    fits = budget_gib is None or all(est.fits(budget_gib) for est in estimates)
    return "\n".join(lines), fits


def step_from_args(args, overrides: dict) -> tuple[str, bool]:
    """`step_report` of scripts/plan_memory.py's parsed arguments (`overrides`: the GLMConfig
    fields its options set, passed as train.* keys)."""
    from recipes.planning import world_options

    return step_report(
        preset=args.model,
        micro_batch=args.micro_batch,
        extra=(
            f"optim.max_inflight={args.max_inflight}",
            *(f"train.{k}={v}" for k, v in overrides.items()),
        ),
        keep_gathered=args.cp_keep_gathered,
        **world_options(args),
    )


def planning_config(preset, world_size, ep, seq_len, micro_batch, mode, cp, extra):
    from models.glm import get_preset
    from recipes.step_memory import compose_train_config

    return compose_train_config(
        [
            f"model={preset}",
            f"mesh.world_size={world_size}",
            f"mesh.ep={ep}",
            f"mesh.cp={cp}",
            f"data.vocab_size={get_preset(preset).vocab_size}",
            "data.dtype=uint32",
            f"data.seq_len={seq_len}",
            f"data.batch_size={micro_batch}",
            f"train.activation_checkpointing={mode}",
            *extra,
        ]
    )


def _smallest_cp(model, opt, kw, world_size, budget_gib) -> str:
    from recipes.step_memory import smallest_fitting_cp

    found = smallest_fitting_cp(model, opt, kw, world_size, budget_gib)
    if found is None:
        return f"  no mesh.cp of {world_size} ranks brings this step within {budget_gib:g} GiB"
    cp, est = found
    peak = est.total / GiB
    return f"  smallest mesh.cp within {budget_gib:g} GiB: {cp} (step peak {peak:.3f} GiB)"


def _collective_lines(model, kw, batch, seq_len, cp) -> list[str]:
    """The key side's all-gathers and reduce-scatters on this rank, per layer and per step."""
    from recipes.step_memory import layer_runs

    a = kw["param_dtype"].itemsize
    runs = layer_runs(model, kw["mtp"])
    shares = [layer_share(model.config, r, a, kw["ep"], batch, seq_len, cp) for r in runs]
    again = kw["activation_checkpointing"] or not kw["keep_gathered"]
    fig = collectives(model.config, shares, a, batch, seq_len, cp, gathers_per_step=1 + again)
    why = "kept for backward"
    if kw["activation_checkpointing"]:
        why = "gathered again as the layer recomputes"
    elif again:
        why = "gathered again in backward"
    lines = [f"  key side under cp {cp}, per layer and micro-batch (rank's bytes):"]
    for name, k in fig["kinds"].items():
        back = "reduce-scatter the same" if k["reduce_scatter"] else "no reduce-scatter (frozen)"
        lines.append(
            f"    {name:<9} {k['layers']:>3} layers x {k['values_per_token']} values/token: "
            f"all-gather output {fmt_bytes(k['all_gather_output_bytes'])}, sent "
            f"{fmt_bytes(k['sent_bytes'])}; {back}"
        )
    lines.append(
        f"    per step (one micro-batch): {fig['gathers_per_step']} all-gather(s) a layer "
        f"({why}) send {fmt_bytes(fig['step_all_gather_sent_bytes'])}, the reduce-scatters "
        f"{fmt_bytes(fig['step_reduce_scatter_sent_bytes'])}"
    )
    return lines


def _indexer_lines(model, kw, batch, seq_len, cp) -> list[str]:
    """The indexer's scoring FLOPs per rank under both layouts, one forward."""
    from recipes.step_memory import layer_runs

    indexers = sum(r.runs_indexer for r in layer_runs(model, kw["mtp"]))
    fig = indexer_balance(model.config, seq_len, cp, batch=batch, indexers=indexers)
    lines = [
        f" DSA indexer scoring per rank, one forward of {indexers} indexers (a checkpointed "
        f"layer scores again when it recomputes), TFLOP:"
    ]
    for layout, f in fig.items():
        lines.append(
            f"  {layout:<10} busiest {f['busiest'] / 1e12:10.2f}  mean {f['mean'] / 1e12:10.2f}"
            f"  busiest/mean {f['busiest_over_mean']:.4f}"
        )
    return lines
