"""Distributed checkpoints: sharded DCP (optionally asynchronous), committed atomically.

One checkpoint is a directory `<root>/step_<step:08d>/`:

    model/      the model state dict, torch.distributed.checkpoint's own sharded format: every
                rank writes the shards it holds (`__<rank>_0.distcp`), rank 0 the `.metadata`
    optim/      the optimizer state dict (Muon momentum, AdamW moments and steps, param groups),
                keyed by parameter FQN, the same way
    trainer.json  step, samples consumed, scheduler state, counters, the model config, the
                world that wrote it
    rng/rank_<r>.safetensors  each rank's RNG states as tensors (restored only on a world of
                the same size; no pickle)
    MANIFEST.json  every file's size and SHA-256 (recipes/checkpoint_verify.py: each rank
                hashes the files it wrote), verified before a resume loads the checkpoint
    COMMITTED   written last: the step and the manifest's SHA-256; a directory without it is
                not a checkpoint

DCP's `.metadata` files and the non-tensor entries of its shards are pickles: `load` and the
readers below go through recipes/dcp_safe.py, which admits only DCP's metadata classes and
plain values, so a checkpoint from elsewhere cannot run code (docs/training.md, Reliability).

No rank ever holds a tensor it does not own: each writes its local shards (a non-contiguous
shard is copied once, so a save costs at most the largest single local tensor on top of the
rank's own state). Everything is written under `.tmp-step_<step>` and renamed once every rank
has finished, so a process killed while writing leaves the previous checkpoint as the newest
loadable one. State dicts go through get_state_dict / set_state_dict, which name tensors by
parameter FQN, and DCP reshards on load: a checkpoint written by 4 ranks at ep=2 loads on 2
ranks at ep=1.

Asynchronous saves (`Checkpointer(async_mode=True)`, DCP's async_save): the call stages a CPU
copy of this rank's state (so it costs the rank's own shards once more while the write runs),
writes it on a background thread and returns; training goes on. The commit (trainer.json,
COMMITTED, rename) happens at the next `save` or at `wait()`, after every rank's write has
finished. The background writes coordinate over dedicated gloo groups, so they never
interleave with the training collectives on the default group.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from recipes import checkpoint_verify, dcp_safe, ranks

COMMITTED = "COMMITTED"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp-"


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint at `step`."""
    return Path(root) / f"{_PREFIX}{step:08d}"


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.glob(f"{_PREFIX}*") if (p / COMMITTED).is_file()]
    return sorted(dirs, key=lambda p: int(p.name[len(_PREFIX) :]))


def latest(root: Path) -> Path | None:
    """The newest committed checkpoint under `root`, or None."""
    found = committed(root)
    return found[-1] if found else None


def set_aside(run_dir: Path) -> Path | None:
    """Move the run in `run_dir` (its checkpoints, metrics.jsonl and export hf/) into a new
    `replaced-<n>/` there, for a start over (`checkpoint.resume=false`): the new run's
    checkpoints never share a directory with the old ones, so keep-rotation (by step) cannot
    delete them and a later restart resumes the new run. Returns where they went (None when
    there was no committed checkpoint). Local file operations: call on one process only."""
    run_dir = Path(run_dir)
    if not committed(run_dir / "checkpoints"):
        return None
    n = 1 + len(list(run_dir.glob("replaced-*")))
    aside = run_dir / f"replaced-{n}"
    aside.mkdir()
    for name in ("checkpoints", "metrics.jsonl", "hf"):
        if (run_dir / name).exists():
            os.replace(run_dir / name, aside / name)
    return aside


def _barrier(group=None) -> None:
    if ranks.in_process_group():
        dist.barrier(group=group)


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's RNG states (byte tensors)."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def write_rng(ckpt: Path, rank: int) -> None:
    """This rank's RNG states as `rng/rank_<rank>.safetensors` (plain tensors, no pickle)."""
    save_file(rng_state(), str(Path(ckpt) / "rng" / f"rank_{rank}.safetensors"))


def read_rng(ckpt: Path, rank: int) -> dict[str, torch.Tensor] | None:
    """The RNG states `write_rng` stored for `rank` (None when absent). A checkpoint written
    before the safetensors format holds `rank_<rank>.pt`: it is read with `weights_only=True`,
    which accepts tensors and plain containers only, so a crafted pickle is refused, not run."""
    rng = Path(ckpt) / "rng"
    path = rng / f"rank_{rank}.safetensors"
    if path.is_file():
        state = load_file(str(path))
    elif (rng / f"rank_{rank}.pt").is_file():
        path = rng / f"rank_{rank}.pt"
        try:
            state = torch.load(path, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"{path}: not plain RNG tensors, refused (it would run code when unpickled). "
                f"Delete {rng} to resume without the saved RNG states (the weights, optimizer "
                "and data position still resume); checkpoints written now store them as "
                "rank_<k>.safetensors"
            ) from err
    else:
        return None
    if (
        not isinstance(state, dict)
        or not all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in state.values())
        or "cpu" not in state
    ):
        raise ValueError(f"{path}: expected RNG byte tensors under 'cpu' (and 'cuda')")
    return state


