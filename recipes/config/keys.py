"""Unknown keys, with or without Hydra's `+`, fail before any rank starts, naming the nearest
real key.

Hydra rejects `train.step=5` (a typo) at compose time with a hint to append it,
`+train.step=5`, which it then accepts into the config. `check_command_line` reads train.py's
overrides before Hydra composes anything, so both spellings end in one `ConfigError` naming the
key and its closest real one (`nearest_key`, difflib); `validate` refuses what `+` appended to
a composed config (a sweep job's, say) with the same hint.
"""

import dataclasses
import difflib
from pathlib import Path

from recipes.config.schema import OPTIM_SCHEMAS, Config, ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"


def _leaves(node: type, prefix: str, out: dict[str, bool]) -> dict[str, bool]:
    """Every key of a schema dataclass: True for a mapping field that takes any sub-key
    (`model.overrides.<GLMConfig field>`, checked by `validate`), False for the rest."""
    for f in dataclasses.fields(node):
        factory = f.default_factory
        if dataclasses.is_dataclass(factory):
            out[f"{prefix}{f.name}"] = False
            _leaves(factory, f"{prefix}{f.name}.", out)
        else:
            out[f"{prefix}{f.name}"] = factory is dict
    return out


def known_keys() -> dict[str, bool]:
    """The keys of the config and of every optimizer's schema (`optim.*` differ per option)."""
    out = _leaves(Config, "", {})
    for schema in OPTIM_SCHEMAS.values():
        _leaves(schema, "optim.", out)
    return out


def config_groups() -> list[str]:
    """The config groups of conf/ (`model`, `optim`, ..., `hydra/launcher`)."""
    return sorted(
        p.relative_to(CONF).as_posix() for p in CONF.rglob("*") if p.is_dir() and p.name[0] != "."
    )


def nearest_key(key: str, known: list[str]) -> str:
    """`did you mean <the closest of known>? ` (difflib), or "" when none is close."""
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"did you mean {near[0]}? " if near else ""


def unknown_key(key: str, known: list[str]) -> ConfigError:
    """The error for `key`: it names the key and the closest real one."""
    hint = nearest_key(key, known)
    return ConfigError(
        f"{key}: unknown key, with or without '+'; {hint}(`python train.py --help` lists every key)"
    )


def _is_known(key: str, keys: dict[str, bool]) -> bool:
    if key in keys:
        return True
    parent = key.rpartition(".")[0]
    while parent:
        if keys.get(parent):  # a mapping field: any sub-key, checked by validate
            return True
        parent = parent.rpartition(".")[0]
    return False


def check_command_line(args: list[str]) -> None:
    """Raise ConfigError for the first override in train.py's `args` whose key is in no
    schema (hydra.* keys, group choices and Hydra's flags pass)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    words = [a for a in args if "=" in a and not a.startswith("-")]
    if not words:
        return
    keys, groups = known_keys(), config_groups()
    for override in OverridesParser.create().parse_overrides(words):
        key = override.key_or_group
        if key.split(".")[0] in ("hydra", "") or key in groups or "@" in key or "/" in key:
            continue
        if not _is_known(key, keys):
            raise unknown_key(key, [*keys, *groups])
