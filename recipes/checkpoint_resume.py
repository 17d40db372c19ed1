"""Which checkpoint a run resumes from: the newest committed one that verifies and holds finite
weights, or, with `checkpoint.fallback=true`, the newest such one before it.

`load_newest(root, model, optimizer, fallback=...)` (collective) takes the committed
checkpoints newest first. Each is verified (recipes.checkpoint_verify: every file against
the manifest, the structure), loaded, and its parameters checked for NaN and inf. The first
that passes is the one resumed from. One that fails is refused with a `CheckpointRefused`
naming the checkpoint, each file and what is wrong with it; the run stops there and nothing
is changed, unless `fallback`: then it is moved to `refused-step_<n>/` beside the others
(kept for inspection, no longer committed, so neither a later resume nor rotation counts it)
and the one before it is tried.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recipes import checkpoint, checkpoint_verify
from recipes.ranks import in_process_group, rank

log = logging.getLogger(__name__)

#: the directory a refused checkpoint is moved to, with `checkpoint.fallback=true`
REFUSED_PREFIX = "refused-"


class CheckpointRefused(RuntimeError):
    """A committed checkpoint failed verification or holds non-finite weights."""


def _broadcast(obj: Any) -> Any:
    if not in_process_group():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def set_refused_aside(ckpt: Path) -> Path:
    """Rank 0: move a refused checkpoint to `refused-<name>[-<n>]/` beside it."""
    ckpt = Path(ckpt)
    aside, n = ckpt.with_name(f"{REFUSED_PREFIX}{ckpt.name}"), 1
    while aside.exists():
        n += 1
        aside = ckpt.with_name(f"{REFUSED_PREFIX}{ckpt.name}-{n}")
    os.replace(ckpt, aside)
    return aside


def _check_then_load(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[str], dict | None]:
    """Collective: (what is wrong, None) or ([], the trainer state loaded)."""
    if checkpoint_verify.manifest_sha(ckpt) is None and rank() == 0:
        log.warning("%s: committed before manifests: only its structure is checked", ckpt)
    problems = checkpoint_verify.verify(ckpt)
    if problems:
        return problems, None
    state = checkpoint.load(ckpt, model, optimizer)
    bad = checkpoint_verify.nonfinite_parameters(model)
    if bad:
        listed = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        return [f"non-finite weights (NaN or inf) in {len(bad)} parameters: {listed}"], None
    return [], state


def load_newest(
    root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, fallback: bool
) -> tuple[Path, dict[str, Any]] | None:
    """Collective: load the newest committed checkpoint under `root` that passes (see the
    module doc); returns it and its trainer state (`checkpoint.load`'s), None when `root`
    holds none. Raises CheckpointRefused when the newest fails and not `fallback`, or when
    every one fails."""
    found = [str(p) for p in reversed(checkpoint.committed(root))] if rank() == 0 else None
    refused = []
    for ckpt in map(Path, _broadcast(found)):
        problems, state = _check_then_load(ckpt, model, optimizer)
        if not problems:
            return ckpt, state
        what = f"checkpoint {ckpt} refused: {'; '.join(problems)}"
        if not fallback:
            raise CheckpointRefused(
                f"{what}. Nothing was changed; checkpoint.fallback=true sets it aside and "
                "resumes from the previous verified checkpoint"
            )
        if rank() == 0:
            log.warning("%s; checkpoint.fallback=true: moved to %s", what, set_refused_aside(ckpt))
        refused.append(ckpt.name)
        if dist.is_initialized():
            dist.barrier()
    if refused:
        raise CheckpointRefused(
            f"{root}: every committed checkpoint was refused ({', '.join(refused)}, now "
            f"{REFUSED_PREFIX}*, see the warnings above); checkpoint.resume=false starts over"
        )
    return None
