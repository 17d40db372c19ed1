"""What a training run keeps beyond its processes: resuming from the newest checkpoint (or
starting from a transformers directory), saving a step, and the final transformers export.
Functions of the `recipes.trainer.Trainer` they serve (its model, optimizer, schedule, guard
and counters), kept apart from the loop."""

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipes import checkpoint
from recipes.checkpoint_resume import load_newest

log = logging.getLogger("recipes")

_HF_RANDOM_INIT = (
    "model=hf without checkpoint.init_from: the weights start from a seeded random init "
    "(train.seed=%d), model.path=%s gives the config only; checkpoint.init_from=%s loads them"
)


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def batch_change(saved_dp: int, dp: int, samples_per_step: int) -> str:
    """The notice of a resume on another data-parallel size (world_size / mesh.cp: `dp`,
    against the checkpoint's `saved_dp`): `data.batch_size` is per data-parallel rank, so the
    global batch scales with them (the schedule goes on by step)."""
    before = samples_per_step // dp * saved_dp
    return (
        f"resumed on {dp} data-parallel ranks from a checkpoint of {saved_dp}: the global "
        "batch changes "
        f"from {before} to {samples_per_step} samples per step (data.batch_size x "
        "train.grad_accum_steps per rank; per mesh.cp ranks under context parallelism); the "
        f"schedule continues by step. To keep it, resume on {saved_dp} data-parallel ranks "
        "(world_size / cp) or scale data.batch_size (a new run: it is in the run's name)"
    )


def resume(t) -> None:
    """Load the newest committed checkpoint of `t`'s run dir into the Trainer `t`, if any; with
    `checkpoint.resume=false` move the run found there aside instead (checkpoint.set_aside)."""
    found = checkpoint.latest(t.ckpt_root) if t.rank == 0 else None
    if found and not t.cfg.checkpoint.resume:  # a start over: the old run kept apart
        aside = checkpoint.set_aside(t.run_dir)
        log.warning("checkpoint.resume=false: the previous run moved to %s", aside)
        found = None
    found = _broadcast(str(found) if found else None)
    if found is None:
        init_from(t)
        return
    found, state = load_newest(  # verified, finite; an older one only with fallback
        t.ckpt_root, t.model, t.opt, fallback=t.cfg.checkpoint.fallback
    )
    t.step, t.samples, t.skipped = state["step"], state["samples"], state["skipped"]
    t.sched.load_state_dict(state["scheduler"])
    t.guard.resume(state)
    if state["rng"] is not None:
        checkpoint.set_rng_state(state["rng"])
    if t.rank == 0:
        log.info(
            "resumed from %s (written by %d ranks; this world: %d)",
            found,
            state["world_size"],
            t.world,
        )
        saved_dp = state["world_size"] // state.get("cp", 1)
        if saved_dp != t.share.dp_size:
            log.warning(batch_change(saved_dp, t.share.dp_size, t.samples_per_step))


def init_from(t) -> None:
    """A fresh run with `checkpoint.init_from`: every rank reads its shards of the weights
    (without it, a model=hf run warns that its weights are not model.path's)."""
    cfg = t.cfg
    path = cfg.checkpoint.init_from
    if path is None:
        if t.rank == 0 and str(cfg.model.preset) == "hf":  # its config.json only
            log.warning(_HF_RANDOM_INIT, cfg.train.seed, *[cfg.model.path] * 2)
        return
    from recipes.hf import init_from as read_hf

    initialized = read_hf(
        t.model, Path(path).expanduser(), init_missing_mtp=bool(cfg.checkpoint.init_missing_mtp)
    )
    if t.rank == 0:
        log.info("initialized from the transformers directory %s", path)
        if initialized:
            log.warning(
                "%s holds no MTP layer weights; these %d tensors keep their seeded "
                "initialization: %s",
                path,
                len(initialized),
                ", ".join(initialized),
            )


def save(t) -> Path:
    """Collective: checkpoint `t`'s current step (committed now, or at the next save / `wait`
    with `checkpoint.async_mode`)."""
    t.read_skipped()
    state = {
        "samples": t.samples,
        "skipped": t.skipped,
        "scheduler": t.sched.state_dict(),
        "ep": t.cfg.mesh.ep,
        "cp": t.cfg.mesh.cp,
        "model_config": t.model.config.to_dict(),
        **t.guard.state(),
    }
    return t.checkpointer.save(t.step, t.model, t.opt, state)


def export_hf(t) -> None:
    """Collective: the final checkpoint's model in the transformers layout (<run>/hf), each
    rank writing its share of the files."""
    from recipes.hf import export_checkpoint

    c = t.cfg.checkpoint
    out = t.run_dir / "hf"
    last = checkpoint.step_dir(t.ckpt_root, t.step)
    dtype = getattr(torch, str(c.hf_dtype))
    export_checkpoint(last, out, dtype=dtype, max_shard_gib=c.hf_max_shard_gib)
    if t.rank == 0:
        log.info("transformers export: %s", out)
