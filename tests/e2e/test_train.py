"""`python train.py` end to end, the way users run it: 4 CPU ranks, multirun, kill and resume."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from recipes import checkpoint
from recipes.config import from_yaml
from tests.harness import run_world
from tests.train_cli import start_train_py

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """A token cache built once here, so the runs below only read it."""
    from recipes.data import build_stdlib_tokens

    path = tmp_path_factory.mktemp("token-cache")
    build_stdlib_tokens(str(path))
    return str(path)


def _small(cache: str) -> list[str]:
    return [
        "data.seq_len=32",
        "data.batch_size=2",
        f"data.cache_dir={cache}",
        "train.warmup_steps=1",
    ]


def _train_py(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    return start_train_py(args, cwd, **popen)


def _finish(proc: subprocess.Popen, timeout: float = 420) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _optim_state(ckpt: Path) -> dict:
    return checkpoint.read_optimizer_state(ckpt)["state"]


def _assert_same(a, b, path=""):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def test_multirun_strategies_ep2_memory_wandb_and_nan_skip(strategy_sweep):
    """One `-m` sweep (tests/conftest.py): a world per remainder strategy (4 ranks, ep=2), W&B
    offline; a NaN gradient injected at step 2 is skipped and leaves parameters and Muon state
    unchanged."""
    sweep, out = strategy_sweep
    assert out.count("[summary]") == 3
    runs = {s: next(sweep.glob(f"*remainder_strategy-{s}+*")) for s in STRATEGIES}
    losses = {}
    for strategy, run_dir in runs.items():
        lines = _metrics(run_dir)
        assert [m["step"] for m in lines] == [1, 2, 3]
        assert [m["skipped"] for m in lines] == [0.0, 1.0, 0.0]
        assert lines[-1]["skipped_steps"] == 1.0
        losses[strategy] = [m["loss"] for m in lines]
        for m in (lines[0], lines[2]):  # measured: steps 1 and 3
            for rank in range(4):
                for key in ("step_peak_mib", "optim_peak_mib"):
                    assert m[f"memory/rank_{rank}/{key}"] > 0, (strategy, rank, key)
            assert m["memory/step_peak_mib/max"] >= m["memory/step_peak_mib/min"] > 0
        assert not any(k.startswith("memory/rank_") for k in lines[1])
        assert {"muon/bytes_sent", "muon/wait_s", "step_s", "optim_s", "lr"} <= lines[0].keys()
        # W&B offline: one run in the run dir, with per-rank memory and the grouping key.
        (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
        blob = wandb_file.read_bytes()
        assert b"memory/rank_3/optim_peak_mib" in blob and strategy.encode() in blob
        assert OmegaConf.load(run_dir / "config.yaml").optim.remainder_strategy == strategy
        # The skipped step changed nothing: step 1 and step 2 checkpoints hold the same state.
        ckpts = checkpoint.committed(run_dir / "checkpoints")
        assert [c.name for c in ckpts] == ["step_00000001", "step_00000002", "step_00000003"]
        m1, m2, m3 = (checkpoint.read_model_state(c) for c in ckpts)
        _assert_same(m1, m2)
        assert any(not torch.equal(m2[k], m3[k]) for k in m2)
        _assert_same(_optim_state(ckpts[0]), _optim_state(ckpts[1]))
    # The strategies move data differently but compute the same update: one gradient reduction,
    # the same matrices orthogonalized in float32, only on other ranks and in other batches.
    # A batched vs single float32 matmul may round differently (2^-24), amplified <= 490x by
    # Newton-Schulz (tests/reference.py): 3e-5 of an update that moves the loss ~2.4%, under
    # 1e-6 of the loss (measured: identical).
    np.testing.assert_allclose(losses["agrs"], losses["pad_all2all"], rtol=1e-5)
    np.testing.assert_allclose(losses["agrs"], losses["ragged_all_to_all"], rtol=1e-5)


def test_sweep_over_a_layout_key_trains_every_job(cache, tmp_path):
    """`-m mesh.ep=1,2`: mesh.* stays out of a single run's directory, but a sweep over it
    gives each job its own directory, checkpoints and W&B run (2 ranks, 2 steps, offline)."""
    args = ["-m", "mesh.ep=1,2", "mesh.world_size=2", "train.steps=2", "checkpoint.export_hf=false"]
    out = _finish(_train_py([*args, *_small(cache)], tmp_path))
    assert out.count("[summary]") == 2
    runs = sorted((tmp_path / "default").glob("*mesh.ep-*"))
    assert [r.name.split("mesh.ep-")[1][0] for r in runs] == ["1", "2"], runs
    assert "mesh.world_size" not in runs[0].name  # not swept: still left out
    wandb_ids = set()
    for ep, run_dir in enumerate(runs, start=1):
        assert OmegaConf.load(run_dir / "config.yaml").mesh.ep == ep
        assert [m["step"] for m in _metrics(run_dir)] == [1, 2]  # trained, not resumed
        assert [c.name for c in checkpoint.committed(run_dir / "checkpoints")] == ["step_00000002"]
        (offline,) = run_dir.glob("wandb/offline-run-*")  # one W&B run per job, its own id
        wandb_id = (run_dir / "wandb_id").read_text()
        assert offline.name.endswith(f"-{wandb_id}")
        wandb_ids.add(wandb_id)
    assert len(wandb_ids) == 2


def test_logs_in_the_run_dir(cache, tmp_path):
    """`train.steps=3` on 2 ranks: train.log (Hydra's job log) holds rank 0's lines; the
    warning every rank raises (enable_all2all=false with pad_all2all) is in each rank's file."""
    args = ["train.steps=3", "optim.enable_all2all=false", "checkpoint.export_hf=false"]
    args += ["mesh.world_size=2"]
    out = _finish(_train_py([*args, "logger=none", *_small(cache)], tmp_path))
    (run_dir,) = (tmp_path / "default").iterdir()
    train_log = (run_dir / "train.log").read_text()
    assert "[recipes][INFO] - model tiny" in train_log and "step 3/3 loss" in train_log
    for rank in range(2):
        text = (run_dir / "logs" / f"rank_{rank}.log").read_text()
        assert "enable_all2all=False: remainder_strategy 'pad_all2all' needs all-to-all" in text
        assert "[py.warnings][WARNING]" in text and "INFO" not in text
    assert "[rank1] WARNING py.warnings" in out  # still on the console


def test_killed_run_resumes_exactly_ep1(cache, tmp_path):
    """SIGKILL after the step-2 checkpoint of a 4-step run, its metrics.jsonl's last line then
    cut, then the same command again (with
    `checkpoint.async_mode=true`, which does not change what is trained): the losses and final
    parameters equal an uninterrupted run's (2 ranks, ep=1: resharding across world sizes is
    tests/distributed/test_checkpoint.py's). The schedule decays to `train.min_lr_ratio=0`, so
    the last checkpoint holds lr 0: the same command once more loads it (a ValueError before)."""
    args = [
        "mesh.world_size=2",
        "mesh.ep=1",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.min_lr_ratio=0",
        "checkpoint.every=2",
        "logger=none",
        *_small(cache),
    ]
    args += ["metrics.memory_every=2"]
    _finish(_train_py([*args, "run.name=reference"], tmp_path))

    def run_dir(name):
        return next((tmp_path / name).iterdir())

    proc = _train_py([*args, "run.name=resumed"], tmp_path, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        found = list((tmp_path / "resumed").glob("*/checkpoints/step_00000002/COMMITTED"))
        if found:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank
            break
        time.sleep(0.02)
    proc.communicate(timeout=60)
    assert found and proc.returncode == -signal.SIGKILL
    assert checkpoint.latest(run_dir("resumed") / "checkpoints").name == "step_00000002"
    # A full disk cut the last line the killed run wrote: the resume drops it with a warning.
    with open(run_dir("resumed") / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 4.1870074272')

    # The same command with a checkpointing key changed (async_mode) resumes the same run.
    out = _finish(_train_py([*args, "run.name=resumed", "checkpoint.async_mode=true"], tmp_path))
    assert "resumed from" in out
    assert re.search(r"metrics\.jsonl:\d+: the last line is cut .*dropped", out), out[-3000:]
    ref, res = run_dir("reference"), run_dir("resumed")
    assert ref.name == res.name  # the run dir depends on the overrides, not on run.name
    ref_lines, res_lines = _metrics(ref), _metrics(res)
    assert [m["step"] for m in res_lines] == [1, 2, 3, 4]
    assert [m["loss"] for m in res_lines] == [m["loss"] for m in ref_lines]
    assert ref_lines[-1]["loss"] < ref_lines[0]["loss"]
    final = [checkpoint.latest(d / "checkpoints") for d in (ref, res)]
    assert [c.name for c in final] == ["step_00000004"] * 2
    _assert_same(*(checkpoint.read_model_state(c) for c in final))
    _assert_same(*(_optim_state(c) for c in final))
    # The transformers-layout export of the final model holds the same weights.
    from models.glm.hf.load import import_hf

    _, exported = import_hf(str(res / "hf"))
    weights = checkpoint.read_model_state(final[1])
    for name, tensor in exported.items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name
    # the finished run saved lr 0 (its schedule's end): the same command again resumes from it
    groups = checkpoint.read_optimizer_state(final[1])["param_groups"]
    assert {g["lr"] for g in groups} == {0.0}, [g["lr"] for g in groups]
    again = _finish(_train_py([*args, "run.name=resumed"], tmp_path))
    assert "resumed from" in again, again[-2000:]


def _steps_logged(root: Path, name: str = "default") -> int:
    found = list(root.glob(f"{name}/*/metrics.jsonl"))
    return len(found[0].read_text().splitlines()) if found else 0


def test_local_world_stops_with_a_checkpoint_on_ctrl_c_and_sigterm_then_resumes(cache, tmp_path):
    """The local world (no launcher env): Ctrl-C (SIGINT to the terminal's whole process group)
    and then SIGTERM to the launching process alone (Slurm ending the job) each reach the ranks
    as SIGTERM, which they answer with a checkpoint at the step boundary; train.py exits with
    its stop message; the same command resumes from that checkpoint, each step logged once."""
    args = ["mesh.world_size=2", "mesh.ep=1", "train.steps=500", "checkpoint.every=0"]
    args += ["logger=none", "metrics.memory_every=1000", "metrics.progress=false", *_small(cache)]
    stops = [
        ("SIGINT", lambda proc: os.killpg(proc.pid, signal.SIGINT)),  # the ranks ignore it
        ("SIGTERM", lambda proc: os.kill(proc.pid, signal.SIGTERM)),  # the ranks never get it
    ]
    stopped_at = 0
    for name, send in stops:
        proc = _train_py(args, tmp_path, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                if _steps_logged(tmp_path) >= stopped_at + 3:
                    break
                time.sleep(0.1)
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            send(proc)
            out, _ = proc.communicate(timeout=180)  # the grace (90 s) bounds the ranks' exit
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        (run_dir,) = (tmp_path / "default").iterdir()
        steps = [m["step"] for m in _metrics(run_dir)]
        assert proc.returncode == 1, out[-4000:]
        assert f"SIGTERM: stopped at step {steps[-1]}, checkpoint" in out, out[-4000:]
        assert (
            f"train.py: stopped by {name} (the ranks were stopped; the run resumes from its "
            "latest committed checkpoint when the same command runs again)"
        ) in out, out[-4000:]
        assert "[summary]" not in out and "Traceback" not in out, out[-4000:]
        assert steps == list(range(1, steps[-1] + 1)) and stopped_at + 3 <= steps[-1] < 500
        assert checkpoint.latest(run_dir / "checkpoints").name == f"step_{steps[-1]:08d}"
        assert (f"resumed from {run_dir / 'checkpoints'}" in out) == (stopped_at > 0)
        stopped_at = steps[-1]


def test_local_world_rank_failure_names_the_rank_and_its_traceback(cache, tmp_path):
    """A rank that raises ends train.py with one message: the rank, its exit status and its
    own traceback; no rank is left running. The token cache path is a dangling symlink: the
    checks before spawn see no directory there yet and a writable one above it (a plain file
    there is refused before any rank starts), the rank's mkdir finds the link in the way."""
    (tmp_path / "not_a_dir").symlink_to(tmp_path / "gone" / "cache")
    args = ["mesh.world_size=2", "mesh.ep=1", "logger=none", "data.seq_len=32"]
    args.append(f"data.cache_dir={tmp_path / 'not_a_dir'}")
    proc = _train_py(args, tmp_path, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert err.count("train.py: rank ") == 1, err[-4000:]
    header = re.search(r"train\.py: rank (\d) raised:\nTraceback", err)
    assert header, err[-4000:]
    assert "in rank_main" in err and "FileExistsError: " in err, err[-4000:]


def _rank_pids(launcher: int) -> list[int]:
    """The local world's ranks: the children of train.py's fork server, by pid (forked one
    after another in rank order)."""

    def children(pid: int) -> list[int]:
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(stat.parent.name))
            except (OSError, IndexError, ValueError):
                continue
        return sorted(found)

    for server in children(launcher):
        try:
            if b"forkserver" in Path(f"/proc/{server}/cmdline").read_bytes():
                return children(server)
        except OSError:
            continue
    return []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_frozen_rank_is_the_one_named(cache, tmp_path):
    """SIGSTOP of rank 1 mid-run: its peer's collectives time out after
    `mesh.collective_timeout_s=5` and train.py names rank 1 as stopped (not the peer that timed
    out), and the run ends (the test's own timeout is the bound)."""
    args = ["mesh.world_size=2", "mesh.ep=1", "train.steps=500", "checkpoint.every=0"]
    args += ["logger=none", "metrics.memory_every=1000", "metrics.progress=false"]
    args += ["mesh.collective_timeout_s=5", *_small(cache)]
    # kill -9 of a rank: tests/distributed/test_harness.py (the same runner, train.py's message)
    for how, reason in [
        (signal.SIGSTOP, r"stopped responding \(pid {pid}, process state: stopped\)"),
    ]:
        name = f"run-{how.name}"
        proc = _train_py([*args, f"run.name={name}"], tmp_path, start_new_session=True)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and proc.poll() is None:
                if (
                    len(list((tmp_path / name).glob("*/metrics.jsonl")))
                    and _steps_logged(tmp_path, name) >= 2
                ):
                    break
                time.sleep(0.1)
            pids = _rank_pids(proc.pid)
            assert proc.poll() is None and len(pids) == 2, (pids, proc.poll())
            os.kill(pids[1], how)
            out, _ = proc.communicate(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for pid in _rank_pids(proc.pid):
                os.kill(pid, signal.SIGKILL)
        assert proc.returncode == 1, out[-4000:]
        head = re.search(rf"train\.py: rank 1 {reason.format(pid=pids[1])}", out)
        assert head, out[-4000:]
        assert "the other ranks' failures, which follow from rank 1's:\n  rank 0: " in out


def _nan_world(config_yaml: str, run_dir: str):
    from recipes.config import from_yaml
    from recipes.trainer import Trainer

    cfg = from_yaml(config_yaml)
    finished = Trainer(cfg, Path(run_dir), torch.device("cpu")).train() is not None
    # A restart that starts over: the old run is set aside, the new one trains 1 step (its
    # checkpoint at step 1 is older by step than the old run's, which rotation would delete).
    cfg.checkpoint.resume, cfg.train.steps, cfg.checkpoint.keep = False, 1, 2
    Trainer(cfg, Path(run_dir), torch.device("cpu")).train()
    cfg.checkpoint.resume = True  # then the same command again resumes the new run
    again = Trainer(cfg, Path(run_dir), torch.device("cpu"))
    again.resume()
    return finished, again.step


def test_nan_step_skipped_with_adamw(cache, tmp_path):
    """optim=adamw: the loop itself skips the poisoned step (2 ranks, ep=1, Trainer direct)."""
    cfg = from_yaml("optim: {name: adamw}")  # the AdamW schema with its defaults
    overrides = ["optim.lr=0.003", "mesh.world_size=2", "mesh.ep=1"]
    overrides += ["train.steps=4", "train.inject_nan_at_step=2", "checkpoint.every=1"]
    overrides += ["checkpoint.keep=4", "checkpoint.export_hf=false", "logger.backend=none"]
    overrides += ["metrics.memory_every=100", "metrics.log_every=2", *_small(cache)]
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(overrides))
    (finished, resumed_step), _ = run_world(_nan_world, 2, OmegaConf.to_yaml(cfg), str(tmp_path))
    assert finished and resumed_step == 1
    new_run = checkpoint.committed(tmp_path / "checkpoints")
    assert [c.name for c in new_run] == ["step_00000001"]
    assert [m["step"] for m in _metrics(tmp_path)] == [1]
    old_run = tmp_path / "replaced-1"  # the first run, whole, set aside by resume=false
    lines = _metrics(old_run)
    assert [m["step"] for m in lines] == [1, 2, 4]  # log_every=2, plus the measured step 1
    assert [m["skipped"] for m in lines] == [0.0, 1.0, 0.0]
    assert np.isnan(lines[1]["grad_norm"]) and np.isfinite(lines[2]["grad_norm"])
    ckpts = checkpoint.committed(old_run / "checkpoints")
    m1, m2, m3, _ = (checkpoint.read_model_state(c) for c in ckpts)
    _assert_same(m1, m2)
    assert any(not torch.equal(m2[k], m3[k]) for k in m2)
    o1, o2 = (_optim_state(c) for c in ckpts[:2])
    _assert_same(o1, o2)  # AdamW moments and step counts untouched


def test_torchrun_world_checkpoints_and_stops_on_sigterm(cache, tmp_path):
    """Under torchrun (the SLURM path) every rank runs train.py and joins the launcher's world;
    SIGTERM (Slurm's preemption), forwarded to the ranks, commits a checkpoint and ends the run
    cleanly. SIGUSR1, the batch script's early warning, takes the same path
    (tests/slurm/test_slurm.py sends it through a real Slurm)."""
    args = ["mesh.world_size=2", "mesh.ep=1", "train.steps=500", "checkpoint.every=0"]
    # Muon knobs that only pass through, run once end to end here.
    args += ["optim.router=muon", "optim.max_inflight=1", "optim.enable_all2all=false"]
    args += ["optim.remainder_strategy=agrs", "optim.nesterov=false", "optim.adjust_lr=original"]
    args += ["logger=none", "metrics.memory_every=1000", "metrics.progress=false"]
    args += [*_small(cache), f"run.root={tmp_path}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0"]
    proc = subprocess.Popen(
        [*cmd, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    metrics = []
    while time.monotonic() < deadline and proc.poll() is None and len(metrics) < 3:
        metrics = list(tmp_path.glob("default/*/metrics.jsonl"))
        metrics = metrics and metrics[0].read_text().splitlines()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGTERM)  # torchrun forwards it to both ranks
    out, _ = proc.communicate(timeout=120)  # torchrun itself then exits with SignalException
    assert "SIGTERM: stopped at step" in out and "[summary]" in out, out[-4000:]
    (run_dir,) = (tmp_path / "default").iterdir()
    ckpt = checkpoint.latest(run_dir / "checkpoints")
    steps = [m["step"] for m in _metrics(run_dir)]
    assert 3 <= steps[-1] < 500 and ckpt.name == f"step_{steps[-1]:08d}"
    assert json.loads((ckpt / "trainer.json").read_text())["world_size"] == 2
    assert not (run_dir / "hf").exists()  # exported only when the run completes
    assert OmegaConf.load(run_dir / "config.yaml").optim.router == "muon"


def test_mla_dsa_mtp_run_logs_each_loss(cache, tmp_path):
    """`model=mla_tiny` (seq_len 32 > index_topk 16) on 2 ranks, swept over
    train.mtp_loss_weight=0,0.3: `loss` is the next-token loss (the same at step 1, before
    any update, whatever the weight), `mtp_loss` is logged and summarized only when the MTP
    layer runs, `indexer_kl` always (the default indexer_training=kl)."""
    args = ["-m", "model=mla_tiny", "train.mtp_loss_weight=0,0.3", "mesh.world_size=2"]
    args += ["mesh.ep=1", "train.steps=3", "checkpoint.export_hf=false", "logger=none"]
    out = _finish(_train_py([*args, *_small(cache)], tmp_path))
    assert out.count("[summary]") == 2
    runs = sorted((tmp_path / "default").glob("*mtp_loss_weight-*"))
    weights = [r.name.split("mtp_loss_weight-")[1].split("+")[0] for r in runs]
    assert weights == ["0", "0.3"], runs
    off, on = (_metrics(r) for r in runs)
    assert all("mtp_loss" not in m and m["indexer_kl"] > 0 for m in off)
    assert all(m["mtp_loss"] > 0 and m["indexer_kl"] > 0 for m in on)
    assert off[0]["loss"] == on[0]["loss"]
    assert off[-1]["loss"] != on[-1]["loss"]  # the MTP gradient reaches the shared trunk
    summaries = [line for line in out.splitlines() if "[summary]" in line]
    assert sum("; mtp_loss " in s for s in summaries) == 1, summaries
    assert all("; indexer_kl " in s for s in summaries), summaries


def _resume_world(config_yaml: str, run_dir: str):
    """Train `train.steps` (resuming what the run dir holds); rank 0's warnings from the
    'recipes' logger."""
    import logging

    from recipes.trainer import Trainer

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("recipes").addHandler(handler)
    try:
        Trainer(from_yaml(config_yaml), Path(run_dir), torch.device("cpu")).train()
    finally:
        logging.getLogger("recipes").removeHandler(handler)
    return records


def test_resume_on_another_world_size_says_the_global_batch_changed(cache, tmp_path):
    """A run checkpointed on 2 ranks and resumed on 1 (2 samples per rank): rank 0 warns that
    the global batch goes from 4 to 2 samples per step; the same world warns nothing."""
    overrides = ["mesh.ep=1", "train.steps=1", "checkpoint.export_hf=false", *_small(cache)]
    overrides += ["logger.backend=none", "checkpoint.every=1", "model.preset=tiny"]
    cfg = OmegaConf.merge(from_yaml(""), OmegaConf.from_dotlist(overrides))
    cfg.mesh.world_size = 2
    first, _ = run_world(_resume_world, 2, OmegaConf.to_yaml(cfg), str(tmp_path))
    cfg.mesh.world_size, cfg.train.steps = 1, 2
    (resumed,) = run_world(_resume_world, 1, OmegaConf.to_yaml(cfg), str(tmp_path))
    assert not [m for m in first if "global batch" in m], first
    (notice,) = [m for m in resumed if "global batch" in m]
    assert "on 1 data-parallel ranks from a checkpoint of 2" in notice, notice
    assert "from 4 to 2 samples" in notice
