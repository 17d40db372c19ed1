"""Type checks by annotation: a GLMConfig's fields (models/glm/model/config.py) and config.json's
keys (models/glm/hf/json_types.py) against annotations written as the fields are ("int | None",
"list[str] | None", ...)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# An annotation's type -> (does a value fit it, what to say it must be). Numbers from Hydra or
# JSON may be ints where a float belongs; a bool is never a number here, nor a string a bool.
_TYPE_CHECKS = {
    "int": (_is_int, "an integer"),
    "float": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false (a bool)"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "list[str]": (
        lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v),
        "a list of strings",
    ),
    "list[int]": (lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "a list of ints"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "a mapping"),
}


def fits_annotation(value: Any, annotation: str) -> bool:
    """Whether `value` has a type `annotation` ("int | list[int] | None", ...) allows."""
    kinds = [k.strip() for k in annotation.split("|")]
    if value is None:
        return "None" in kinds
    return any(_TYPE_CHECKS[k][0](value) for k in kinds if k != "None")


def describe_annotation(annotation: str, none: str = "None") -> str:
    """`annotation` in words ("an integer or None"; `none`: how to call None)."""
    kinds = [k.strip() for k in annotation.split("|")]
    words = [_TYPE_CHECKS[k][1] for k in kinds if k != "None"]
    return " or ".join(words + ([none] if "None" in kinds else []))


def check_field_types(config: Any) -> None:
    """Every field of the dataclass `config` (a GLMConfig) against its annotation (`int |
    None`: an int or None, ...), naming it."""
    for f in fields(config):
        value = getattr(config, f.name)
        if not fits_annotation(value, str(f.type)):
            raise ValueError(
                f"GLMConfig.{f.name} must be {describe_annotation(str(f.type))}, got "
                f"{value!r} ({type(value).__name__})"
            )
