"""The suite's subprocesses run the interpreter the suite runs under: from a venv, the
commands the docs-commands test starts (`python ...` through its PATH), the gpu_check test's
`$PYTHON` and the Slurm jobs' PATH import the venv's packages, not the base interpreter's."""

import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: run by the venv's interpreter: the helpers as the tests call them, asked which Python runs
PROGRAM = """\
import subprocess, sys
from pathlib import Path
from tests.e2e import test_docs_commands as docs
from tests.e2e import test_gpu_check as gpu
from tests.slurm import slurm_util

root = Path(sys.argv[1])
root.mkdir()
docs._copy_of_checkout(root)
ask = "import sys, hydra, omegaconf, venv_marker; print(sys.prefix)"
for name in ("python", "python3"):
    out = subprocess.run(["bash", "-c", f"{name} -c '{ask}'"], cwd=root, env=docs._env(root),
                         capture_output=True, text=True)
    print(name, out.returncode, out.stdout.strip(), out.stderr.strip()[-300:])
out = subprocess.run(["bash", "-c", "command -v python"], env=slurm_util.client_env(),
                     capture_output=True, text=True)
print("slurm", out.stdout.strip())
seen = {}
gpu.subprocess.run = lambda cmd, **kw: seen.update(kw["env"])  # last: nothing runs after it
gpu._run("--dry-run")
print("gpu_check", seen["PYTHON"])
"""


def test_subprocesses_run_the_venvs_interpreter(tmp_path):
    venv = tmp_path / "venv"
    # the base interpreter's packages stay visible (torch, hydra: nothing to install); the
    # marker module is the venv's own, so only the venv's interpreter imports it
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
    )
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert purelib != sysconfig.get_paths()["purelib"]
    (Path(purelib) / "venv_marker.py").write_text("")
    proc = subprocess.run(
        [str(python), "-c", PROGRAM, str(tmp_path / "copy")],
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,  # a hang guard
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    for name in ("python", "python3"):  # exit 0, the venv's prefix
        assert lines[name].split()[:2] == ["0", str(venv)], lines[name]
    assert lines["slurm"] == str(venv / "bin" / "python")
    assert lines["gpu_check"] == str(python)
