"""One training step of `train.py`'s own pieces, counted (`recipes.bench.probe`) or timed.

A case is a list of `train.py` overrides. Every rank composes the config the same command
composes (conf/ of the checkout it imports, so a baseline tree composes its own), builds the
`recipes.trainer.Trainer` as `train.py` does, on CPU + gloo, warms up with one step, then:

- `count_rank`: tracks the device set from the build on (so what is allocated on the device,
  FSDP's buffers included, is known) and counts one `train_step` in three nested regions: the
  optimizer's own `step`, the trainer's optimizer part (`Trainer.optimizer_step`: norms,
  clipping, the step, QK-clip) and the whole `train_step`; the model and the optimizer's
  state are marked again before the step, the gradients when the optimizer is called. With
  them, the Muon parameters and batches of the optimizer's plan (`planned_batches`).
- `time_rank`: times `steps` more steps: each `train_step` and each optimizer `step`.

`run_cases` runs each case in a fresh local world (`recipes.bench.world`); `pythonpath`, another
checkout whose `muon`, `models` and `recipes` the ranks import (a before/after comparison). The
counting module is this checkout's in every world: it imports torch only.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from recipes.bench.probe import DeviceProbe
from recipes.bench.world import run_world

#: the regions of a counted step, outermost last
REGIONS = ("optimizer.step", "optimizer part", "train step")
#: what `time_rank` measures per step: wall and CPU seconds of the optimizer and train steps
TIMES = ("opt_s", "step_s", "opt_cpu_s", "step_cpu_s")
#: overrides every probed step gets: nothing logged or saved, nothing printed
QUIET = ("logger=none", "metrics.progress=false", "checkpoint.every=0", "eval.every=0")


def compose(overrides: list[str]):
    """The validated config `python train.py <overrides>` composes in the imported checkout."""
    from recipes.config import validate
    from recipes.step_memory import compose_train_config

    cfg = compose_train_config([*overrides, *QUIET])
    validate(cfg, env_world_size=None)
    return cfg


def layer_counts(overrides: list[str]) -> dict[str, int]:
    """Decoder, MoE and MTP layers of the model the overrides compose."""
    from recipes.build import model_config

    c = model_config(compose(overrides))
    moe = c.num_hidden_layers - c.n_dense_layers + c.num_mtp_layers
    return {"layers": c.num_hidden_layers, "moe_layers": moe, "mtp_layers": c.num_mtp_layers}


def doubled(overrides: list[str]) -> list[str]:
    """The overrides of the same model with twice the decoder layers (dense ones as many; a
    per-layer list, `indexer_types`, repeated)."""
    from recipes.build import model_config

    c = model_config(compose(overrides))
    out = [*overrides, f"++model.overrides.num_hidden_layers={2 * c.num_hidden_layers}"]
    if c.indexer_types is not None:
        out.append(f"++model.overrides.indexer_types=[{','.join(c.indexer_types * 2)}]")
    return out


def _trainer(overrides: list[str], run_dir: Path):
    import torch

    from recipes.trainer import Trainer  # the checkout this world imports

    torch.set_num_threads(1)
    return Trainer(compose(overrides), run_dir, torch.device("cpu"))


def _optimizer_part(trainer) -> str:
    """The name of the trainer's optimizer part: `optimizer_step`, or `_optimizer_step` in a
    baseline tree whose `Trainer` keeps it private."""
    return "optimizer_step" if hasattr(trainer, "optimizer_step") else "_optimizer_step"


def count_rank(overrides: list[str], profile: bool = True) -> dict[str, Any]:
    """One rank: build and warm up one step with the device set tracked from the start (what
    is allocated on the device, FSDP's buffers included, is known), then count the next step;
    each region's counts as plain data (with `profile`, also its profiler kernels from one
    more step: `aten_events`)."""
    probe = DeviceProbe()
    with tempfile.TemporaryDirectory() as tmp, probe.tracking():
        trainer = _trainer(overrides, Path(tmp))
        trainer.train_step(measure=False)

        def seed() -> None:
            probe.seed(trainer.model, trainer.opt)

        seed()
        with (
            probe.wrap(trainer.opt, "step", REGIONS[0], before=seed),
            probe.wrap(trainer, _optimizer_part(trainer), REGIONS[1]),
            probe.region(REGIONS[2]),
        ):
            trainer.train_step(measure=False)
        out = {k: c.as_dict() for k, c in probe.counts.items()}
        for name, n in profiled_events(trainer).items() if profile else ():
            out[name]["aten_events"] = n
    optimizer = {"optimizer": f"{type(trainer.opt).__name__}.step"}
    return {**optimizer, "batches": planned_batches(trainer.opt), **out}


def planned_batches(opt) -> dict[str, int] | None:
    """The Muon parameters and batches of `opt`'s plan on this rank (`Muon.plans`), which
    its step's ops grow with; None for an optimizer without one."""
    plans = getattr(opt, "plans", None)
    if plans is None:
        return None
    batches = [b for _, bs in plans for b in bs]
    return {"params": sum(b.size for b in batches), "batches": len(batches)}


