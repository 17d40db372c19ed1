"""Properties of `train.py`'s config on generated overrides, run in-process through the path
train.py takes before any rank starts (Hydra's compose of conf/, then `recipes.config.validate`;
no rank is spawned).

The overrides are drawn from the schema's own keys and types (`recipes.config.schema`, walked
here, so a key added there is drawn too): values of the key's type, in and out of range, NaN and
inf for floats, values of every other type, null, unknown keys (with and without `+`), and
`model.overrides.<GLMConfig field>`. Property: either composing refuses (Hydra) naming the key,
or `validate` (given the command's overrides, as train.py gives them) refuses with a
ConfigError naming a key the command set, or the config composes
with each override's value in place and what the ranks receive (`from_yaml` of the resolved
YAML) is the same config and validates again.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hypothesis import example, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from models.glm import GLMConfig
from recipes import config as schema

CONF = Path(__file__).resolve().parents[2] / "conf"

#: file-system keys (their values name files this test does not make) and keys that pick
#: another config group's meaning (`model.preset=hf` needs a transformers directory)
LEFT_OUT = {"data.path", "model.path", "checkpoint.init_from", "data.cache_dir", "run.root"}


def _leaves(cls, prefix: str = "") -> dict[str, object]:
    """Dotted key -> annotated type of every leaf field of a schema dataclass."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            out |= _leaves(hint, key + ".")
        elif key not in LEFT_OUT and key != "model.overrides":
            out[key] = hint
    return out


def _base_keys() -> dict[str, object]:
    return {k: v for k, v in _leaves(schema.ConfigSchema).items() if not k.startswith("optim.")}


KEYS = {name: _base_keys() | _leaves(cls, "optim.") for name, cls in schema.OPTIM_SCHEMAS.items()}
GLM_INTS = sorted(
    f.name for f in dataclasses.fields(GLMConfig) if typing.get_type_hints(GLMConfig)[f.name] is int
)


def _core(hint) -> tuple[object, bool]:
    """(the type without None, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return hint, False


FLOATS = st.one_of(
    st.floats(-2.0, 2.0),
    st.sampled_from([0.0, -1.0, 1.0, 1e-9, 1e308, math.nan, math.inf, -math.inf]),
)
INTS = st.one_of(st.integers(-2, 12), st.sampled_from([0, 10**6, 2**40]))
WRONG = st.sampled_from(["oops", "1.5", "[1,2]", "{a: 1}", "true", "3"])


def _render(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def _values(hint) -> st.SearchStrategy[str]:
    """Rendered override values for a key of type `hint`: its own type's (in and out of range)
    and every other type's."""
    inner, nullable = _core(hint)
    own: list[st.SearchStrategy] = [WRONG]
    if nullable:
        own.append(st.just("null"))
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        own.append(st.sampled_from([m.value for m in inner] + ["nope"]))
    elif inner is bool:
        own.append(st.sampled_from(["true", "false", "2", "maybe"]))
    elif inner is int:
        own += [INTS.map(_render), FLOATS.map(_render)]
    elif inner is float:
        own += [FLOATS.map(_render), INTS.map(_render)]
    elif inner is str:
        own.append(st.text("abcxyz_", min_size=1, max_size=6))
    elif typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        element = FLOATS if item is float else st.text("abc", min_size=1, max_size=3)
        own.append(
            st.lists(element, max_size=3).map(lambda xs: "[" + ",".join(map(_render, xs)) + "]")
        )
    return st.one_of(own)


@st.composite
def overrides(draw) -> tuple[str, list[tuple[str, str]]]:
    """(optim option, [(key, rendered value)]) with distinct keys, unknown ones included."""
    optim = draw(st.sampled_from(sorted(KEYS)))
    keys = draw(st.lists(st.sampled_from(sorted(KEYS[optim])), max_size=4, unique=True))
    pairs = [(k, draw(_values(KEYS[optim][k]))) for k in keys]
    if draw(st.booleans()):
        field = draw(st.sampled_from(GLM_INTS))
        pairs.append((f"+model.overrides.{field}", _render(draw(INTS))))
    if draw(st.integers(0, 4)) == 0:  # an unknown key, at the top or under a group
        group = draw(st.sampled_from(["", "optim.", "train.", "model.", "mesh."]))
        plus = draw(st.sampled_from(["", "+"]))
        pairs.append((f"{plus}{group}no_such_key", "1"))
    return optim, pairs


def _args(optim: str, pairs: list[tuple[str, str]]) -> list[str]:
    return [f"optim={optim}", *(f"{k}={v}" for k, v in pairs)]


def compose_config(optim: str, pairs: list[tuple[str, str]]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=_args(optim, pairs))


def _key(k: str) -> str:
    return k.lstrip("+")


def _same(got, rendered: str) -> bool:
    """The composed value is the override's (Hydra's grammar parses `rendered`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    want = OverridesParser.create().parse_override(f"k={rendered}").value()
    got = got.value if isinstance(got, enum.Enum) else got
    if isinstance(want, list) or hasattr(want, "__iter__") and not isinstance(want, str):
        return list(got) == list(want)
    if isinstance(got, bool) or isinstance(want, bool):
        return got == want or str(got).lower() == str(want).lower()
    if isinstance(got, float) and isinstance(want, (int, float)):
        return got == float(want)
    return got == want or str(got) == str(want)


@settings(max_examples=max(5, settings.default.max_examples // 3))  # compose: ~0.2 s each
@given(overrides())
@example(("muon", [("+train.no_such_key", "1")]))  # composed, then stopped every rank
@example(("adamw", [("checkpoint.async_mode", "2"), ("checkpoint.every", "0")]))  # ran as true
@example(("muon", [("optim.qk_clip_tau", "0.0")]))
@example(("muon", [("model.preset", "hf")]))  # names model.path, the key it needs, and this one
@example(("muon", [("optim.qk_clip_tau", "nan")]))
@example(("adamw", [("optim.qk_clip_alpha", "1.5")]))
@example(("muon", [("optim.betas", "[0.9]")]))
@example(("adamw", [("logger.group", "null"), ("optim.betas", "[nan]")]))  # optim.betas[0]=nan
@example(("muon", [("+model.overrides.num_attention_heads", "3")]))
def test_overrides_refuse_by_name_or_compose_to_what_every_rank_accepts(case):
    optim, pairs = case
    named = [_key(k) for k, _ in pairs]
    try:
        cfg = compose_config(optim, pairs)
    except ConfigCompositionException as err:
        text = f"{err} {err.__cause__}"
        assert any(k in text or k.rsplit(".", 1)[-1] in text for k in named), (pairs, text)
        return
    try:
        schema.validate(cfg, check_devices=False, overrides=_args(optim, pairs))
    except schema.ConfigError as err:
        # `key=value` (or `key[i]=value`) of a key the command set, anywhere in the message
        said = [k for k in named if re.search(rf"(?<![\w.]){re.escape(k)}[=\[]", str(err))]
        assert said, (pairs, str(err))
        return
    for k, v in pairs:  # no override dropped or bent
        assert _same(OmegaConf.select(cfg, _key(k)), v), (k, v, OmegaConf.select(cfg, _key(k)))
    plain = schema.to_plain(cfg)
    again = schema.from_yaml(OmegaConf.to_yaml(cfg, resolve=True))
    assert schema.to_plain(again) == plain
    schema.validate(again, check_devices=False)
