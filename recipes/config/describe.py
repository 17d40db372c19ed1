"""The schema read back as text, one renderer: `schema_lines(node)` lists every leaf key of a
composed (structured) config as `key = value  [allowed]  # help` (`python train.py --help`
shows the config its overrides compose, `recipes.config.help`); `describe()` is that listing
for the defaults (`optim=muon`); `key_help(key)` is the help of one key, which the message of
`config_error(key, value, rule)`, every check's `ConfigError`, ends in.
"""

import dataclasses
import typing
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes.config.schema import Config, ConfigError


def allowed_values(annotation: Any) -> str:
    """The allowed values of a field type, as the command line spells them ("" when open)."""
    options: list[str] = []
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, Enum):
            options += [str(member.value) for member in arg]
        elif arg is bool:
            options += ["true", "false"]
        elif arg is type(None):
            options.append("null")
    return ", ".join(options) if any(o != "null" for o in options) else ""


def _show(value: Any) -> str:
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def schema_lines(node: DictConfig, prefix: str = "") -> list[str]:
    """One line per leaf key of a structured config node: `key = value  [allowed]  # help`."""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return []
    lines = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        value = node._get_node(f.name)
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(value)):
            lines += schema_lines(value, f"{key}.")
            continue
        allowed = allowed_values(f.type)
        allowed = f"  [{allowed}]" if allowed else ""
        lines.append(f"{key} = {_show(node[f.name])}{allowed}  # {f.metadata.get('help', '')}")
    return lines


def describe() -> list[str]:
    """`schema_lines` of the default config: one line per leaf key."""
    return schema_lines(OmegaConf.structured(Config))


def key_help(key: str) -> str:
    """The help of `key`, or of its nearest schema ancestor (a list element, an override)."""
    node: Any = Config
    help_text = ""
    for part in key.split("[")[0].split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if node else {}
        if part not in fields:
            return help_text
        help_text = fields[part].metadata["help"]
        node = fields[part].default_factory
        node = node if dataclasses.is_dataclass(node) else None
    return help_text


def config_error(key: str, value: Any, rule: str) -> ConfigError:
    """The error of `key=value` breaking `rule`, ending in the key's help."""
    return ConfigError(f"{key}={value}: {rule} ({key}: {key_help(key)})")
