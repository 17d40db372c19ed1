"""train.py's checks before torch loads (`recipes.config.compose.preflight`): they import
neither torch, numpy nor the model code; Hydra's composition errors come out as one line naming
the key and what it takes; directories a run cannot write and files that are not token ids are
refused before any rank starts; the fork server starts only for a config that passed."""

import gzip
import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

import train
from recipes.config import ConfigError, key_help
from recipes.config.compose import preflight

ROOT = Path(__file__).resolve().parents[2]
_PROBE = """
import sys
from recipes.config import ConfigError
from recipes.config.compose import preflight
preflight(["data.cache_dir=cache"])  # a valid config: every torch-free check runs and passes
try:
    preflight(["train.steps=0"])
except ConfigError as err:
    print(err)
print(sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "models", "muon"}))
"""


def test_preflight_imports_no_torch_numpy_or_model_code(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    error, imported = out.stdout.splitlines()
    assert error.startswith("train.steps=0: must be > 0")
    assert imported == "[]"


HELP = {key: key_help(key) for key in ("data.batch_size", "model.overrides", "train.steps")}
ADAMW_KEYS = "name, lr, weight_decay, betas, eps, qk_clip_tau, qk_clip_alpha"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["data.batch_size=0.5"],
            "data.batch_size=0.5: expected an integer "
            f"(data.batch_size: {HELP['data.batch_size']})",
        ),
        (
            ["model.overrides.num_hidden_layers=2"],
            "model.overrides.num_hidden_layers=2: a key is added to the mapping model.overrides "
            "with '+': +model.overrides.num_hidden_layers=2 "
            f"(model.overrides: {HELP['model.overrides']})",
        ),
        (
            ["optim=adamw", "optim.remainder_strategy=agrs"],
            "optim.remainder_strategy=agrs: a key of optim=muon; this command composes "
            f"optim=adamw, whose keys are: {ADAMW_KEYS}",
        ),
        (  # the same with Hydra's `+`, refused by validate_config instead
            ["optim=adamw", "+optim.remainder_strategy=agrs"],
            "optim.remainder_strategy=agrs: a key of optim=muon; this command composes "
            f"optim=adamw, whose keys are: {ADAMW_KEYS}",
        ),
        (
            ["-m", "model.overrides.num_hidden_layers=2"],
            "model.overrides.num_hidden_layers=2: a key is added to the mapping model.overrides",
        ),
        (["train.steps=[1]"], "train.steps=[1]: expected an integer (train.steps: "),
        (
            ["data.dtype=uint9"],
            "data.dtype=uint9: expected one of [uint8, uint16, uint32], or null",
        ),
        (["optim.betas=3"], "optim.betas=3: expected a list of numbers in brackets ([a,b,...])"),
        (
            ["train=x"],
            "train=x: expected its keys set one by one (train.<name>=value), not a value",
        ),
        (
            ["model=nope"],
            "model=nope: no such option of the config group model; allowed: glm45_air, glm5, ",
        ),
        (["+train.steps=3"], "+train.steps: train.steps is in the config already: set it without"),
        (["train.steps=1,2"], "train.steps=1,2: a comma separates the values of a sweep, which "),
        (["train.steps=[1"], "train.steps=[1: not an override Hydra reads (no viable alternative"),
    ],
)
def test_hydra_errors_are_one_line_naming_the_key_and_its_type(args, message):
    with pytest.raises(ConfigError) as err:
        preflight(args)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_directories_a_run_cannot_write_are_refused(tmp_path, monkeypatch):
    """run.root (the working directory for the default), data.cache_dir: their nearest
    existing directory must be writable (a file in the way, no permission, a read-only file
    system); a cache that already holds built files is only read."""
    (tmp_path / "file").write_text("")
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    access = os.access
    if access(read_only, os.W_OK):  # root: permissions do not bind, a read-only mount would
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != read_only and access(p, mode))
    monkeypatch.chdir(tmp_path)
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    for args, message in [
        (["run.root=file/runs", cache], f"run.root=file/runs: {tmp_path / 'file'} is not a dir"),
        (["data.cache_dir=file/c"], f"data.cache_dir=file/c: {tmp_path / 'file'} is not a dir"),
        ([f"run.root={read_only}/runs", cache], f"run.root={read_only}/runs: {read_only} is not "),
        ([f"data.cache_dir={read_only}/c"], f"data.cache_dir={read_only}/c: {read_only} is not "),
    ]:
        with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[")):
            preflight(args)
    monkeypatch.chdir(read_only)
    with pytest.raises(ConfigError, match=r"^run.root=outputs: .* \(the working directory\) is"):
        preflight([cache])
    monkeypatch.chdir(tmp_path)
    read_only.chmod(0o755)
    (read_only / "stdlib-0123.train.u8.bin").write_bytes(b"x")
    read_only.chmod(0o555)
    preflight([f"data.cache_dir={read_only}"])  # built files there: only read
    read_only.chmod(0o755)


def test_files_that_are_not_token_ids_are_refused(tmp_path, monkeypatch):
    """A flat data.path file whose first bytes name another format is refused by name; raw
    ids, and a file written by recipes.data.write_tokens whatever its first bytes, pass."""
    from recipes.data import write_tokens

    monkeypatch.chdir(tmp_path)
    ids = np.arange(4096, dtype=np.uint8)
    np.save(tmp_path / "ids.npy", ids)
    with gzip.open(tmp_path / "ids.gz", "wb") as f:
        f.write(ids.tobytes())
    with zipfile.ZipFile(tmp_path / "ids.zip", "w") as f:
        f.writestr("ids", ids.tobytes())
    ids.tofile(tmp_path / "raw.bin")
    magic = np.frombuffer(b"\x93NUMPY" + bytes(4090), dtype=np.uint8)
    write_tokens(tmp_path / "tokens" / "written.bin", magic)  # its sidecar names the dtype
    base = ["data=tokens", "data.vocab_size=256", "data.dtype=uint8", "eval.every=0"]
    for name, what in [
        ("ids.npy", "a NumPy .npy file"),
        ("ids.gz", "a gzip file"),
        ("ids.zip", "a zip archive"),
    ]:
        with pytest.raises(ConfigError, match=f"^data.path={name}: {what}.*, not raw token ids"):
            preflight([*base, f"data.path={name}"])
    for name in ("raw.bin", "tokens/written.bin"):
        preflight([*base, f"data.path={name}"])


def test_model_hf_without_init_from_says_its_weights_are_random():
    """The run log's warning: model.path gives the config only; init_from loads weights."""
    from recipes.trainer_state import init_from

    cfg = OmegaConf.create(
        {
            "checkpoint": {"init_from": None},
            "model": {"preset": "hf", "path": "hf_dir"},
            "train": {"seed": 3},
        }
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("recipes")
    logger.addHandler(handler)
    try:
        init_from(SimpleNamespace(cfg=cfg, rank=0))
        cfg.model.preset = "tiny"
        init_from(SimpleNamespace(cfg=cfg, rank=0))  # a preset: nothing to say
    finally:
        logger.removeHandler(handler)
    (record,) = records
    assert record.levelno == logging.WARNING
    assert record.getMessage() == (
        "model=hf without checkpoint.init_from: the weights start from a seeded random init "
        "(train.seed=3), model.path=hf_dir gives the config only; checkpoint.init_from=hf_dir "
        "loads them"
    )


def test_fork_server_starts_only_after_the_config_passed(monkeypatch):
    started, ran = [], []
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SUBMITIT_FOLDER", raising=False)
    monkeypatch.setattr("recipes.world.start_fork_server", lambda: started.append(1))
    monkeypatch.setattr(train, "main", lambda: ran.append(1))
    with pytest.raises(SystemExit, match="train.py: config error: data.batch_size=0.5: "):
        train.cli(["data.batch_size=0.5"])
    assert started == [] and ran == []
    train.cli(["train.steps=3"])
    assert started == [1] and ran == [1]
