"""What types cannot say about a composed config, checked before any rank starts.

`validate` runs two stages. `validate_config`, here, imports neither torch nor models/ (nor
numpy): finite numbers, ranges, divisibility, the data files and their meta.json, the
directories a run writes to, the model's and the checkpoint's paths, the run name
(`preflight.check_run_name`); train.py runs it before the ranks' fork server starts, so a bad
override's error comes in well under a second. `model_checks.validate_model` then checks the
model config, its layout on the mesh, the checkpoint to start from and the token ids
(`preflight.check_token_ids`, numpy). Every failure is a `ConfigError` naming the key, the
value, the rule and the key's help.
"""

import dataclasses
import json
import math
import os
import typing
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes.config.describe import config_error as _fail
from recipes.config.keys import nearest_key
from recipes.config.preflight import check_run_name
from recipes.config.schema import (
    OPTIM_SCHEMAS,
    ConfigError,
    ConfigSchema,
    DataSource,
    ModelPreset,
    OptimName,
)


def _positive(cfg: DictConfig, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value < 0 or (value == 0 and not allow_zero):
            raise _fail(key, value, "must be >= 0" if allow_zero else "must be > 0")


def validate(
    cfg: DictConfig,
    env_world_size: int | None = None,
    *,
    check_devices: bool = True,
    overrides: Sequence[str] = (),
) -> None:
    """Every check before any rank starts: `validate_config` (the config itself, no torch),
    then `model_checks.validate_model` (the model the ranks would build: imports models and
    torch). Raises ConfigError naming the key."""
    validate_config(cfg, env_world_size, overrides=overrides)
    from recipes.config.model_checks import validate_model  # it imports this module

    validate_model(cfg, env_world_size, check_devices=check_devices)


def validate_config(
    cfg: DictConfig, env_world_size: int | None = None, *, overrides: Sequence[str] = ()
) -> None:
    """Check what the types cannot, with neither torch nor the model code: finite numbers,
    ranges, divisibility, the command's `overrides` (`check_overrides`), the data files, the
    directories a run writes to, the model's path and the checkpoint's. Raises ConfigError
    naming the key. Fills `data.vocab_size` and `data.dtype` from a prepared token directory's
    meta.json. A new check that needs neither torch nor models/ belongs here; one that needs
    them, in `model_checks.validate_model`."""
    check_overrides(overrides)
    _finite(cfg)
    _validate_data(cfg)
    _positive(cfg, "mesh.world_size", "mesh.ep", "mesh.cp", "optim.lr", "optim.eps")
    _positive(cfg, "mesh.collective_timeout_s")
    _positive(cfg, "data.vocab_size", "data.seq_len")
    _positive(cfg, "data.batch_size", "train.steps", "train.grad_accum_steps")
    _positive(cfg, "metrics.log_every", "metrics.memory_every", "checkpoint.keep")
    _positive(cfg, "optim.weight_decay", allow_zero=True)
    _validate_optim_option(cfg)
    _schema_keys(cfg, ConfigSchema)
    _positive(cfg, "train.warmup_steps", "train.grad_clip", "checkpoint.every", allow_zero=True)
    _positive(cfg, "train.router_bias_rate", "train.mtp_loss_weight", allow_zero=True)
    _positive(cfg, "train.max_skipped_in_row", "train.divergence_steps", allow_zero=True)
    if cfg.optim.get("memory_budget_gib") is not None:
        _positive(cfg, "optim.memory_budget_gib")
    mesh = cfg.mesh
    if mesh.world_size % mesh.ep:
        allowed = [d for d in range(1, mesh.world_size + 1) if mesh.world_size % d == 0]
        raise _fail(
            "mesh.ep",
            mesh.ep,
            f"must divide mesh.world_size={mesh.world_size}; "
            f"allowed: {', '.join(map(str, allowed))}",
        )
    _validate_cp(cfg)
    if env_world_size is not None and env_world_size != mesh.world_size:
        raise _fail(
            "mesh.world_size",
            mesh.world_size,
            f"the launcher started WORLD_SIZE={env_world_size} ranks; "
            f"pass mesh.world_size={env_world_size}",
        )
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise _fail("optim.betas", list(cfg.optim.betas), "must be two values in [0, 1)")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise _fail("train.min_lr_ratio", cfg.train.min_lr_ratio, "must be in [0, 1]")
    nan_step = cfg.train.inject_nan_at_step
    if nan_step is not None and not 1 <= nan_step <= cfg.train.steps:
        raise _fail("train.inject_nan_at_step", nan_step, f"must be in [1, {cfg.train.steps}]")
    if cfg.data.source == DataSource.stdlib and cfg.data.vocab_size < 256:
        raise _fail(
            "data.vocab_size", cfg.data.vocab_size, "data.source=stdlib has byte tokens: >= 256"
        )
    max_token = {"uint8": 2**8, "uint16": 2**16, "uint32": 2**32}[cfg.data.dtype.value]
    if cfg.data.vocab_size > max_token:
        raise _fail(
            "data.vocab_size",
            cfg.data.vocab_size,
            f"does not fit data.dtype={cfg.data.dtype.value} (max {max_token})",
        )
    _validate_stream_length(cfg)
    _validate_paths(cfg)
    check_run_name(cfg.run.name)


def _validate_cp(cfg: DictConfig) -> None:
    """`mesh.cp` divides the world (its groups are consecutive ranks) and cuts `data.seq_len`
    into 2 cp equal chunks (the head-tail layout)."""
    cp, world = cfg.mesh.cp, cfg.mesh.world_size
    if world % cp:
        allowed = [d for d in range(1, world + 1) if world % d == 0]
        raise _fail(
            "mesh.cp",
            cp,
            f"must divide mesh.world_size={world}; allowed: {', '.join(map(str, allowed))}",
        )
    if cp > 1 and cfg.data.seq_len % (2 * cp):
        raise _fail(
            "data.seq_len",
            cfg.data.seq_len,
            f"must be a multiple of 2 x mesh.cp = {2 * cp} (each cp rank holds two equal "
            "chunks of a sequence)",
        )


def _validate_optim_option(cfg: DictConfig) -> None:
    """`optim.name` matches the schema its group option composed; Muon's own ranges."""
    optim = cfg.optim
    name = optim.name.value if isinstance(optim.name, Enum) else str(optim.name)
    if OmegaConf.get_type(optim) is not OPTIM_SCHEMAS[name]:
        composed = next(k for k, v in OPTIM_SCHEMAS.items() if v is OmegaConf.get_type(optim))
        raise _fail(
            "optim.name",
            name,
            f"the optimizer is chosen with the config group: optim={name} instead of "
            f"optim.name={name} (this config composed optim={composed}); "
            f"allowed: {', '.join(OPTIM_SCHEMAS)}",
        )
    if optim.qk_clip_tau is not None:
        _positive(cfg, "optim.qk_clip_tau")
    if not 0.0 <= optim.qk_clip_alpha <= 1.0:
        raise _fail("optim.qk_clip_alpha", optim.qk_clip_alpha, "must be in [0, 1]")
    if name != OptimName.muon:
        return
    _positive(cfg, "optim.adamw_lr", "optim.ns_steps", "optim.max_inflight")
    _positive(cfg, "optim.adamw_weight_decay", allow_zero=True)
    for key in ("momentum", "normuon_beta2"):
        if not 0.0 <= optim[key] < 1.0:
            raise _fail(f"optim.{key}", optim[key], "must be in [0, 1)")


def _validate_data(cfg: DictConfig) -> None:
    """The data source's path, its held-out split for `eval`, and the vocab size and dtype:
    a prepared directory's meta.json fills them, and a value set that contradicts it fails."""
    data = cfg.data
    _positive(cfg, "eval.every", allow_zero=True)
    _positive(cfg, "eval.batches")
    if not 0.0 <= data.val_fraction < 1.0:
        raise _fail("data.val_fraction", data.val_fraction, "must be in [0, 1)")
    if data.source == DataSource.stdlib:
        if data.path is not None and not Path(os.path.expanduser(data.path)).is_dir():
            raise _fail("data.path", data.path, "no such source directory of .py files")
        if cfg.eval.every and data.val_fraction == 0:
            raise _fail("data.val_fraction", 0.0, "eval.every > 0 needs held-out files")
    elif data.path is None:
        raise _fail("data.path", None, "data.source=tokens needs a prepare_data.py directory")
    elif Path(os.path.expanduser(data.path)).is_dir():
        _resolve_prepared(cfg)
    elif not Path(os.path.expanduser(data.path)).is_file():
        raise _fail(
            "data.path",
            data.path,
            "neither a scripts/prepare_data.py directory (train.bin, val.bin, meta.json) "
            "nor a token file",
        )
    elif (what := _not_token_file(Path(os.path.expanduser(data.path)))) is not None:
        raise _fail(
            "data.path",
            data.path,
            f"{what}, not raw token ids: pass a scripts/prepare_data.py directory, or a flat "
            "file of data.dtype ids (recipes.data.write_tokens writes one, with the .json "
            "beside it that names its dtype)",
        )
    elif cfg.eval.every:
        raise _fail(
            "eval.every",
            cfg.eval.every,
            f"data.path={data.path} is one token file, with no validation split: prepare a "
            "directory with scripts/prepare_data.py, or pass eval.every=0",
        )
    for key in ("vocab_size", "dtype"):
        if data[key] is None:
            raise _fail(
                f"data.{key}",
                None,
                "needed for a token file (a scripts/prepare_data.py directory's meta.json "
                "gives it)",
            )
    if data.pack and data.source != DataSource.stdlib:  # stdlib builds its boundaries
        from recipes.data_files import PREPARED_FILES, missing_doc_offsets

        path = Path(os.path.expanduser(data.path))
        files = [path / PREPARED_FILES["train"]] if path.is_dir() else [path]
        if path.is_dir() and cfg.eval.every:
            files.append(path / PREPARED_FILES["val"])
        for why in filter(None, map(missing_doc_offsets, files)):
            raise _fail("data.pack", True, why)


def _resolve_prepared(cfg: DictConfig) -> None:
    from recipes.data_files import is_prepared, read_meta

    data = cfg.data
    if not is_prepared(data.path):
        raise _fail(
            "data.path",
            data.path,
            "a directory without meta.json: not a finished scripts/prepare_data.py output",
        )
    try:
        meta = read_meta(Path(os.path.expanduser(data.path)))
    except ValueError as err:
        raise _fail("data.path", data.path, str(err)) from None
    for key in ("vocab_size", "dtype"):
        value = data[key].value if isinstance(data[key], Enum) else data[key]
        if value is None:
            data[key] = meta[key]
        elif value != meta[key]:
            raise _fail(
                f"data.{key}",
                value,
                f"contradicts {data.path}/meta.json ({key}: {meta[key]}); leave it unset",
            )
    val_tokens = meta["splits"].get("val", {}).get("tokens", 0)
    if cfg.eval.every and not val_tokens:
        raise _fail(
            "eval.every",
            cfg.eval.every,
            f"{data.path} has no validation tokens (prepare it with --val-fraction > 0), "
            "or pass eval.every=0",
        )
    if cfg.eval.every and val_tokens < data.seq_len + 1:
        raise _fail(
            "data.seq_len",
            data.seq_len,
            f"a sample is seq_len + 1 tokens; {data.path}'s validation split holds {val_tokens}",
        )


def _token_count(data: DictConfig) -> int | None:
    """Tokens the stream will hold, from file sizes; None for this Python's own standard
    library (tens of millions of bytes, and summing them costs a second per check)."""
    from recipes.data_files import stdlib_files

    if data.source == DataSource.stdlib:
        if data.path is None:
            return None
        files = stdlib_files(Path(os.path.expanduser(data.path)))
        if not files:
            raise _fail("data.path", data.path, "no .py files in this source directory")
        return sum(p.stat().st_size for p in files) + 2 * max(len(files) - 1, 0)  # b"\n\n"
    path = Path(os.path.expanduser(data.path))
    if path.is_dir():  # a prepare_data.py directory: its training split
        from recipes.data_files import PREPARED_FILES

        path = path / PREPARED_FILES["train"]
    itemsize = {"uint8": 1, "uint16": 2, "uint32": 4}[data.dtype.value]
    size = path.stat().st_size
    meta = path.with_suffix(".json")  # written beside it by recipes.data.write_tokens
    written = json.loads(meta.read_text()).get("dtype") if meta.is_file() else None
    if written not in (None, data.dtype.value) or size % itemsize:
        raise _fail(
            "data.dtype",
            data.dtype.value,
            f"{data.path} is {size} bytes"
            + (f", written as {written}" if written else f", not whole {itemsize}-byte tokens"),
        )
    return size // itemsize


def _not_token_file(path: Path) -> str | None:
    """What a flat `data.path` file is when its first bytes name another format; a file that
    recipes.data.write_tokens wrote (its .json sidecar names the dtype) is not asked."""
    from recipes.data_files import not_tokens

    if path.with_suffix(".json").is_file():
        return None
    return not_tokens(path)


def _validate_stream_length(cfg: DictConfig) -> None:
    """A sample (`data.seq_len` + 1 tokens) fits the token stream (file sizes only)."""
    count = _token_count(cfg.data)
    if count is not None and count < cfg.data.seq_len + 1:
        raise _fail(
            "data.seq_len",
            cfg.data.seq_len,
            f"a sample is seq_len + 1 tokens; data.path={cfg.data.path} holds {count}",
        )


def _validate_paths(cfg: DictConfig) -> None:
    """The model's and the checkpoint's directories, and the directories a run writes to."""
    model = cfg.model
    chosen = str(cfg.train.indexer_training)
    if str(model.overrides.get("indexer_training", chosen)) != chosen:
        raise _fail(
            "model.overrides.indexer_training",
            model.overrides.indexer_training,
            f"train.indexer_training={chosen} picks it; set that instead (kl or frozen)",
        )
    if str(model.preset) == ModelPreset.hf:
        _validate_model_path(model.path)
    elif model.path is not None:
        raise _fail("model.path", model.path, "is read by model=hf only; drop it or use model=hf")
    _positive(cfg, "checkpoint.hf_max_shard_gib")
    path = cfg.checkpoint.init_from
    if path is not None and not (Path(os.path.expanduser(path)) / "config.json").is_file():
        raise _fail("checkpoint.init_from", path, "not a transformers directory (no config.json)")
    _writable(cfg, "run.root", Path(cfg.run.root) / cfg.run.name)
    cache = Path(os.path.expanduser(cfg.data.cache_dir))
    if cfg.data.source == DataSource.stdlib and not any(cache.glob("stdlib-*.bin")):
        _writable(cfg, "data.cache_dir", cache)  # a cache holding built files is only read


def _writable(cfg: DictConfig, key: str, path: Path) -> None:
    """`path` can be made and written: its nearest existing ancestor is a writable directory
    (os.access: permissions and read-only file systems). A run made there later would fail
    inside Hydra (a traceback) or a rank (after the world started)."""
    path = Path(os.path.expanduser(path)).absolute()
    existing = next(p for p in (path, *path.parents) if os.path.exists(p) or p == p.parent)
    where = " (the working directory)" if existing == Path.cwd() else ""
    if not existing.is_dir():
        raise _fail(key, OmegaConf.select(cfg, key), f"{existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise _fail(
            key,
            OmegaConf.select(cfg, key),
            f"{existing}{where} is not writable (no permission, or a read-only file system); "
            "pass a writable directory",
        )


def _validate_model_path(path: str | None) -> None:
    if path is None:
        raise _fail("model.path", None, "model=hf needs a transformers directory (model.preset=hf)")
    if not (Path(os.path.expanduser(path)) / "config.json").is_file():
        raise _fail("model.path", path, "not a transformers directory (no config.json)")


def _bool_keys(cls: type, prefix: str = "") -> set[str]:
    """Dotted keys of the schema's bool fields (every optimizer's)."""
    hints, out = typing.get_type_hints(cls), set()
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if f.name == "optim" and not prefix:
            for schema in OPTIM_SCHEMAS.values():
                out |= _bool_keys(schema, "optim.")
        elif dataclasses.is_dataclass(hint):
            out |= _bool_keys(hint, f"{prefix}{f.name}.")
        elif hint is bool:
            out.add(f"{prefix}{f.name}")
    return out


def check_overrides(overrides: Sequence[str]) -> None:
    """A bool key takes `true` or `false` on the command line: OmegaConf would turn any other
    int (`checkpoint.async_mode=2`) and strings such as `yes` into a bool without a word."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    bools = _bool_keys(ConfigSchema)
    for o in OverridesParser.create().parse_overrides(list(overrides)):
        if o.key_or_group not in bools or o.is_sweep_override() or o.is_delete():
            continue
        value = o.value()
        if not (isinstance(value, bool) or str(value).lower() in ("true", "false")):
            raise _fail(o.key_or_group, value, "must be true or false")


def _schema_keys(node: DictConfig, cls: type, prefix: str = "") -> None:
    """Every key of `node` is a field of its schema dataclass `cls`: Hydra's `+` appends to any
    node (`+train.no_such_key=1` composes), and every rank's `store.from_yaml` would then stop
    on the key; it is refused here, by name, before any rank starts. Free-form dicts
    (`model.overrides`) are checked by their own rules."""
    hints = typing.get_type_hints(cls)
    for key in node:
        path = f"{prefix}{key}"
        if key not in hints:
            names = [f.name for f in dataclasses.fields(cls)]
            value = OmegaConf.select(node, str(key))
            if prefix == "optim." and (elsewhere := other_option_key(str(key), cls)):
                raise ConfigError(f"{path}={value}: {elsewhere}")
            hint = nearest_key(path, [f"{prefix}{n}" for n in names])
            raise ConfigError(
                f"{path}={value}: not in the schema; {hint}allowed: {', '.join(names)}"
            )
        child = OmegaConf.get_type(node, str(key)) if key == "optim" else hints[key]
        if dataclasses.is_dataclass(child) and isinstance(node[key], DictConfig):
            _schema_keys(node[key], child, f"{path}.")


def other_option_key(key: str, composed: type) -> str | None:
    """`a key of optim=<option>; ...` when `key` is a field of another optimizer option's
    schema than the `composed` one (its keys listed), else None."""
    names = [f.name for f in dataclasses.fields(composed)]
    options = [
        name
        for name, cls in OPTIM_SCHEMAS.items()
        if key in {f.name for f in dataclasses.fields(cls)}
    ]
    current = next((name for name, cls in OPTIM_SCHEMAS.items() if cls is composed), None)
    if not options or current is None:
        return None
    return (
        f"a key of {' and '.join(f'optim={o}' for o in options)}; this command composes "
        f"optim={current}, whose keys are: {', '.join(names)}"
    )


def _finite(node: Any, prefix: str = "") -> None:
    """Every float of the config is a finite number (NaN passes every range check)."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for key, value in items:
        path = f"{prefix}.{key}" if isinstance(node, DictConfig) else f"{prefix}[{key}]"
        path = path.lstrip(".")
        if isinstance(value, DictConfig | ListConfig):
            _finite(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise _fail(path, value, "must be a finite number")
