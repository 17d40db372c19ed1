"""train.sbatch, the sweep script and the submitit launcher across two real Slurm nodes.

A module fixture starts `scripts/slurm/local_cluster.sh start <tmp> --nodes 2`: two nodes, each a
network namespace with its own hostname and address, one slurmctld, one munged; traffic stays on
the namespaces' veths (never the default route). It is stopped at the end whatever happens; the
lifecycle test checks on a second cluster that stop leaves no process, namespace, veth or cgroup
dir behind. Skipped, with the script's reason, where Slurm, root or namespaces are missing.

Every training job is the tiny model on CPU/gloo, a few steps (tests/slurm/slurm_util.py
FAST_ARGS); every wait is bounded. A job costs seconds of Python and torch start-up per process,
so claims that share a launch share a job: `sbatch -N 2` training like one node and preemption
while rank 0 writes a checkpoint are one job (2 nodes x 2 ranks); a lost node and the sweep
script with `-N 2` are one sweep (2 nodes x 1 rank), submitted twice.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.slurm.slurm_util import (
    FAST_ARGS,
    LOCAL_CLUSTER,
    REPO,
    SLURM_DIR,
    client_env,
    committed_steps,
    metrics,
    rows,
    run,
    slow_saves,
    start_cluster,
    tail,
)

# The tiny model, ep=2, logging to metrics.jsonl only, small and quick.
ARGS = ["mesh.ep=2", "logger=none", *FAST_ARGS]
# How soon slurmctld marks a killed node down (its job's srun waits for that): SlurmdTimeout of
# failed pings, each failing after MessageTimeout. Lower than the defaults (20 s, 10 s), which
# are for people; still far above what a ping or any other RPC takes on this machine.
LOST_NODE_KNOBS = {"SLURMD_TIMEOUT": "4", "MESSAGE_TIMEOUT": "3"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm2")
    with start_cluster(root, nodes=2, **LOST_NODE_KNOBS) as c:
        yield c


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(request):
    """After each test, cancel the jobs a failed test left behind, so the next one finds the
    nodes idle."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("cluster")
    jobs = cluster.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
    if jobs:
        cluster.run(["scancel", "--full", *jobs], check=False)
        cluster.wait_idle(60)


def _nodes(root: Path) -> list[str]:
    env = (root / "etc" / "netns.env").read_text()
    return re.search(r'^NODES="([^"]*)"', env, re.M).group(1).split()


def _ns_members(inode: str) -> list[int]:
    """Pids of the processes in the network namespace `inode` (readlink of /proc/<pid>/ns/net)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.readlink(proc / "ns" / "net") == inode and "Z" not in _state(proc):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return _state(Path(f"/proc/{pid}")) != "Z"
    except OSError:
        return False


def _state(proc: Path) -> str:
    stat = (proc / "stat").read_text()
    return stat[stat.rindex(")") + 2]


def _sbatch_train(cluster, log: Path, run_root: Path, steps: int, every: int, env=None):
    return cluster.sbatch(
        [
            "-N2",
            "--cpus-per-task=2",
            f"--output={log}",
            str(SLURM_DIR / "train.sbatch"),
            *ARGS,
            f"train.steps={steps}",
            f"checkpoint.every={every}",
            f"run.root={run_root}",
            "run.name=multi",
        ],
        env=env,
    )


def _resumed(text: str) -> list[int]:
    """Steps of the checkpoints the runs in a Slurm output resumed from."""
    return [int(s) for s in re.findall(r"resumed from \S*step_(\d+)", text)]


def _layout(first_row: dict, nodes: list[str]) -> None:
    """World size 4, two ranks on each of the two nodes."""
    assert first_row["world_size"] == 4, first_row
    assert collections.Counter(first_row["hosts"]) == {nodes[0]: 2, nodes[1]: 2}, first_row


# ---------------------------------------------------------------------------------------------


def test_cluster_lifecycle_leaves_nothing_behind(tmp_path):
    """A second two-node cluster next to the module's: both run; stop removes every trace."""
    root = tmp_path / "c"
    env = client_env()
    out = run([LOCAL_CLUSTER, "start", str(root), "--nodes", "2"], env, 60, check=False)
    try:
        if out.returncode == 3:
            pytest.skip(out.stderr.strip().splitlines()[-1])
        assert out.returncode == 0, out.stderr
        env["SLURM_CONF"] = str(root / "etc" / "slurm.conf")
        assert out.stdout.strip() == f"export SLURM_CONF={env['SLURM_CONF']}"
        nodes = _nodes(root)
        status = run([LOCAL_CLUSTER, "status", str(root)], env).stdout
        assert status.count("idle") == 2 and "slurmctld: running" in status
        hosts = run(["srun", "-N2", "hostname"], env, 30).stdout.split()
        assert sorted(hosts) == nodes
        netns = [(root / "run" / f"netns-{n}").read_text().strip() for n in nodes]
        holders = [int((root / "run" / f"holder-{n}.pid").read_text()) for n in nodes]
        host_if = re.search(r"^HOST_IF=(\S+)", (root / "etc/netns.env").read_text(), re.M)[1]
        route = run(["ip", "-o", "route", "get", "10.77." + host_if[3:] + ".11"], env).stdout
        assert f" dev {host_if} " in route and " via " not in route, route
    finally:
        run([LOCAL_CLUSTER, "stop", str(root)], env, 90, check=False)
    # Nothing left: processes in the namespaces, holders, host veth, cgroup dirs.
    deadline = time.monotonic() + 5  # PID 1 reaps orphans every second or two
    while time.monotonic() < deadline and any(_ns_members(ns) for ns in netns):
        time.sleep(0.2)
    assert not any(_ns_members(ns) for ns in netns)
    assert not [p for p in holders if _alive(p)]
    assert run(["ip", "link", "show", host_if], env, check=False).returncode != 0
    assert not list(Path("/sys/fs/cgroup").glob(f"*/slurm_{nodes[0][:-1]}*"))
    assert run([LOCAL_CLUSTER, "status", str(root)], env, check=False).returncode != 0


