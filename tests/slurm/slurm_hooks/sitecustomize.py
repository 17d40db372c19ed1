"""Test hook for the multi-node Slurm tests: slow checkpoint writes on rank 0.

Python imports `sitecustomize` at startup from the path;
tests/slurm/test_slurm_multinode.py puts this directory on PYTHONPATH of one job only.
With SLOW_SAVE_S set, rank 0's
`recipes.checkpoint.Checkpointer.save` (how the trainer writes checkpoints) first records
`<SLOW_SAVE_DIR>/saving_<step>` and sleeps SLOW_SAVE_S seconds (the other ranks wait for it
inside the collective save), then writes the checkpoint as usual; `saved_<step>` marks the end.
SLOW_SAVE_STEPS (comma-separated steps) limits the sleep to those steps' saves (marks are
written for every save); SLOW_SAVE_JOB (a Slurm job name) limits the hook to that job's ranks.
Only the first run of a job is slowed (a requeued one, SLURM_RESTART_COUNT > 0, writes at full
speed). Nothing else changes.
"""

import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path

_TARGET = "recipes.checkpoint"


def _patch(module) -> None:
    real_save = module.Checkpointer.save
    delay = float(os.environ["SLOW_SAVE_S"])
    marks = Path(os.environ["SLOW_SAVE_DIR"])
    only = {int(s) for s in os.environ.get("SLOW_SAVE_STEPS", "").split(",") if s}

    def save(self, step, *args, **kwargs):
        rank0 = os.environ.get("RANK", "0") == "0"
        if rank0:
            (marks / f"saving_{step}").write_text(f"{time.time()}\n")
            if not only or step in only:
                time.sleep(delay)
        out = real_save(self, step, *args, **kwargs)
        if rank0:
            (marks / f"saved_{step}").write_text(f"{time.time()}\n")
        return out

    module.Checkpointer.save = save


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of recipes.checkpoint so the module is patched right after it runs."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


_job = os.environ.get("SLOW_SAVE_JOB")
if (
    os.environ.get("SLOW_SAVE_S")
    and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    and _job in (None, os.environ.get("SLURM_JOB_NAME"))
):
    sys.meta_path.insert(0, _Finder())
