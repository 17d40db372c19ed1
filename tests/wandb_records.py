"""What a W&B offline run holds, read back from its `run-<id>.wandb` file for the tests.

W&B 0.31 ships no Python reader for these files (its Go core writes and syncs them), so the
tests read them here: the file is a LevelDB-style log (a 7-byte file header, then 32 KiB
blocks of records, each with a 7-byte header: checksum, length, kind FULL/FIRST/MIDDLE/LAST)
whose payloads are W&B's own protobuf `Record` messages (`wandb.proto.wandb_internal_pb2`).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7


def _payloads(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError("not a W&B run file")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if length == 0 and kind == 0:  # zero padding to the block end
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


@dataclass
class OfflineRun:
    """The parts of an offline run the tests look at."""

    run_id: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)  # the last value of every key
    stats: list[dict[str, Any]] = field(default_factory=list)  # system-metric samples
    metrics: dict[str, str] = field(default_factory=dict)  # define_metric: name -> summary
    git_commit: str = ""


def read(run_dir: Path) -> OfflineRun:
    """An offline run directory (`.../wandb/offline-run-*`)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = Path(run_dir).glob("run-*.wandb")
    out = OfflineRun()
    for payload in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.run_id, out.git_commit = record.run.run_id, record.run.git.commit
            out.config.update({_key(u): json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            out.config.update({_key(u): json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            out.history.append({_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            out.summary.update({_key(u): json.loads(u.value_json) for u in record.summary.update})
        elif kind == "stats":
            out.stats.append({_key(i): json.loads(i.value_json) for i in record.stats.item})
        elif kind == "metric":
            m = record.metric
            rules = [r for r in ("min", "max", "mean", "last", "best") if getattr(m.summary, r)]
            out.metrics[m.name or m.glob_name] = ",".join(rules)
    out.config.pop("_wandb", None)
    return out