def profiled_events(trainer) -> dict[str, int]:
    """One more step under torch.profiler: per region, the `aten::*` events below it that call
    no other aten op (the kernels: what a composite op turns into, and what kernels call,
    allocations included). A figure of the CPU profiler's, next to the ops the probe sees
    dispatched (which count a composite op's inner calls as one)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def labelled(obj, attr: str, name: str):
        original = getattr(obj, attr)

        def run(*args, **kwargs):
            with record_function(f"probe::{name}"):
                return original(*args, **kwargs)

        setattr(obj, attr, run)
        return lambda: setattr(obj, attr, original)

    undo = [labelled(trainer.opt, "step", REGIONS[0])]
    undo.append(labelled(trainer, _optimizer_part(trainer), REGIONS[1]))
    try:
        with (
            profile(activities=[ProfilerActivity.CPU]) as prof,
            record_function(f"probe::{REGIONS[2]}"),
        ):
            trainer.train_step(measure=False)
    finally:
        for u in reversed(undo):
            u()
    counts = dict.fromkeys(REGIONS, 0)
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        if any(child.name.startswith("aten::") for child in event.cpu_children):
            continue  # a composite op: its leaves are counted
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("probe::"):
                counts[parent.name.removeprefix("probe::")] += 1
            parent = parent.cpu_parent
    return counts


def time_rank(overrides: list[str], steps: int) -> dict[str, list[float]]:
    """One rank: warm up one step, then the seconds of `steps` train steps and of the
    optimizer `step` inside each (every rank starts each step together): wall time
    (`step_s`, `opt_s`) and this process's CPU time (`step_cpu_s`, `opt_cpu_s`: what other
    load on a shared machine inflates least; a gloo wait for a slower rank costs none)."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(overrides, Path(tmp))
        trainer.train_step(measure=False)
        out: dict[str, list[float]] = {k: [] for k in TIMES}
        original = trainer.opt.step

        def timed_step(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.process_time()
            result = original(*args, **kwargs)
            out["opt_s"].append(time.perf_counter() - t0)
            out["opt_cpu_s"].append(time.process_time() - c0)
            return result

        trainer.opt.step = timed_step
        for _ in range(steps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step(measure=False)
            out["step_s"].append(time.perf_counter() - t0)
            out["step_cpu_s"].append(time.process_time() - c0)
        return out


def count_case(
    overrides: list[str], world_size: int, *, pythonpath: str | None = None
) -> list[dict[str, Any]]:
    """Every rank's counts of one step of `overrides` on `world_size` ranks."""
    overrides = [*overrides, f"mesh.world_size={world_size}"]
    return run_world(count_rank, world_size, overrides, timeout_s=1800, pythonpath=pythonpath)


def time_case(
    overrides: list[str], world_size: int, steps: int, *, pythonpath: str | None = None
) -> dict[str, list[float]]:
    """Per timed step and figure of `time_rank`, the largest over the ranks."""
    overrides = [*overrides, f"mesh.world_size={world_size}"]
    ranks = run_world(
        time_rank, world_size, overrides, steps, timeout_s=3600, pythonpath=pythonpath
    )
    return {key: [max(r[key][i] for r in ranks) for i in range(steps)] for key in ranks[0]}
