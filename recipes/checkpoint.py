"""Distributed checkpoints: model (safetensors), optimizer (DCP), trainer state, atomically.

One checkpoint is a directory `<root>/step_<step:08d>/`:

    model/      the model state dict through HuggingFaceStorageWriter(save_distributed=True,
                enable_consolidation=True): full tensors in safetensors, any world can read it
    optim/      the optimizer's tensors (Muon momentum, AdamW moments and steps) the same way,
                keyed `state.<param FQN>.<name>`; param groups and scalar state in plain.json
    trainer.json  step, samples consumed, scheduler state, counters, the world that wrote it
    rng/rank_<r>.pt  each rank's RNG states (restored only on a world of the same size)
    COMMITTED   written last; a directory without it is not a checkpoint

Everything is written under `.tmp-step_<step>` and renamed once every rank has finished, so
a process killed while writing leaves the previous checkpoint as the newest loadable one.
State dicts go through torch.distributed.checkpoint's get_state_dict / set_state_dict, which
name tensors by parameter FQN and reshard on load: a checkpoint written by 4 ranks at ep=2
loads on 2 ranks at ep=1.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

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


def model_file(ckpt: Path) -> Path:
    """The consolidated safetensors file of a checkpoint's model."""
    files = sorted((Path(ckpt) / "model").glob("*.safetensors"))
    if len(files) != 1:
        raise FileNotFoundError(f"{ckpt}/model: expected one consolidated file, found {files}")
    return files[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    """This rank's RNG states."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Collective: write the checkpoint of `step`, commit it, keep the newest `keep`."""
    root = Path(root)
    rank = _rank()
    final = step_dir(root, step)
    tmp = root / f"{_TMP_PREFIX}{final.name}"
    if rank == 0:
        for stale in root.glob(f"{_TMP_PREFIX}*"):  # left by a process killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
        (tmp / "rng").mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save(
        model_sd,
        storage_writer=HuggingFaceStorageWriter(
            str(tmp / "model"), save_distributed=True, enable_consolidation=True
        ),
    )
    tensors, plain = _split_optim(optim_sd)
    dcp.save(
        tensors,
        storage_writer=HuggingFaceStorageWriter(
            str(tmp / "optim"), save_distributed=True, enable_consolidation=True
        ),
    )
    torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    _barrier()  # every rank's files are in place
    if rank == 0:
        # The consolidated files hold the whole state; the per-rank pieces are redundant.
        for part in ("model", "optim"):
            shutil.rmtree(tmp / part / "sharded", ignore_errors=True)
        (tmp / "optim" / "plain.json").write_text(json.dumps(plain, indent=1))
        world = dist.get_world_size() if dist.is_initialized() else 1
        state = dict(trainer_state, step=step, world_size=world)
        (tmp / "trainer.json").write_text(json.dumps(state, indent=1))
        _fsync_dir(tmp)
        (tmp / COMMITTED).write_text(f"{step}\n")
        _replace(tmp, final)
        for old in committed(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _split_optim(optim_sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An FQN-keyed optimizer state dict as flat tensors (for safetensors) and plain data.

    Scalar state (AdamW's per-parameter `step`) goes with the param groups into JSON: the same
    on every rank, and the Hugging Face storage layer does not round-trip 0-dim tensors.
    """
    tensors, scalars = {}, {}
    for fqn, state in optim_sd["state"].items():
        for name, value in state.items():
            key = f"state.{fqn}.{name}"
            if value.ndim == 0:
                scalars[key] = [value.item(), str(value.dtype).removeprefix("torch.")]
            else:
                tensors[key] = value
    return tensors, {"param_groups": optim_sd["param_groups"], "scalars": scalars}


def _join_optim(tensors: dict[str, torch.Tensor], plain: dict) -> dict:
    """Inverse of `_split_optim`: back to {"state": {fqn: {name: t}}, "param_groups": [...]}."""
    scalars = {
        key: torch.tensor(value, dtype=getattr(torch, dtype))
        for key, (value, dtype) in plain["scalars"].items()
    }
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in {**tensors, **scalars}.items():
        fqn, name = key.removeprefix("state.").rsplit(".", 1)
        state.setdefault(fqn, {})[name] = value
    return {"state": state, "param_groups": plain["param_groups"]}


def read_optimizer_state(ckpt: Path) -> dict:
    """A checkpoint's optimizer state dict with full tensors, in one process (for inspection)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted((Path(ckpt) / "optim").glob("*.safetensors")):
        tensors.update(load_file(f))
    return _join_optim(tensors, json.loads((Path(ckpt) / "optim" / "plain.json").read_text()))


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
    """Collective: load a checkpoint into model and optimizer (resharding as needed).

    Returns the trainer state, with `rng` set to this rank's RNG states when the checkpoint was
    written by a world of the same size (else None).
    """
    ckpt = Path(ckpt)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load(model_sd, storage_reader=HuggingFaceStorageReader(str(ckpt / "model")))
    tensors, _ = _split_optim(optim_sd)
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(ckpt / "optim")))
    optim_sd = _join_optim(tensors, json.loads((ckpt / "optim" / "plain.json").read_text()))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    state = json.loads((ckpt / "trainer.json").read_text())
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = ckpt / "rng" / f"rank_{_rank()}.pt"
    same_world = state["world_size"] == world and rng_file.is_file()
    state["rng"] = torch.load(rng_file, weights_only=False) if same_world else None
    return state
