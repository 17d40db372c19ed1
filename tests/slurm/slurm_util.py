"""Helpers for the tests that run a real Slurm cluster (scripts/slurm/local_cluster.sh).

`start_cluster` starts one under a temporary directory (one node, or N nodes in network
namespaces) and always stops it; `Cluster` submits and polls jobs with bounded waits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.interpreter import with_interpreter

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "scripts" / "slurm"
LOCAL_CLUSTER = str(SLURM_DIR / "local_cluster.sh")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
# local_cluster.sh's exit status for "cannot run here" (not root, packages or namespaces missing).
CANNOT_RUN = 3
# Between two looks at a job or the nodes (a `scontrol`/`sinfo` call costs milliseconds).
POLL_S = 0.1
HOOKS = Path(__file__).resolve().parent / "slurm_hooks"
# Cheap training runs (launching is what these tests are about): short sequences, no transformers
# export, no progress bar, no evaluation, and a small corpus: the stdlib's json package, not the
# whole standard library (the default), which every process of a run lists, seconds each.
FAST_ARGS = [
    "checkpoint.export_hf=false",
    "metrics.progress=false",
    "data.seq_len=32",
    "data.batch_size=2",
    "eval.every=0",
    f"data.path={Path(sysconfig.get_paths()['stdlib']) / 'json'}",
]


def run(cmd, env=None, timeout=60, check=True, cwd=REPO) -> subprocess.CompletedProcess:
    out = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and out.returncode != 0:
        raise AssertionError(f"{cmd} exited {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def tail(log: Path | None, n: int = 4000) -> str:
    return log.read_text()[-n:] if log is not None and log.exists() else "(no log)"


def slurm_unavailable() -> str | None:
    for daemon in ("munged", "slurmctld", "slurmd", "sbatch"):
        if shutil.which(daemon) is None:
            return f"{daemon} not installed (apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root; not root here"
    return None


def client_env() -> dict[str, str]:
    """This process's environment without Slurm's job variables (tests may run inside a job),
    the interpreter's folder first on PATH (the jobs' `torchrun` is the venv's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.pop("DRY_RUN", None)
    return with_interpreter(env)


class Cluster:
    """A running local cluster: its directory, client environment and job helpers."""

    def __init__(self, root: Path, env: dict[str, str]):
        self.root = root
        self.env = env

    def run(self, cmd, timeout=30, check=True) -> subprocess.CompletedProcess:
        return run(cmd, env=self.env, timeout=timeout, check=check)

    def sbatch(self, args, env=None) -> str:
        out = run(["sbatch", "--parsable", *args], env=env or self.env, timeout=30).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (empty once the job is gone)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: str, until, deadline_s: float, what: str, log: Path | None = None):
        """Poll the job until `until(info)` holds; fail (never hang) after `deadline_s`."""
        end = time.monotonic() + deadline_s
        info: dict[str, str] = {}
        while time.monotonic() < end:
            info = self.job(job_id)
            if until(info):
                return info
            time.sleep(POLL_S)
        msg = f"job {job_id}: not {what} after {deadline_s}s: {info}"
        pytest.fail(f"{msg}\n--- log ---\n{tail(log)}")

    def wait_idle(self, deadline_s: float) -> None:
        """Wait until every node is idle (no job still completing on it)."""
        end = time.monotonic() + deadline_s
        states: list[str] = []
        while time.monotonic() < end:
            states = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            if states and all(s == "idle" for s in states):
                return
            time.sleep(POLL_S)
        pytest.fail(f"nodes not idle after {deadline_s}s: {states}")

    def wait_final(self, job_id: str, deadline_s: float, log: Path | None = None):
        return self.wait(
            job_id, lambda i: i.get("JobState") in FINAL_STATES, deadline_s, "finished", log
        )

    def wait_done(self, job_id: str, deadline_s: float, log: Path | None = None):
        info = self.wait_final(job_id, deadline_s, log)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{tail(log)}"
        return info

    def release_requeued(self, job_id: str, log: Path | None = None) -> None:
        """Start a requeued job (PENDING, held until its BeginTime) now.

        Releasing at once can start the job in the same second its previous run's credential
        was revoked, which slurmd compares at one-second resolution ("Job credential
        revoked"): wait for the job to be PENDING again (a requeued job is COMPLETING until
        every node has ended its run, the revocation included), then for the second in which
        it was seen so to pass.
        """
        self.wait(
            job_id,
            lambda i: i.get("JobState") == "PENDING" and i.get("Restarts", "0") != "0",
            90,
            "requeued",
            log,
        )
        time.sleep(1.05 - time.time() % 1)  # into the next second (same clock as slurmd's)
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])


@contextmanager
def start_cluster(root: Path, nodes: int = 1, **knobs: str):
    """A cluster of `nodes` nodes under `root`, stopped on exit whatever happened; skips the
    test (with local_cluster.sh's reason) where it cannot run here. `knobs`: local_cluster.sh's
    environment settings (SLURMD_TIMEOUT, MESSAGE_TIMEOUT)."""
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    env = client_env()
    start_env = {**env, **knobs}
    started = run([LOCAL_CLUSTER, "start", str(root), "--nodes", str(nodes)], start_env, 60, False)
    try:
        if started.returncode == CANNOT_RUN:
            pytest.skip(started.stderr.strip().splitlines()[-1])
        if started.returncode != 0:
            pytest.fail(f"local_cluster.sh start failed:\n{started.stdout}\n{started.stderr}")
        match = re.search(r"^export SLURM_CONF=(\S+)$", started.stdout, re.M)
        assert match, started.stdout
        env["SLURM_CONF"] = match.group(1)
        yield Cluster(root, env)
    finally:
        run([LOCAL_CLUSTER, "stop", str(root)], env=env, timeout=90, check=False)


def metrics(run_root: Path) -> list[dict]:
    """The rows of the one metrics.jsonl under `run_root` (the run dir is <root>/<name>/<id>)."""
    files = sorted(run_root.rglob("metrics.jsonl"))
    assert len(files) == 1, f"expected one metrics.jsonl under {run_root}, found {files}"
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def rows(run_root: Path) -> list[dict]:
    """Like metrics, but [] while the run has not written any (or is mid-write)."""
    try:
        return metrics(run_root) if any(run_root.rglob("metrics.jsonl")) else []
    except (AssertionError, json.JSONDecodeError):
        return []


def committed_steps(run_root: Path) -> list[int]:
    """Steps of the committed checkpoints (<run dir>/checkpoints/step_<n>/COMMITTED), sorted."""
    return sorted(int(p.parent.name[5:]) for p in run_root.rglob("checkpoints/step_*/COMMITTED"))


def slow_saves(
    env: dict[str, str],
    tmp_path: Path,
    seconds: float,
    steps: tuple[int, ...] = (),
    job_name: str | None = None,
) -> tuple[dict[str, str], Path]:
    """`env` for a job in which rank 0 takes `seconds` longer for each checkpoint of the job's
    first run (those of `steps` only, if given; only in the job named `job_name`, if given: the
    tests/slurm/slurm_hooks/sitecustomize.py hook), and the directory of its progress marks
    (saving_<step>, saved_<step>)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(
        env,
        PYTHONPATH=os.pathsep.join([str(HOOKS), str(REPO)]),
        SLOW_SAVE_S=str(seconds),
        SLOW_SAVE_DIR=str(marks),
        SLOW_SAVE_STEPS=",".join(map(str, steps)),
    )
    if job_name is not None:
        env["SLOW_SAVE_JOB"] = job_name
    return env, marks