def test_sbatch_two_nodes_trains_like_one_node_through_a_preemption(cluster, tmp_path):
    """sbatch -N 2 train.sbatch, 2 ranks per node: world 4 over both hosts, rendezvous on the
    first node, per-node logs. USR1 to the batch script while rank 0 is (slowly) writing the
    step-2 checkpoint: every node's ranks finish the checkpoints, every task exits 0, the job
    requeues and the resumed run continues from the last trained step. The whole run's losses,
    before and after the requeue, are those of a one-node run of the same world and config.
    (One job carries the claims of training like one node and of preemption.)"""
    steps, every = 5, 2
    # The one-node reference trains meanwhile: python train.py with a local world of 4 ranks.
    ref = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "mesh.world_size=4",
            *ARGS,
            f"train.steps={steps}",
            f"checkpoint.every={every}",
            f"run.root={tmp_path / 'ref'}",
        ],
        cwd=REPO,
        env=client_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = tmp_path / "preempt.out"
    run_root = tmp_path / "runs"
    env, marks = slow_saves(cluster.env, tmp_path, seconds=3, steps=(2,))
    env["NODE_LOG_DIR"] = str(tmp_path / "nodes")
    try:
        job = _sbatch_train(cluster, log, run_root, steps, every, env=env)
        cluster.wait(job, lambda i: (marks / "saving_2").exists(), 120, "writing step 2", log)
        cluster.run(["scancel", "--batch", "--signal=USR1", job])
        cluster.wait(job, lambda i: i.get("Restarts") == "1", 90, "requeued", log)
        first = log.read_text()
        # The write in progress finished, and the stop wrote the next step's checkpoint.
        assert (marks / "saved_2").exists() and (marks / "saved_3").exists(), first
        last_logged = rows(run_root)[-1]["step"]
        assert committed_steps(run_root)[-1] == last_logged == 3, (committed_steps(run_root), first)
        # No node's task was cut short: both torchruns ended cleanly after the signal, srun too.
        nodes = _nodes(cluster.root)
        for node in nodes:
            assert f"[torchrun_node {node}] torchrun exited with 0 after SIGUSR1" in first
        assert "training step exited with 0" in first and "srun: error" not in first, first
        assert "SIGUSR1: stopped at step 3" in first

        cluster.release_requeued(job, log)
        cluster.wait_done(job, 180, log)
        ref_out, _ = ref.communicate(timeout=180)
    finally:
        ref.kill()
    assert ref.returncode == 0, ref_out[-4000:]
    text = log.read_text()
    layout = f"on 2 node(s) x 2 rank(s), rendezvous {nodes[0]}:"
    assert f"[train.sbatch] job {job} restart 0 {layout}" in text
    assert f"[train.sbatch] job {job} restart 1 " in text
    assert _resumed(text)[-1:] == [3], tail(log)
    got = metrics(run_root)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    _layout(got[0], nodes)
    _layout(got[3], nodes)  # the resumed run's first row
    want = metrics(tmp_path / "ref")
    assert want[0]["world_size"] == 4 and len(set(want[0]["hosts"])) == 1
    # Same ranks, same data, same gloo reductions (only the transport differs), and a resume
    # that continues the same computation (it restores every piece of training state): the
    # tolerance of the single-node tests that compare runs of one world size.
    np.testing.assert_allclose(
        [r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5, err_msg=text[-3000:]
    )
    for node in nodes:
        node_log = (tmp_path / "nodes" / f"{node}.log").read_text()
        assert f"[torchrun_node {node}] torchrun exited with 0 after SIGUSR1" in node_log
        assert f"[torchrun_node {node}] torchrun exited with 0\n" in node_log


def _sweep(cluster, tmp_path: Path, run_root: Path, steps: int, env=None) -> tuple[str, Path]:
    """sweep_strategies.sh -N 2, one strategy, 1 rank per node; its job id and output file."""
    env = dict(env or cluster.env, SWEEP_NAME="sw", STRATEGIES="ragged_all_to_all")
    out = run(
        [
            str(SLURM_DIR / "sweep_strategies.sh"),
            "-N",
            "2",
            "--cpus-per-task=1",
            f"--output={tmp_path}/%x-%j.out",
            "--",
            *ARGS,
            f"train.steps={steps}",
            "checkpoint.every=1",
            f"run.root={run_root}",
        ],
        env=env,
    ).stdout
    (line,) = out.strip().splitlines()
    strategy, job = line.split()
    assert strategy == "ragged_all_to_all", out
    return job, tmp_path / f"muon-sw-{strategy}-{job}.out"


def test_sweep_two_nodes_survives_a_lost_node_by_resubmitting(cluster, tmp_path):
    """sweep_strategies.sh -N 2 submits one job that trains across both nodes (1 rank each).
    Kill node 2 (its slurmd and every process in its namespace) mid-run: the job fails with a
    clear message, the committed checkpoint stays; the same sweep command again resumes from
    it and finishes. (One sweep carries the claims of the sweep across nodes and of a lost
    node.)"""
    steps = 5
    run_root = tmp_path / "runs"
    # Slow checkpoints (1 s, every step) keep the first job running long enough to be hit.
    slow_env, _ = slow_saves(cluster.env, tmp_path, seconds=1)
    job, log = _sweep(cluster, tmp_path, run_root, steps, env=slow_env)
    cluster.wait(job, lambda i: committed_steps(run_root)[-1:] >= [2], 120, "at step 2", log)
    nodes = _nodes(cluster.root)
    victim = nodes[1]
    inode = (cluster.root / "run" / f"netns-{victim}").read_text().strip()
    holder = int((cluster.root / "run" / f"holder-{victim}.pid").read_text())
    for pid in _ns_members(inode):
        if pid != holder:
            os.kill(pid, signal.SIGKILL)
    # The surviving node's ranks fail at once (their gloo peers are gone), srun reports the
    # node failure (once slurmctld marks the node down) and the batch script ends with its
    # error.
    cluster.wait(
        job, lambda i: "[train.sbatch] ERROR" in log.read_text(), 120, "reported failed", log
    )
    text = log.read_text()
    assert re.search(r"training failed \(exit \d+\)", text), text[-3000:]
    assert "submit the same command again" in text
    assert f"Node failure on {victim}" in text or f"{victim}: task" in text, text[-3000:]
    k = committed_steps(run_root)[-1]
    assert 2 <= k < steps
    first = metrics(run_root)
    assert first[0]["world_size"] == 2 and sorted(first[0]["hosts"]) == nodes, first[0]

    # The node comes back (start restarts its slurmd). Slurm may have requeued the job itself
    # (`--requeue`, node failure): cancel that; the user resubmits the same command.
    run([LOCAL_CLUSTER, "start", str(cluster.root)], cluster.env, 60)
    cluster.wait_idle(90)
    cluster.run(["scancel", job])
    assert cluster.wait_final(job, 60, log)["JobState"] != "COMPLETED"
    job2, log2 = _sweep(cluster, tmp_path, run_root, steps)
    cluster.wait_done(job2, 180, log2)
    assert _resumed(log2.read_text()) == [k], tail(log2)
    got = metrics(run_root)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    resumed_row = got[k]
    assert resumed_row["world_size"] == 2 and sorted(resumed_row["hosts"]) == nodes, resumed_row


def test_submitit_launcher_two_nodes(cluster, tmp_path):
    """python train.py -m hydra/launcher=slurm hydra.launcher.nodes=2: one task per rank; with
    mesh.cp=4 the four ranks share each sequence across the two hosts (the attention's keys
    gathered over both), and the run trains as a one-rank run of the same data does."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    run_root = tmp_path / "runs"
    out = run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=slurm",
            "hydra.launcher.nodes=2",
            "hydra.launcher.partition=debug",
            "hydra.launcher.timeout_min=5",
            "mesh.world_size=4",
            "mesh.cp=4",
            *ARGS,
            "optim.ns_dtype=float32",
            "train.steps=2",
            f"run.root={run_root}",
            "run.name=submitit",
        ],
        env=cluster.env,
        timeout=180,
    )
    got = metrics(run_root / "submitit")
    assert got[-1]["step"] == 2, out.stdout[-3000:]
    # One data-parallel group: the same sequences as one rank reads (mesh.ep=1 there); float32
    # sums in another order only (see tests/e2e/test_train_cp.py for the tolerance)
    one = ["mesh.world_size=1", "mesh.ep=1", "logger=none", *FAST_ARGS]
    one += ["optim.ns_dtype=float32", "train.steps=2"]
    single = run(
        [sys.executable, "train.py", *one, f"run.root={tmp_path / 'one'}"],
        env=client_env(),
        timeout=180,
    )
    want = metrics(tmp_path / "one")
    np.testing.assert_allclose(
        [r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-4, err_msg=single.stdout
    )
    _layout(got[0], _nodes(cluster.root))
    (job_dir,) = {p.parent for p in (run_root / "submitit" / ".submitit").rglob("*_log.out")}
    logs = sorted(job_dir.glob("*_log.out"))
    assert len(logs) == 4  # one per task (rank)
