"""The recipe's transformers interface: export a checkpoint, start a run from a GLM directory.

- `export_checkpoint(ckpt, out)`: the model of a committed checkpoint as a transformers
  directory (models.glm.hf.adapter.write_hf), on any number of ranks: rank r writes files
  r, r + W, ...; every tensor is read from the sharded DCP files region by region (one
  transformers tensor at a time: an expert matrix, a norm, the embedding), so no rank ever holds
  more than one tensor beyond what the DCP reader stages (the saved pieces overlapping it).
- `init_from(model, path)`: every rank fills its own shards from the files (hf_import.load_hf).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from models.glm import GLMConfig
from models.glm.hf.adapter import write_hf
from models.glm.hf.load import load_hf
from recipes import checkpoint_verify, ranks
from recipes.dcp_safe import SafeReader
from recipes.units import GiB


class _IntoBuffer(DefaultLoadPlanner):
    """Loads the read items of one region into one destination tensor."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.out


class DCPRegions:
    """Reads row blocks of tensors from a DCP directory in this process, no collective: only
    the saved pieces overlapping the block are loaded (`.metadata` through SafeReader)."""

    def __init__(self, path: str | Path) -> None:
        self.reader = SafeReader(path)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def entry(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"{self.reader.path}: no tensor {key!r} in the checkpoint")
        return md

    def read(self, key: str, row: int, rows: int) -> torch.Tensor:
        """Rows `row .. row + rows` of tensor `key` (a 0-d tensor: the whole of it)."""
        md = self.entry(key)
        shape = (rows, *md.size[1:]) if len(md.size) else ()
        out = torch.empty(shape, dtype=md.properties.dtype)
        offsets = (row, *[0] * (len(shape) - 1)) if shape else ()
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape))
        items = create_read_items_for_chunk_list(key, md, [chunk])
        self.reader.read_data(LoadPlan(items), _IntoBuffer(out)).wait()
        return out


def model_config_of(ckpt: str | Path) -> GLMConfig:
    """The GLMConfig a checkpoint was written with (its trainer.json)."""
    from recipes.checkpoint import trainer_state

    state = trainer_state(ckpt)
    if "model_config" not in state:
        raise ValueError(f"{ckpt}/trainer.json has no model_config (written by an older version)")
    return GLMConfig(**state["model_config"])


def export_checkpoint(
    ckpt: str | Path,
    out: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_gib: float = 5.0,
) -> list[str]:
    """Collective when a process group is initialized (each rank writes its share of the files,
    then all wait); returns the files this rank wrote."""
    ckpt = Path(ckpt)
    rank, world = ranks.rank(), ranks.world_size()
    problems = checkpoint_verify.problems(ckpt, rank, world, parts=("model",))
    if problems:
        raise ValueError(f"checkpoint {ckpt} refused: {'; '.join(problems)}")
    regions = DCPRegions(ckpt / "model")

    def read(key: str, row: int, rows: int) -> torch.Tensor:
        block = regions.read(key, row, rows)
        # Never exported: what loads it would train on it. amin/amax propagate NaN and hold two
        # scalars (isfinite would allocate a bool copy of the block, above the export's bound).
        lo, hi = torch.aminmax(block)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise ValueError(f"checkpoint {ckpt}: {key} holds non-finite values (NaN or inf)")
        return block

    written = write_hf(
        out,
        model_config_of(ckpt),
        read,
        dtype=dtype,
        max_shard_bytes=int(max_shard_gib * GiB),
        rank=rank,
        world=world,
    )
    mode = Path(out).stat().st_mode & 0o666  # made by mkdir: 0o777 less the umask
    for name in written:  # the safetensors library writes 0600; the JSON files get the umask's
        os.chmod(Path(out) / name, mode)
    if dist.is_initialized():
        dist.barrier()
    return written


def init_from(
    model: torch.nn.Module, path: str | Path, *, init_missing_mtp: bool = False
) -> list[str]:
    """Fill this rank's shards of `model` from a transformers directory (no collective);
    returns the MTP tensors the files lack, left as initialized (only with
    `init_missing_mtp`: else they are an error)."""
    return load_hf(model, path, init_missing_mtp=init_missing_mtp)
