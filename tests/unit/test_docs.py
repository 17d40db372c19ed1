"""The docs stay true: what README.md and docs/*.md state about the config, the files, the
scripts, the defaults and the import rules is checked against the code.

- every `key=value` they write composes against the schema (Hydra's own `hydra.*` keys and
  placeholders such as `<dir>` are checked for the key only), but those they show refused
  (`REFUSED`), which train.py's checks before torch must refuse;
- every repository path they name exists, wherever they name it (code spans, tables, prose; a
  path a doc says has moved, "`old` is `new` now", by its new name), every markdown link
  resolves;
- every script under scripts/ is named in README.md and answers --help
  (tests/e2e/test_docs_scripts.py: a subprocess);
- every default they state (`key` (value), `option` (default) in a group table, "(default N)",
  the keyword defaults of a `Muon(...)` / `param_groups(...)` call) equals the code's;
- docs/design.md's layout names every muon/ module, its import rules are the imports found and
  its line budgets ("under 150 lines" for scripts, "under 450 lines" for files) hold, but for
  what tests/unit/test_sizes.py lists as still reshaped.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import sys
from functools import cache
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipes import config as schema
from tests.unit.test_sizes import STILL_RESHAPED, covers

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = {f.name for f in dataclasses.fields(schema.Config)}
GROUPS = {p.name for p in (ROOT / "conf").iterdir() if p.is_dir()} - {"hydra"}
#: an override in a code span or a command line: [+~]key=value, key dotted or a group name
OVERRIDE = re.compile(r"(?<![\w.$/-])([+~]?)([a-z_]+(?:\.[a-z_0-9<>]+)*)=([^\s`|)]*)")
#: overrides the docs show being refused (training.md, errors before torch loads)
REFUSED = {"data.batch_size=0.5", "model=nope", "model.overrides.num_hidden_layers=2"}
#: a repository path anywhere in a doc (code span, table, prose): a file with its extension
#: or a folder with its slash, not inside a longer path or URL (`github.com/x/models/...`) nor
#: a metric's name (`muon/<path>/bytes_sent`, `muon/remainder/*`)
PATH = re.compile(
    r"(?<![\w./~$-])((?:scripts|docs|conf|recipes|muon|models|tests)/"
    r"(?:[\w./<>*-]*\.\w+|[\w./<>*-]*/)|train\.py)(?![\w/*<])"
)
#: a path a doc says has moved: "its `old` is `new` now" (old need not exist; new must)
MOVED = re.compile(r"`([\w./-]+)` is `([\w./-]+)` now")


def doc_text(path: Path) -> str:
    return path.read_text()


def _code_spans(text: str) -> list[str]:
    """Inline code spans and fenced blocks, where the docs write commands and keys."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return blocks + inline


def _overrides() -> list[tuple[str, str, str, str]]:
    """(doc, prefix, key, value) of every override the docs write."""
    found = []
    for doc in DOCS:
        for span in _code_spans(doc_text(doc)):
            if "=" not in span or span.lstrip().startswith(("from ", "import ")):
                continue
            for prefix, key, value in OVERRIDE.findall(span):
                value = value.rstrip("\\:,;")  # a table's escaped `\|`, a line's end
                top = key.split(".")[0]
                ours = (top in SECTIONS and "." in key) or (top in GROUPS and "." not in key)
                if ours or top == "hydra":
                    found.append((doc.name, prefix, key, value))
    return sorted(set(found))


@cache
def _composed(overrides: tuple[str, ...]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=True)


def _placeholder(value: str) -> bool:
    return value in ("", "...") or "<" in value or value.startswith(("$", "{"))


@pytest.mark.parametrize("doc, prefix, key, value", _overrides(), ids=lambda x: str(x))
def test_every_override_in_the_docs_composes(doc, prefix, key, value):
    if key.split(".")[0] == "hydra":  # a Hydra option: the key must exist in Hydra's config
        launcher = ("hydra/launcher=slurm",) if key.startswith("hydra.launcher.") else ()
        node = OmegaConf.select(_composed(launcher), key, default="__missing__")
        assert node != "__missing__" or prefix == "+", f"{doc}: {key} is not a Hydra option"
        return
    optim = (
        ("optim=adamw",)
        if key.startswith("optim.")
        and key.split(".")[1]
        in {f.name for f in dataclasses.fields(schema.AdamWOptimConfig)}
        - {f.name for f in dataclasses.fields(schema.MuonOptimConfig)}
        else ()
    )
    if f"{prefix}{key}={value}" in REFUSED:
        from recipes.config.compose import preflight

        with pytest.raises(schema.ConfigError, match=re.escape(f"{prefix}{key}={value}: ")):
            preflight([f"{prefix}{key}={value}"])
        return
    if "<" in key:  # `+model.overrides.<GLMConfig field>=...`: the part before the placeholder
        parent = key.split(".<")[0]
        assert OmegaConf.select(_composed(()), parent.lstrip("+"), default=None) is not None
        return
    if _placeholder(value):
        cfg = _composed(optim)
        found = key in GROUPS or OmegaConf.select(cfg, key, default="__missing__") != "__missing__"
        assert found or prefix == "+", f"{doc}: {key} is not a key of the schema"
        return
    for one in value.split(",") if "[" not in value else [value]:  # a sweep: every value
        _composed((*optim, f"{prefix}{key}={one}"))  # raises naming the key and allowed values


