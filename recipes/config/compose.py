"""train.py's command checked before torch loads: composed as Hydra's run will compose it,
every Hydra-level error turned into one `ConfigError` line naming the key and what it takes.

`preflight(args)` runs `keys.check_command_line`, composes conf/ with the command's
overrides (Hydra's compose API, the run mode `-m` asks for) and, for a run that trains,
`checks.validate_config`. None of it imports torch, numpy or models/, so a bad override's
error comes before the ranks' fork server starts. Hydra's own messages (`Could not override
...` with a `+` hint that may lead nowhere, `Error merging override ...` with OmegaConf's
multi-line detail) become `hydra_error`'s one line: a value of the wrong type names the key's
type; a key missing from the composed config names the config group option that has it
(`optim=adamw optim.remainder_strategy=agrs`: a key of optim=muon) or, under a mapping
of keys (`model.overrides`), the `+` that adds one.
"""

import dataclasses
import typing
from enum import Enum
from typing import Any

from omegaconf import DictConfig, open_dict
from omegaconf.errors import OmegaConfBaseException

from recipes.config.checks import other_option_key, validate_config
from recipes.config.describe import key_help
from recipes.config.keys import CONF, check_command_line, unknown_key
from recipes.config.schema import OPTIM_SCHEMAS, Config, ConfigError

GRAMMAR_URL = "https://hydra.cc/docs/advanced/override_grammar/basic/"
#: Hydra flags that pick another config tree or rerun a pickled job: Hydra checks those
_OTHER_TREE = ("config_path", "config_dir", "config_name", "experimental_rerun")


def preflight(args: list[str]) -> None:
    """Raise ConfigError for the first problem of train.py's `args` found without torch: an
    unknown key, a Hydra composition error, and (a run that trains, not `--help`, `--cfg`,
    `--info` or `-m`, whose jobs recipes.sweep checks) `checks.validate_config`."""
    from hydra._internal.utils import get_args_parser
    from hydra.errors import OverrideParseException

    parsed = get_args_parser().parse_args(args)
    if parsed.shell_completion or any(getattr(parsed, name) for name in _OTHER_TREE):
        return
    try:
        check_command_line(args)
    except OverrideParseException as err:
        raise hydra_error(err, parsed.overrides) from None
    cfg = compose(parsed.overrides, multirun=parsed.multirun)
    if parsed.multirun or parsed.help or parsed.hydra_help or parsed.cfg or parsed.info:
        return
    overrides = list(cfg.hydra.overrides.task)
    with open_dict(cfg):
        del cfg["hydra"]  # the task function's view of the config
    validate_config(cfg, overrides=overrides)


def compose(overrides: list[str], *, multirun: bool = False) -> DictConfig:
    """conf/train.yaml with `overrides`, the hydra node included, as train.py's Hydra run
    composes it; Hydra's and OmegaConf's errors raised as `hydra_error`'s ConfigError."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode

    try:
        with initialize_config_dir(config_dir=str(CONF), version_base=None, job_name="train"):
            return GlobalHydra.instance().hydra.compose_config(
                "train",
                overrides,
                run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN,
                from_shell=True,
                with_log_configuration=False,
            )
    except (HydraException, OmegaConfBaseException) as err:
        raise hydra_error(err, overrides) from None


def hydra_error(err: Exception, overrides: list[str]) -> ConfigError:
    """One line for a Hydra or OmegaConf error raised while composing `overrides`."""
    from hydra.errors import MissingConfigException, OverrideParseException

    cause = err.__cause__
    text = str(err)
    if isinstance(err, OverrideParseException):
        detail = err.message.splitlines()[0]
        return ConfigError(f"{err.override}: not an override Hydra reads ({detail}); {GRAMMAR_URL}")
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return ConfigError(
            f"{group}={option}: no such option of the config group {group}; "
            f"allowed: {', '.join(sorted(err.options))}"
        )
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        key = str(cause.full_key)
        line = _line_of(key, overrides)
        if text.startswith("Could not override"):
            return _missing_key(key, line, cause.object_type_str)
        if text.startswith("Error merging override"):
            value = line.partition("=")[2] if line else cause.value
            expected = _expected(key, cause.object_type_str)
            if expected:
                return ConfigError(f"{key}={value}: expected {expected} ({key}: {key_help(key)})")
    if text.startswith("Ambiguous value for argument"):
        line = text.split("'")[1]
        key = line.partition("=")[0]
        return ConfigError(
            f"{line}: a comma separates the values of a sweep, which needs -m (--multirun); "
            f"a list is written in brackets, {key}=[...]; a string with a comma is quoted"
        )
    if text.startswith("Could not append to config"):
        key = text.split("'")[1]
        return ConfigError(
            f"+{key}: {key} is in the config already: set it without '+' ({key}=...)"
        )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if isinstance(cause, OmegaConfBaseException):
        lines.append(str(cause.msg).splitlines()[0])
    return ConfigError("; ".join(lines))


def _line_of(key: str, overrides: list[str]) -> str | None:
    """The command-line override that sets `key` (the last one: Hydra's winner), `+` dropped."""
    found = [o.lstrip("+~") for o in overrides if o.lstrip("+~").partition("=")[0] == key]
    return found[-1] if found else None


def _missing_key(key: str, line: str | None, object_type: str | None) -> ConfigError:
    """A key Hydra could not set: absent from this config, though the schema may know it."""
    parent, _, leaf = key.rpartition(".")
    shown = line or key
    composed = next((c for c in OPTIM_SCHEMAS.values() if c.__name__ == object_type), None)
    if parent == "optim" and composed and (elsewhere := other_option_key(leaf, composed)):
        return ConfigError(f"{shown}: {elsewhere}")
    field_type = _field_type(parent, object_type) if parent else None
    if typing.get_origin(field_type) is dict or field_type is dict:
        return ConfigError(
            f"{shown}: a key is added to the mapping {parent} with '+': +{shown} "
            f"({parent}: {key_help(parent)})"
        )
    return unknown_key(key, [])


def _field_type(key: str, object_type: str | None) -> Any:
    """The schema type of `key` (`optim.*`: the option's schema named by `object_type`, the
    class OmegaConf reports), or None when the schema has no such key."""
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        hint = hints[part]
        if i == 0 and part == "optim":
            hint = next(
                (c for c in OPTIM_SCHEMAS.values() if c.__name__ == object_type),
                OPTIM_SCHEMAS["muon"],
            )
        if i == len(parts) - 1:
            return hint
        if not dataclasses.is_dataclass(hint):
            return None
        cls = hint
    return None


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
_ELEMENTS = {bool: "booleans", int: "integers", float: "numbers", str: "strings"}


def _expected(key: str, object_type: str | None) -> str | None:
    """What `key` takes, as the command line spells it: `an integer`, `one of [a, b]`, ..."""
    hint = _field_type(key, object_type)
    if hint is None:
        return None
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and issubclass(hint, Enum):
        text = f"one of [{', '.join(str(m.value) for m in hint)}]"
    elif hint in _SCALARS:
        text = _SCALARS[hint]
    elif origin is list:
        (element,) = typing.get_args(hint)
        text = f"a list of {_ELEMENTS.get(element, 'values')} in brackets ([a,b,...])"
    elif origin is dict or hint is dict:
        text = f"a mapping: its keys are set one by one, +{key}.<name>=value"
    elif dataclasses.is_dataclass(hint):
        text = f"its keys set one by one ({key}.<name>=value), not a value"
    else:
        return None
    return f"{text}, or null" if optional else text
