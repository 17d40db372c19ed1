"""`python train.py --help`: every key of the composed config with its value, allowed values
and one-line help, read from the typed schema (recipes/config/schema.py).

conf/train.yaml's Hydra help template calls the `schema_help` resolver, so the listing shows
the config the given overrides compose (`python train.py optim=adamw --help` shows AdamW's
values), not the dataclass defaults alone.
"""

import dataclasses
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


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


def schema_help(*, _root_: DictConfig) -> str:
    """The OmegaConf resolver behind the help template: the composed config's keys."""
    # string.Template (Hydra's help rendering) treats "$" as a placeholder
    return "\n".join(schema_lines(_root_)).replace("$", "$$")


#: the config tree train.py composes
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def config_groups() -> str:
    """The resolver listing the user's config groups, `group: option, ...` (conf/<group>/*.yaml;
    Hydra's own list would also show the optimizer schemas that conf/optim/*.yaml extend)."""
    groups = sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    return "\n".join(
        f"{g.name}: {', '.join(sorted(f.stem for f in g.glob('*.yaml')))}" for g in groups
    )
