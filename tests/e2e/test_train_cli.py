"""`python train.py` at the command line: --help renders the schema, and bad input (a bad
value, an invalid or colliding sweep) fails with one message before any rank starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from recipes import config as schema
from tests.train_cli import ROOT, train_py


def _train_py(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return train_py(list(args), cwd, timeout=120)


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "optim.remainder_strategy=agsr",
            "expected one of [agrs, pad_all2all, ragged_all_to_all, auto]",
        ),
        ("mesh.ep=3", "mesh.ep=3: must divide mesh.world_size=4; allowed: 1, 2, 4"),
        ("optim.lr=nan", "optim.lr=nan: must be a finite number"),
        ("data.seq_len=999999999", "data.seq_len=999999999: exceeds the model's max_position"),
        ("run.name=../../x", "run.name=../../x: has a '..' component; the run directory is"),
        # 95 GiB per rank (tests/unit/test_memory_check.py: 11.9 GiB at batch 8), x 4 ranks:
        # more than any machine the tests run on
        (
            "data.seq_len=100000 data.batch_size=64",
            "train.memory_check=error: data.seq_len=100000 data.batch_size=64: the step needs "
            "an estimated ",  # 107 GiB (tests/unit/test_memory_check.py checks the figure)
        ),
        ("+model.overrides.hidden_size=-64", "model.overrides.hidden_size=-64: GLMConfig.hidden"),
        (
            "+model.overrides.n_routed_experts=6 mesh.ep=4",
            "mesh.ep=4: n_routed_experts (6) must be divisible by ep (4); allowed ep: [1, 2]",
        ),
        # a typo, and Hydra's hint for it: both end here, naming the nearest real key
        ("train.step=5", "train.step: unknown key, with or without '+'; did you mean train.steps?"),
        (
            "+train.step=5",
            "train.step: unknown key, with or without '+'; did you mean train.steps?",
        ),
        # Hydra's own errors (a missing `+`, a wrong type, an option's key): the same one line
        ("data.batch_size=0.5", "data.batch_size=0.5: expected an integer (data.batch_size: "),
        (
            "model.overrides.num_hidden_layers=2",
            "model.overrides.num_hidden_layers=2: a key is added to the mapping model.overrides",
        ),
        (
            "optim=adamw optim.remainder_strategy=agrs",
            "optim.remainder_strategy=agrs: a key of optim=muon; this command composes optim=adamw",
        ),
        (
            "optim=adamw +optim.ns_steps=3",
            "optim.ns_steps=3: a key of optim=muon; this command composes optim=adamw, whose keys",
        ),
    ],
)
def test_train_py_fails_fast_before_any_rank(override, expected, tmp_path):
    proc = _train_py(*override.split(), cwd=tmp_path)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert proc.stderr.count(expected) == 1 and "Traceback" not in proc.stderr  # one message
    assert "[rank" not in proc.stdout + proc.stderr  # no rank ever started
    assert not list(tmp_path.iterdir())  # not even the empty run dir Hydra made
    assert "HYDRA_FULL_ERROR" not in proc.stderr  # none of Hydra's raw messages


def test_a_bad_override_fails_before_torch_loads(tmp_path):
    """`-X importtime` lists every module the command imports, the fork server's included
    (its interpreter gets the same flags): a bad override's error comes with none of torch,
    numpy or the model code imported, and one line."""
    command = [sys.executable, "-X", "importtime", str(ROOT / "train.py"), "train.steps=0"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert errors == [
        "train.py: config error: train.steps=0: must be > 0 (train.steps: "
        + schema.key_help("train.steps")
        + ")"
    ]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "hydra" in imported and not imported & {"torch", "numpy", "models", "muon"}


def test_directories_it_cannot_write_fail_in_one_line_leaving_nothing(tmp_path):
    """A run root below a file (as an unwritable one): one line before Hydra makes anything;
    a data.cache_dir likewise, before any rank starts."""
    (tmp_path / "file").write_text("")
    for override, key in [
        ("run.root=file/runs", "run.root"),
        ("data.cache_dir=file/c", "data.cache_dir"),
    ]:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "train.py"), override],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1
        assert proc.stderr.splitlines() == [
            f"train.py: config error: {override}: {tmp_path / 'file'} is not a directory "
            f"({key}: {schema.key_help(key)})"
        ]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_help_lists_every_key_with_allowed_values_and_help(tmp_path):
    """`--help` renders the schema for the composed config: Muon's keys by default, AdamW's
    (and no Muon key) with optim=adamw."""
    proc = _train_py("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    strategy = next(line for line in lines if line.startswith("optim.remainder_strategy = "))
    assert "[agrs, pad_all2all, ragged_all_to_all, auto]" in strategy
    assert "# Muon exchange for batches smaller than the FSDP group" in strategy
    assert any(line.startswith("optim.nesterov = true  [true, false]  # ") for line in lines)
    keys = {line.split(" = ")[0] for line in lines if line[:1].islower() and "  # " in line}
    assert keys == {line.split(" = ")[0] for line in schema.describe()}
    assert "optim: adamw, muon" in lines and "Powered by Hydra" not in proc.stdout
    assert not any(line.startswith("schema") for line in lines)
    adamw = _train_py("--help", "optim=adamw", cwd=tmp_path)
    assert adamw.returncode == 0, adamw.stderr
    optim = {
        line.split(" = ")[0] for line in adamw.stdout.splitlines() if line.startswith("optim.")
    }
    shared = ("name", "lr", "weight_decay", "betas", "eps", "qk_clip_tau", "qk_clip_alpha")
    assert optim == {f"optim.{k}" for k in shared}
    assert "optim.lr = 0.003  # " in adamw.stdout
    assert not list(tmp_path.iterdir())  # nothing written


def test_sweep_jobs_that_would_share_a_directory_fail_before_any_starts(tmp_path):
    """`a?b` and `a_b` give one directory name: the sweep fails before its first job; so does
    a sweep with one invalid job."""
    for source in (tmp_path / "a?b", tmp_path / "a_b"):
        source.mkdir(parents=True)
        (source / "m.py").write_text("x = 1\n" * 100)  # longer than one sample
    proc = _train_py("-m", "data.path=a?b,a_b", cwd=tmp_path)
    assert proc.returncode != 0
    assert (
        "sweep jobs [data.path=a?b" in proc.stderr
        and "would share the run directory" in proc.stderr
    )
    proc = _train_py("-m", "optim.lr=0.1,nan", cwd=tmp_path)
    assert (
        "sweep job [optim.lr=nan" in proc.stderr and "optim.lr=nan: must be a finite" in proc.stderr
    )
    assert "[rank" not in proc.stdout + proc.stderr
    proc = _train_py("-m", "checkpoint.async_mode=true,2", cwd=tmp_path)  # 2 ran as true
    assert "sweep job [checkpoint.async_mode=2" in proc.stderr
    assert "checkpoint.async_mode=2: must be true or false" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a?b", "a_b"]  # nothing written