def test_every_path_in_the_docs_exists():
    missing = []
    for doc in DOCS:
        text = doc_text(doc)
        moved = dict(MOVED.findall(text))
        for name in PATH.findall(text):
            name = name.rstrip(".,:")
            if name in moved:
                name = moved[name]  # the doc names the new place: that one must exist
            if "<" in name or "*" in name:
                pattern = re.sub(r"<[^>]*>", "*", name)
                if not list(ROOT.glob(pattern)):
                    missing.append(f"{doc.name}: {name}")
            elif not (ROOT / name).exists():
                missing.append(f"{doc.name}: {name}")
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not link.startswith(("http://", "https://")) and not (doc.parent / link).exists():
                missing.append(f"{doc.name}: link {link}")
    assert not missing, missing


def _default(key: str):
    value = OmegaConf.select(_composed(()), key)
    return value.value if hasattr(value, "value") else value


def _same(stated: str, actual) -> bool:
    stated = stated.strip("`'\" ")
    if isinstance(actual, bool) or actual is None:
        return stated == {True: "true", False: "false", None: "null"}[actual]
    if isinstance(actual, int | float):
        try:
            return float(stated) == float(actual)
        except ValueError:
            return False
    return stated == str(actual)


def _glm_config_defaults() -> dict:
    from models.glm.model.config import GLMConfig

    return {
        f.name: f.default
        for f in dataclasses.fields(GLMConfig)
        if f.default is not dataclasses.MISSING
    }


def test_every_stated_default_equals_the_code():
    wrong = []
    defaults_list = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "train.yaml").defaults)
    group_defaults = {k: v for d in defaults_list if isinstance(d, dict) for k, v in d.items()}
    for doc in DOCS:
        text = doc_text(doc)
        # `key` (value...: a schema key followed by its value in parentheses
        for key, stated in re.findall(r"`([a-z_]+\.[a-z_.]+)` \((`[^`]+`|[-\d.e]+)[:),]", text):
            if key.split(".")[0] in SECTIONS and not _same(stated, _default(key)):
                wrong.append(f"{doc.name}: {key} ({stated}); the schema: {_default(key)}")
        # a group table row: | `group=` | `option` (default), ...
        for group, options in re.findall(r"^\| `(\w+)=` \| ([^|]+)\|", text, re.M):
            stated = re.findall(r"`(\w+)` \(default", options)
            if stated and stated != [group_defaults.get(group)]:
                wrong.append(
                    f"{doc.name}: {group}= default {stated}; conf/train.yaml: "
                    f"{group_defaults.get(group)}"
                )
        # `name` (default N): a Muon argument or a GLMConfig field
        for name, stated in re.findall(r"`(\w+)` \(default ([\w.]+)\)", text):
            actual = {**_glm_config_defaults(), **_muon_defaults()}.get(name, "__unknown__")
            if actual == "__unknown__" or not _same(stated, actual):
                wrong.append(f"{doc.name}: {name} (default {stated}); Muon: {actual}")
        for call, args in re.findall(r"\b(Muon|param_groups)\((.*?)\)(?:`|\s*#|\n)", text, re.S):
            listed = _keyword_values(args)
            if re.search(r"(^|,)\s*\.\.\.\s*,", args) or len(listed) < 3:
                continue  # `Muon(..., ns_algorithm="standard")`: an example, not the defaults
            defaults = _muon_defaults() if call == "Muon" else _param_groups_defaults()
            for name, stated, choices in listed:
                if not stated:  # `Muon(..., ns_coefficients=)`: names the argument only
                    continue
                if name not in defaults:
                    wrong.append(f"{doc.name}: {call}({name}=...) is not an argument")
                elif not _same_python(stated, defaults[name]):
                    wrong.append(f"{doc.name}: {call}({name}={stated}); the code: {defaults[name]}")
                elif len(choices) > 1 and set(choices) != set(_CHOICES.get(name, choices)):
                    wrong.append(
                        f"{doc.name}: {call}({name}={' | '.join(choices)}); the choices: "
                        f"{', '.join(_CHOICES[name])}"
                    )
    assert not wrong, "\n".join(wrong)


