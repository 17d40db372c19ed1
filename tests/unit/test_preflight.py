"""recipes.config.preflight: run.name stays inside run.root; token ids beyond the vocabulary
are refused before any rank starts, naming the file (scanned once, then remembered)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from recipes import config as schema
from recipes.config import preflight
from recipes.config.preflight import check_path_overrides, check_run_name, max_token_id

CONF = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize(
    "name, rule",
    [
        ("../../x", "has a '..' component"),
        ("a/../../x", "has a '..' component"),
        ("/tmp/x", "is an absolute path"),
        ("C:\\runs", "is an absolute path"),
        ("~/runs", "starts with '~'"),
        ("", "is empty"),
    ],
)
def test_a_run_name_outside_run_root_is_refused(name, rule):
    with pytest.raises(
        schema.ConfigError, match=rf"run\.name={re.escape(name)}: {rule}; .*inside run\.root"
    ):
        check_run_name(name)
    with pytest.raises(schema.ConfigError, match=rule):
        check_path_overrides([f"run.name={name}" if name else "run.name=''"])


def test_run_names_inside_run_root_pass_and_validate_checks_the_composed_one():
    for name in ("default", "sweep-1/agrs", "a..b", "x.y_z"):
        check_run_name(name)
    check_path_overrides(["train.steps=3", "run.name=ok,fine/too", "run.root=/abs/is/fine"])
    with pytest.raises(schema.ConfigError, match=r"run\.name=\.\./x: has a '\.\.'"):
        check_path_overrides(["run.name=ok,../x"])  # a sweep: every value
    cfg = compose_config(["run.name=../escape"])
    with pytest.raises(schema.ConfigError, match=r"run\.name=\.\./escape: has a '\.\.'"):
        schema.validate(cfg, check_devices=False)


def test_token_ids_beyond_the_vocabulary_are_refused_naming_the_file(tmp_path, monkeypatch):
    """A uint16 file holding 65452 with data.vocab_size=1000: refused by validate, naming the
    file and the id; the scan's result is remembered (a second check reads no token); a file
    within the vocabulary passes, and so does one whose dtype the vocabulary covers."""
    tokens = np.arange(4096, dtype=np.uint16) % 1000
    tokens[3000] = 65452
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    over = ["data=tokens", f"data.path={path}", "data.dtype=uint16", "data.vocab_size=1000"]
    over += ["eval.every=0", f"data.cache_dir={tmp_path / 'cache'}"]
    expected = rf"data\.vocab_size=1000: {path} holds token id 65452 \(ids must be <"
    with pytest.raises(schema.ConfigError, match=expected):
        schema.validate(compose_config(over), check_devices=False)
    monkeypatch.setattr(preflight, "SCAN_CHUNK", 1)  # a scan now would read token by token...
    monkeypatch.setattr(np, "memmap", None)  # ...and cannot: the remembered maximum is used
    with pytest.raises(schema.ConfigError, match=expected):
        schema.validate(compose_config(over), check_devices=False)
    (memo,) = (tmp_path / "cache" / "token-max").iterdir()
    assert json.loads(memo.read_text())["max_id"] == 65452
    monkeypatch.undo()
    tokens[3000] = 999
    np.append(tokens, 7).tofile(path)  # rewritten: another size, so scanned again
    schema.validate(compose_config(over), check_devices=False)
    assert max_token_id(path, "uint16") == 999  # no cache_dir: scanned, not remembered
    wide = [*over[:-3], "data.vocab_size=65536", *over[-2:]]  # uint16 holds no larger id
    schema.validate(compose_config(wide), check_devices=False)
