"""Reading torch.distributed.checkpoint (DCP) directories without running code from them.

A DCP directory holds two kinds of pickle, and torch reads both trustingly:
- `.metadata`: DCP's `Metadata` (which tensor lives where, in which file at which offset),
  pickled whole; `FileSystemReader.read_metadata` calls `pickle.load` on it, so a crafted
  `.metadata` runs any code it names.
- the non-tensor values inside the `__<rank>_<i>.distcp` files (here the optimizer's
  param_groups hyperparameters: floats, ints, bools, strings, tuples, None), each a
  `torch.save` record that DCP's planner reads with `torch.load(weights_only=False)`.
The tensors in the same files are read by DCP itself with `torch.load(weights_only=True)`.

`SafeReader` reads `.metadata` with `MetadataUnpickler`, which admits only the classes DCP's
metadata is made of (`ALLOWED`) and refuses any other global by name; `SafePlanner` (and
`read_whole`) read the non-tensor values with `torch.load(weights_only=True)`, which admits
plain values and containers only. Both raise `UnsafeCheckpointError` naming the file (or the
entry) and the refused global, and nothing of the refused pickle runs.
"""

from __future__ import annotations

import io
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from recipes.ranks import in_process_group

_METADATA = "torch.distributed.checkpoint.metadata"

#: module -> the names a DCP `.metadata` may refer to: the metadata dataclasses, the storage
#: record of FileSystemWriter, torch.Size, torch's dtypes and layouts (`_get_layout` maps a
#: layout's name to the layout object), pathlib's paths (`StorageMeta.checkpoint_id`)
ALLOWED: dict[str, frozenset[str]] = {
    _METADATA: frozenset(
        {
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),  # and every torch.dtype: see MetadataUnpickler.find_class
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds a pickle that refers to something it may not (or is no pickle
    of what it should be): refused. `where` is the file or entry, `reason` what is wrong."""

    def __init__(self, where: str | Path, reason: str) -> None:
        super().__init__(where, reason)  # args that rebuild it: DCP gathers ranks' errors
        self.where, self.reason = where, reason

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata`, admitting only `ALLOWED` (and torch's dtypes)."""

    def __init__(self, file, path: str | Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            self.path,
            f"refers to {module}.{name}, which is not one of DCP's metadata classes: refused "
            "(unpickling it could run code); a checkpoint written by "
            "torch.distributed.checkpoint holds only those",
        )


def read_metadata(path: str | Path) -> Metadata:
    """A DCP `.metadata` file, read with `MetadataUnpickler`."""
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # truncated, zeroed, not a pickle at all
            raise UnsafeCheckpointError(path, f"not a DCP metadata pickle ({err!r})") from err
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(path, f"holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class SafeReader(FileSystemReader):
    """torch's FileSystemReader, reading `.metadata` with `MetadataUnpickler`, at once: DCP's
    load catches an error of its own read and tries a rank-local `__<rank>.metadata` instead,
    which would hide the refusal behind a FileNotFoundError."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata = read_metadata(self._get_metadata_path())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        metadata = self._metadata if rank is None else read_metadata(self._get_metadata_path(rank))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


def load_plain(value: io.BytesIO, fqn: str) -> Any:
    """A non-tensor entry's `torch.save` record, read with `weights_only=True`."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL (\S+)", str(err))
        what = f"refers to {named.group(1)}" if named else "holds more than plain values"
        raise UnsafeCheckpointError(
            f"checkpoint entry {fqn!r}",
            f"{what}: refused (unpickling it could run code); DCP's entries besides tensors "
            "are plain values (numbers, strings, tuples, lists, dicts, None)",
        ) from err


def load(state_dict: dict, path: str | Path) -> None:
    """Collective like `dcp.load`: load `state_dict` in place from the DCP directory `path`
    through SafeReader and SafePlanner; a refusal on any rank is raised as itself (DCP wraps
    the ranks' errors in a CheckpointException)."""
    try:
        dcp.load(state_dict, storage_reader=SafeReader(path), planner=SafePlanner())
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None
        raise


class _PlainBytes:
    """load_bytes through `load_plain` (DCP's planners use `weights_only=False`)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = load_plain(value, fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class SafePlanner(_PlainBytes, DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are read with `weights_only=True`."""


class _SafeWholePlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """The planner that rebuilds a whole state dict from the metadata, reading safely."""


def read_whole(path: str | Path) -> dict:
    """Every entry of a DCP directory as full tensors in this process (inspection and tests:
    it holds the whole state), read through `SafeReader` and `weights_only=True`."""
    state: dict = {}
    planner = _SafeWholePlanner()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        _load_state_dict(
            state_dict=state,
            storage_reader=SafeReader(path),
            planner=planner,
            no_dist=not in_process_group(),
        )
    return state  # the planner rebuilt it nested, in place