class Checkpointer:
    """Writes the checkpoints of one run under `root`, keeping the newest `keep` committed.

    Collective: every rank constructs it and calls `save` / `wait` at the same points."""

    def __init__(self, root: Path, *, keep: int, async_mode: bool = False) -> None:
        self.root, self.keep, self.async_mode = Path(root), keep, async_mode
        self._pending: tuple[Path, int, dict, list[Future]] | None = None
        self._groups = {"model": None, "optim": None}
        if async_mode and dist.is_initialized():
            # The two background writes (model, optimizer) run concurrently, each gathering its
            # plans over its own group: never the default group, never each other's.
            self._groups = {part: dist.new_group(backend="gloo") for part in self._groups}

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
    ) -> Path:
        """Collective: write the checkpoint of `step` (committed now, or at the next `save` /
        `wait` when asynchronous). Returns its final directory."""
        self.wait()  # the previous asynchronous save commits first
        rank, final = ranks.rank(), step_dir(self.root, step)
        tmp = self.root / f"{_TMP_PREFIX}{final.name}"
        if rank == 0:
            for stale in self.root.glob(f"{_TMP_PREFIX}*"):  # left by a process killed mid-write
                shutil.rmtree(stale, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        write_rng(tmp, rank)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = dict(trainer_state, step=step, world_size=ranks.world_size())
        if self.async_mode:
            futures = [
                dcp.async_save(
                    sd,
                    storage_writer=FileSystemWriter(tmp / part),
                    process_group=self._groups[part],
                )
                for part, sd in (("model", model_sd), ("optim", optim_sd))
            ]
            self._pending = (tmp, step, state, futures)
        else:
            dcp.save(model_sd, storage_writer=FileSystemWriter(tmp / "model"))
            dcp.save(optim_sd, storage_writer=FileSystemWriter(tmp / "optim"))
            self._commit(tmp, step, state)
        return final

    def wait(self) -> None:
        """Collective: finish and commit a pending asynchronous save (no-op when none)."""
        if self._pending is None:
            return
        tmp, step, state, futures = self._pending
        self._pending = None
        for f in futures:
            f.result()  # re-raises a failed write: that checkpoint is never committed
        self._commit(tmp, step, state)

    def _commit(self, tmp: Path, step: int, state: dict) -> None:
        digests = checkpoint_verify.gather_digests(tmp, ranks.rank())  # every rank's files in place
        if ranks.rank() == 0:
            (tmp / "trainer.json").write_text(json.dumps(state, indent=1))
            manifest = checkpoint_verify.write_manifest(tmp, digests)
            _fsync_dir(tmp)
            (tmp / COMMITTED).write_text(checkpoint_verify.commit_text(step, manifest))
            final = step_dir(self.root, step)
            _replace(tmp, final)
            rotate(self.root, self.keep)
        _barrier()


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Collective: write the checkpoint of `step` synchronously, commit it, keep the newest
    `keep`."""
    return Checkpointer(root, keep=keep).save(step, model, optimizer, trainer_state)


def trained(ckpt: Path) -> bool:
    """Whether a checkpoint's step trained: not skipped, a finite loss, no divergence
    (recipes.guards; trainer.json's `trained`, absent before it was recorded: True)."""
    try:
        return bool(trainer_state(ckpt).get("trained", True))
    except (OSError, ValueError):
        return False  # an unreadable trainer.json is no good state to keep


def last_trained(root: Path) -> Path | None:
    """The newest committed checkpoint under `root` whose step trained, or None."""
    return next((c for c in reversed(committed(root)) if trained(c)), None)


def rotate(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints under `root`, except the newest
    one whose step trained: a run that skips or diverges for more than `keep` saves keeps its
    last good state. Returns the deleted ones. Local file operations: one process only."""
    found = committed(root)
    good = last_trained(root)
    gone = [c for c in found[: max(len(found) - keep, 0)] if c != good]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone


def _fsync_dir(path: Path) -> None:
    for p in [*path.rglob("*"), path]:
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _replace(tmp: Path, final: Path) -> None:
    """Rename tmp -> final; an existing final (a rerun of the same step) is replaced."""
    if final.exists():
        old = final.with_name(f"{_TMP_PREFIX}old-{final.name}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def load(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective: load a checkpoint into model and optimizer (resharding as needed); each rank
    reads only the pieces of the files that overlap its own shards.

    Returns the trainer state, with `rng` set to this rank's RNG states when the checkpoint was
    written by a world of the same size (else None).
    """
    ckpt = Path(ckpt)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp_safe.load(model_sd, ckpt / "model")  # no code runs from the files (recipes/dcp_safe.py)
    dcp_safe.load(optim_sd, ckpt / "optim")
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    state = trainer_state(ckpt)
    state["rng"] = (
        read_rng(ckpt, ranks.rank()) if state["world_size"] == ranks.world_size() else None
    )
    return state


def trainer_state(ckpt: Path) -> dict[str, Any]:
    """The trainer.json of a checkpoint."""
    return json.loads((Path(ckpt) / "trainer.json").read_text())


def _read_whole(path: Path) -> dict:
    """Every entry of a DCP directory as full tensors in this process (for inspection and tests:
    it holds the whole state; never used by the training path), read without running code."""
    return dcp_safe.read_whole(path)


def read_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model state dict with full tensors, in one process (for inspection)."""
    return _read_whole(Path(ckpt) / "model")


def read_optimizer_state(ckpt: Path) -> dict:
    """A checkpoint's optimizer state dict with full tensors, in one process (for inspection)."""
    return _read_whole(Path(ckpt) / "optim")
