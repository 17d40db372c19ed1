"""Checks of a run's surroundings before any rank starts, callable wherever validation runs.

- `check_run_name`: `run.name` is a relative path inside `run.root` (no `..`, no absolute
  path, no `~`): the run directory `<run.root>/<run.name>/<overrides>` never escapes its root
  (the `<overrides>` leaf is made safe by `run_dir.run_id`). `check_path_overrides` applies it
  to the command line, before Hydra creates the run directory.
- `check_token_ids`: every token id of the training and validation files is below
  `data.vocab_size`, naming the file and its largest id. Byte-wide files under a vocabulary
  that covers their dtype need no scan; any other is scanned once, in chunks (numpy, no torch),
  and the largest id is kept in `data.cache_dir` under the file's path, size and mtime, so a
  restart does not scan it again.

Neither imports torch; `recipes.memory_check` (which does) checks the step's memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath

from omegaconf import DictConfig

from recipes.config.schema import ConfigError, DataSource

#: tokens read at a time by the scan (64 MiB of uint16)
SCAN_CHUNK = 1 << 25
_ITEMSIZE = {"uint8": 1, "uint16": 2, "uint32": 4}


def check_run_name(name: str, key: str = "run.name") -> None:
    """`name` as a path below run.root: relative, without `..` or `~`, not empty."""
    text = str(name)
    parts = PurePosixPath(text.replace("\\", "/")).parts
    rule = None
    if not text.strip() or not parts:
        rule = "is empty"
    elif PurePosixPath(text).is_absolute() or PureWindowsPath(text).is_absolute():
        rule = "is an absolute path"
    elif ".." in parts:
        rule = "has a '..' component"
    elif text.startswith("~"):
        rule = "starts with '~'"
    if rule:
        raise ConfigError(
            f"{key}={text}: {rule}; the run directory is <run.root>/<run.name>/<overrides>, "
            "so run.name must be a relative path inside run.root (letters, digits, '._-', "
            "'/' between parts; set run.root to put runs elsewhere)"
        )


def check_path_overrides(argv: Sequence[str]) -> None:
    """`run.name` given on the command line (also swept: `run.name=a,b`) is checked before
    Hydra makes its run directory from it."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "run.name":
            for one in _sweep_values(value):
                check_run_name(one)


def _sweep_values(value: str) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(f"run.name={value}")
    except Exception:  # noqa: BLE001 - Hydra reports its own grammar errors
        return [value]
    if override.is_sweep_override():
        return [str(v) for v in override.sweep_string_iterator()]
    return [str(override.value())]


def check_token_ids(cfg: DictConfig) -> None:
    """Every id of the token files `data.*` names is < `data.vocab_size` (see the module)."""
    data = cfg.data
    if data.source == DataSource.stdlib or data.path is None:
        return  # bytes, and validate requires data.vocab_size >= 256 for them
    dtype = str(getattr(data.dtype, "value", data.dtype))
    if data.vocab_size >= 2 ** (8 * _ITEMSIZE[dtype]):
        return  # every value the dtype holds is in the vocabulary
    path = Path(os.path.expanduser(data.path))
    files = [path] if path.is_file() else [path / "train.bin", path / "val.bin"]
    for file in [f for f in files if f.is_file()]:
        largest = max_token_id(file, dtype, Path(os.path.expanduser(data.cache_dir)))
        if largest is not None and largest >= data.vocab_size:
            raise ConfigError(
                f"data.vocab_size={data.vocab_size}: {file} holds token id {largest} "
                f"(ids must be < data.vocab_size); the file was written with a larger "
                "vocabulary or is damaged: prepare it again with scripts/prepare_data.py, or "
                f"set data.vocab_size >= {largest + 1}"
            )


def max_token_id(path: Path, dtype: str, cache_dir: Path | None = None) -> int | None:
    """The largest id of a token file (None: empty), read in chunks of `SCAN_CHUNK` tokens;
    remembered in `cache_dir` under the file's resolved path, size and mtime."""
    import numpy as np

    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{dtype}"
    memo = None
    if cache_dir is not None:
        memo = cache_dir / "token-max" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
        try:
            return json.loads(memo.read_text())["max_id"]
        except (OSError, ValueError, KeyError):
            pass
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r") if st.st_size else None
    largest = None
    if tokens is not None and tokens.size:
        largest = max(
            int(tokens[i : i + SCAN_CHUNK].max()) for i in range(0, tokens.size, SCAN_CHUNK)
        )
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"file": key, "max_id": largest}))
            os.replace(tmp, memo)
        except OSError:
            pass  # a read-only cache: scan again next time
    return largest
