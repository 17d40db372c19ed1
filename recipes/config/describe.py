"""The schema read back as text: `describe()` lists every key with its default and help,
`key_help(key)` is the help of one key (the message of a `ConfigError` ends in it).
"""

import dataclasses
from enum import Enum
from typing import Any

from recipes.config.schema import OPTIM_SCHEMAS, Config


def describe(node: type = None, prefix: str = "") -> list[str]:
    """One line per leaf key: `key = default  # help`, for `python train.py --help`-like use."""
    lines = []
    for f in dataclasses.fields(node or Config):
        if node is None and f.name == "optim":  # each option has its own keys
            lines += _describe_optim()
            continue
        if dataclasses.is_dataclass(f.default_factory):
            lines += describe(f.default_factory, f"{prefix}{f.name}.")
            continue
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value = value.value if isinstance(value, Enum) else value
        lines.append(f"{prefix}{f.name} = {value!r}  # {f.metadata['help']}")
    return lines


def _describe_optim() -> list[str]:
    """`optim.*` once per key: the first option's default, the others' where they differ."""
    defaults: dict[str, dict[str, Any]] = {}
    helps: dict[str, str] = {}
    for name, schema in OPTIM_SCHEMAS.items():
        for f in dataclasses.fields(schema):
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            defaults.setdefault(f.name, {})[name] = (
                value.value if isinstance(value, Enum) else value
            )
            helps.setdefault(f.name, f.metadata["help"])
    lines = []
    for key, by_option in defaults.items():
        (first, value), *others = by_option.items()
        notes = [f"optim={n}: {v!r}" for n, v in others if key != "name" and v != value]
        if len(by_option) < len(OPTIM_SCHEMAS):
            notes.append(f"optim={first} only")
        note = f" [{'; '.join(notes)}]" if notes else ""
        lines.append(f"optim.{key} = {value!r}  # {helps[key]}{note}")
    return lines


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