@cache
def _muon_defaults() -> dict:
    from muon import Muon

    params = inspect.signature(Muon.__init__).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _param_groups_defaults() -> dict:
    from muon import param_groups

    params = inspect.signature(param_groups).parameters
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _choices() -> dict[str, tuple[str, ...]]:
    from muon.coefficients import NS_COEFFICIENTS
    from muon.cost import NS_ALGORITHMS
    from muon.groups import ROUTER_CHOICES
    from muon.optimizer import ADJUST_LR
    from muon.plan import REMAINDER_CHOICES

    return {
        "remainder_strategy": REMAINDER_CHOICES,
        "ns_algorithm": NS_ALGORITHMS,
        "ns_coefficients": (*NS_COEFFICIENTS, "[(a, b, c), ...]"),
        "adjust_lr": ADJUST_LR,
        "router": ROUTER_CHOICES,
    }


_CHOICES = _choices()


def _keyword_values(args: str) -> list[tuple[str, str, list[str]]]:
    """(name, first value, all listed values) of each `name=value | value ...` argument."""
    out = []
    parts = re.split(r",\s*(?=\w+=)", re.sub(r"\s+", " ", args))
    for part in parts:
        m = re.match(r"\s*(\w+)=(.*)", part)
        if not m:
            continue
        values = [v.strip().strip("'\"") for v in m.group(2).rstrip(", ").split(" | ")]
        out.append((m.group(1), m.group(2).split(" | ")[0].strip(), values))
    return out


def _same_python(stated: str, actual) -> bool:
    stated = stated.rstrip(", ")
    try:
        return ast.literal_eval(stated) == actual or (
            isinstance(actual, tuple) and list(ast.literal_eval(stated)) == list(actual)
        )
    except (ValueError, SyntaxError):
        return stated == repr(actual) or stated == str(actual)


def _third_party_imports(package: str) -> set[str]:
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"__future__", package}


#: a line budget: "under ~450 lines", "< 250 lines", "300 to 450 lines" (its upper end)
LINES = re.compile(r"(?:under ~?|< ?|\d+ to )(\d+) lines")


def line_claims(text: str) -> list[tuple[str, int]]:
    """(subject, limit) of every line budget `text` states: "scripts" in a bullet or paragraph
    about the scripts ("Scripts are ..."), else "files" (every file of the packages)."""
    out = []
    for chunk in re.split(r"\n(?=- |\n)", text):
        subject = "scripts" if "Scripts are" in chunk else "files"
        out += [(subject, int(n)) for n in LINES.findall(" ".join(chunk.split()))]
    return out


def _line_counts(subject: str) -> dict[str, int]:
    packages = ("scripts",) if subject == "scripts" else ("muon", "models", "recipes", "scripts")
    return {
        p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
        for package in packages
        for p in (ROOT / package).rglob("*.py")
    }


def test_line_claims_and_moved_paths_are_read():
    """The parsers above find what they look for (so the checks can fail)."""
    text = "- Scripts are thin (under 150 lines).\n- Files: under ~450 lines, or 300 to 400 lines."
    assert line_claims(text) == [("scripts", 150), ("files", 450), ("files", 400)]
    assert PATH.findall("see muon/grads.py, and `recipes/x/` or https://h/models/a.py") == [
        "muon/grads.py",
        "recipes/x/",
    ]
    assert PATH.findall("`muon/remainder/*` and muon/<path>/bytes_sent") == []
    assert MOVED.findall("its `muon/grads.py` is `recipes/grads.py` now") == [
        ("muon/grads.py", "recipes/grads.py")
    ]


def test_design_layout_and_import_rules_hold():
    """docs/design.md names every muon/ module in its layout, and its import rules are the
    imports the packages make: muon imports torch only, models torch and safetensors, neither
    imports the other, and nothing in the libraries imports scripts/."""
    design = doc_text(ROOT / "docs" / "design.md")
    layout = re.search(r"## Layout.*?```(.*?)```", design, re.S).group(1)
    for module in sorted((ROOT / "muon").glob("*.py")):
        if module.name != "__init__.py":
            assert f"  {module.name}" in layout, f"docs/design.md's layout omits muon/{module.name}"
    claims = line_claims(design)
    assert ("scripts", 150) in claims and ("files", 450) in claims, claims
    for subject, limit in claims:  # a stated line budget holds, but for what is reshaped
        longer = [
            f"{rel}: {n}"
            for rel, n in _line_counts(subject).items()
            if n > limit and not any(covers(e, rel) for e in STILL_RESHAPED)
        ]
        assert not longer, f"docs/design.md says {subject} under {limit} lines: {longer}"
    rules = " ".join(re.search(r"## Who may import whom(.*?)\n## ", design, re.S).group(1).split())
    assert _third_party_imports("muon") == {"torch"} and "`muon/` imports torch" in rules
    assert _third_party_imports("models") == {"torch", "safetensors"}
    assert "`models/` imports torch and safetensors" in rules
    for package in ("muon", "models", "recipes"):
        assert "scripts" not in _third_party_imports(package), package
