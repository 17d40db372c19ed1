"""The run directory's name: which keys it leaves out, and its leaf for a set of overrides.

conf/train.yaml's `hydra.job.config.override_dirname.exclude_keys` resolves to `same_run_keys()`
and its run directory ends in `run_id(override_dirname, overrides, exclude_keys)` (path values
shortened), both resolvers registered by `store.register`.
"""

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

from recipes.config.schema import OPTIM_SCHEMAS, Config

#: config groups whose choice never changes what is trained (an experiment names its own run.name)
SAME_RUN_GROUPS = ("experiment", "logger", "checkpoint")


def same_run_keys() -> list[str]:
    """The keys (and groups) left out of the run directory's name: `SAME_RUN_GROUPS` and every
    field declared `same_run` (conf/train.yaml's `exclude_keys` resolves to this list)."""
    keys = list(SAME_RUN_GROUPS)

    def walk(node: type, prefix: str) -> None:
        for f in dataclasses.fields(node):
            if dataclasses.is_dataclass(f.default_factory):
                walk(f.default_factory, f"{prefix}{f.name}.")
            elif f.metadata["same_run"] and f"{prefix}{f.name}" not in keys:
                keys.append(f"{prefix}{f.name}")

    walk(Config, "")
    for schema in OPTIM_SCHEMAS.values():
        walk(schema, "optim.")
    return keys


RUN_ID_MAX = 200  # bytes of a run-dir leaf (file systems allow 255 per name)
#: conf/train.yaml's override_dirname separators: `key-value` items joined by `+`, so a run
#: directory's path can be passed back as an override value unquoted (Hydra's grammar reserves
#: `=` and `,`, which Hydra's own defaults would put in the name)
KV_SEP, ITEM_SEP = "-", "+"
_SAFE = re.compile(r"[^A-Za-z0-9._+@%-]")
#: a path value in a run's name: its last two components, at most this many characters (the
#: end kept), then `@` and the first PATH_HASH hex digits of the path's sha1
PATH_TAIL_MAX, PATH_HASH = 24, 8


def run_id(
    override_dirname: str,
    overrides: Sequence[str] | None = None,
    exclude_keys: Sequence[str] = (),
) -> str:
    """The run-dir leaf for a set of overrides: stable for the same command, never empty, and
    only letters, digits and `._+@%-`: quotes are dropped, `/` and every other character
    (brackets, `=`, `,`, spaces) become `_`; e.g. the overrides `model=mla_tiny train.steps=20`
    give `model-mla_tiny+train.steps-20`.
    Given the command's `overrides` (conf/train.yaml passes `hydra.overrides.task` and the
    `exclude_keys`), a value holding a `/` (a path) shows as `path_tail`: the export command
    `model=hf model.path=outputs/default/base/hf checkpoint.init_from=outputs/default/base/hf`
    gives `checkpoint.init_from-base_hf@<hash>+model.path-@<hash>+model-hf`.
    A leaf still longer than RUN_ID_MAX keeps its start and ends in a hash of the whole, so
    the same command still finds its run directory."""
    import hashlib

    if overrides is not None:
        override_dirname = _short_paths(override_dirname, overrides, exclude_keys)
    leaf = _SAFE.sub("_", override_dirname.replace("'", "").replace('"', "")) or "base"
    if len(leaf.encode()) <= RUN_ID_MAX:
        return leaf
    digest = hashlib.sha1(override_dirname.encode()).hexdigest()[:16]
    return leaf[: RUN_ID_MAX - 17] + "-" + digest


def path_tail(path: str, shown: bool = False) -> str:
    """`path` in a run's name: its last two components joined by `_` (`.`/`..` dropped), cut
    to the last PATH_TAIL_MAX characters (from a `+` on, when the cut holds one: a run
    directory's whole items), then `@` and a hash of the whole path, so two paths with one
    tail still differ; `shown`: the tail was shown already, only `@<hash>`."""
    import hashlib

    digest = hashlib.sha1(path.encode()).hexdigest()[:PATH_HASH]
    tail = "_".join([p for p in path.split("/") if p not in ("", ".", "..")][-2:])
    if len(tail) > PATH_TAIL_MAX:  # cut at the first whole `+` item of the end that fits
        tail = tail[-PATH_TAIL_MAX:]
        tail = tail.partition("+")[2] or tail
    tail = "" if shown else tail.lstrip("_+-.")
    return f"{tail}@{digest}"


def _short_paths(dirname: str, overrides: Sequence[str], exclude_keys: Sequence[str]) -> str:
    """Hydra's override_dirname of `overrides` (conf/train.yaml's separators) with each path
    value as `path_tail`; `dirname` itself when no value holds a `/` (names of runs without
    paths stay as Hydra writes them)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed, excluded = OverridesParser.create().parse_overrides(list(overrides)), set(exclude_keys)
    kept = sorted((o for o in parsed if o.key_or_group not in excluded), key=lambda o: o.input_line)
    lines, seen = [], set()
    for override in kept:
        value = None if override.is_sweep_override() else override.value()
        line = override.input_line
        if isinstance(value, str) and "/" in value:
            line = line[: line.index("=") + 1] + path_tail(value, shown=value in seen)
            seen.add(value)
        lines.append(line)
    if not seen:
        return dirname
    return ITEM_SEP.join(lines).replace("=", KV_SEP)


def override_value(value: str) -> str:
    """`value` as a Hydra override value: as is when Hydra's grammar reads it back unchanged,
    else single-quoted (backslashes and quotes escaped)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        if OverridesParser.create().parse_override(f"k={value}").value() == value:
            return value
    except Exception:  # noqa: BLE001 - any parse error: quote it
        pass
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def reuse_export_command(hf_dir: Path) -> str:
    """The train.py overrides that start a run from an exported transformers directory:
    `model=hf model.path=DIR checkpoint.init_from=DIR`, DIR relative to the working directory
    when inside it, each word quoted for the shell where it needs it."""
    import shlex

    path = Path(hf_dir).resolve()
    try:
        shown = str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    value = override_value(shown)
    words = ["model=hf", f"model.path={value}", f"checkpoint.init_from={value}"]
    return " ".join(shlex.quote(w) for w in words)
