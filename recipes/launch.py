"""Validate a composed config, then join the launcher's world or start a local one.

- Under torchrun / SLURM (RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR in the environment) the
  current process is one rank: it joins that world. Every rank ran Hydra; rank 0's run dir is
  broadcast so all agree on it. A submitit job of several tasks (Hydra's submitit launcher with
  `hydra.launcher.nodes` > 1) is such a world too: submitit's environment gives each task its
  rank, exported here in torch's variables.
- Otherwise `mesh.world_size` ranks are started here by the project's local-world runner,
  `recipes.world.run_world` (one fresh world per call, so Hydra multirun jobs each get
  their own; no deadline; SIGTERM / SIGINT to this process stop the ranks with a checkpoint).
  Ranks receive the resolved config as a YAML string, never Hydra objects.
Devices: CUDA + NCCL when `mesh.device` allows and enough GPUs are present, else CPU + gloo.
"""

import faulthandler
import logging
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from recipes.config import from_yaml, reuse_export_command, validate
from recipes.memory_check import measure as measure_step
from recipes.world import WorldError, WorldStopped, run_world
from recipes.world_faults import set_collective_timeout

log = logging.getLogger("recipes")
_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
# How long the local world's ranks get to checkpoint and exit once stopped (a signal, or the
# launching process failing) before they are killed: torchrun's grace in the SLURM scripts
# (SHUTDOWN_TIMEOUT in scripts/slurm/train.sbatch).
STOP_GRACE_S = 90.0


def export_submitit_world() -> None:
    """In a submitit job of several tasks, set RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK
    and LOCAL_WORLD_SIZE from submitit's environment (first node hosts the rendezvous)."""
    if "SUBMITIT_FOLDER" not in os.environ or any(k in os.environ for k in _RANK_ENV):
        return
    import submitit

    if submitit.JobEnvironment().num_tasks > 1:
        # Every rank keeps all of its node's GPUs visible and picks cuda:LOCAL_RANK.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def _submitit_preempt_signals() -> list[str]:
    """Submitit's preemption signal (USR2 unless SUBMITIT_PREEMPT_SIGNAL), in a submitit job.

    Slurm sends it to every process of the job; the job's own process handles it (requeue) and
    then stops the local world with SIGTERM, which the ranks answer with a checkpoint. Ranks
    started here ignore it: its default action would kill them on the spot.
    """
    if "SUBMITIT_FOLDER" not in os.environ:
        return []
    return ["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").removeprefix("SIG")]


def launcher_world_size() -> int | None:
    """WORLD_SIZE when a launcher (torchrun, SLURM via the submitit launcher) started us."""
    export_submitit_world()
    if all(k in os.environ for k in _RANK_ENV):
        return int(os.environ["WORLD_SIZE"])
    return None


def choose_device(device: str, ranks_on_this_node: int) -> str:
    """ "cuda" when allowed and this node has a GPU per local rank, else "cpu"."""
    if device == "cpu":
        return "cpu"
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= ranks_on_this_node
    return "cuda" if enough or device == "cuda" else "cpu"


def run(cfg: DictConfig) -> float | None:
    """Validate `cfg` and train; returns the last loss (rank 0 / local launcher), else None."""
    env_world = launcher_world_size()
    validate(cfg, env_world_size=env_world, overrides=HydraConfig.get().overrides.task)
    payload = {
        "config": OmegaConf.to_yaml(cfg, resolve=True),
        "run_dir": str(Path(HydraConfig.get().runtime.output_dir).resolve()),
    }
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if env_world else cfg.mesh.world_size
    payload["device"] = choose_device(str(cfg.mesh.device), ranks_here)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one check per machine
        # In a rank of its own, also under a launcher: the estimate's fake process group
        # must leave no state in a process that joins the real world next (a 2-node torchrun
        # job's checkpoint plan lost a rank's shards after an in-process estimate).
        measure_step(cfg, payload["config"], payload["device"], ranks_here, forked=True)
    if int(os.environ.get("RANK", "0")) == 0:
        _hold_run_dir(Path(payload["run_dir"]))  # before anything is written into it
        write_run_config(Path(payload["run_dir"]), payload["config"])
    if env_world is not None:
        from torch.distributed.elastic.multiprocessing.errors import record

        result = record(rank_main)(payload)  # torchrun reports the rank's traceback from it
    else:
        # Ctrl-C reaches every process of the terminal's group: the ranks wait for the SIGTERM
        # this process sends them, which they answer with a checkpoint.
        payload["ignore_signals"] = ["SIGINT", *_submitit_preempt_signals()]
        result = _launch_local(cfg.mesh.world_size, payload)
    if result is None:
        return None
    print(f"[summary] {payload['run_dir']}: {result['text']}", flush=True)
    if result.get("stopped"):  # the run guard ended it (recipes.guards): no export written
        raise SystemExit(f"train.py: stopped: {result['stopped']}")
    export = Path(payload["run_dir"]) / "hf"
    if (export / "config.json").is_file():
        print(f"[summary] start a run from this export: {reuse_export_command(export)}", flush=True)
    return result.get("loss_last")


def _hold_run_dir(run_dir: Path) -> None:
    """One run per run directory (recipes.runlock): a second start exits here, naming the
    process that holds it, before it writes or starts anything."""
    from recipes.runlock import RunDirInUse, hold

    try:
        hold(run_dir)
    except RunDirInUse as err:
        raise SystemExit(f"train.py: {err}") from None


def write_run_config(run_dir: Path, resolved_yaml: str) -> None:
    """Rank 0, after validation: the resolved config and the command's overrides.

    Hydra's own `.hydra/` output is off (conf/train.yaml): it would be written before the
    config is validated, over the files of the run being resumed. A restart whose config
    differs (another world size, say) keeps the earlier config as `config.<n>.yaml`.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    if path.exists() and path.read_text() != resolved_yaml:
        n = 1 + len(list(run_dir.glob("config.*.yaml")))
        path.rename(run_dir / f"config.{n}.yaml")
    path.write_text(resolved_yaml)
    overrides = HydraConfig.get().overrides.task
    (run_dir / "overrides.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))


def _launch_local(world_size: int, payload: dict[str, Any]) -> dict[str, Any] | None:
    """`world_size` fresh local ranks run `rank_main` to the end (no deadline); rank 0's result.

    Non-daemonic ranks, so they may start processes of their own (dataloader workers, a
    checkpoint writer); backend None: rank_main joins the group from the environment, NCCL on
    `cuda:<local rank>` or gloo. Every failure ends in SystemExit with a message, never another
    exception: Hydra's submitit launcher pickles this job's result, and the waiting
    `train.py -m` must be able to read it (or, exiting without one, wait for the requeued run).
    """
    try:
        results = run_world(
            rank_main,
            world_size,
            payload,
            backend=None,
            timeout_s=None,
            threads=1 if payload["device"] == "cpu" else None,
            daemon=False,
            stop_signals=(signal.SIGTERM, signal.SIGINT),
            grace_s=STOP_GRACE_S,
            rank_log=str(Path(payload["run_dir"]) / "logs" / "rank_{rank}.log"),
        )
    except WorldStopped as err:
        # Slurm ending or requeueing the job, or Ctrl-C: the ranks were asked to checkpoint.
        late = f", rank(s) {err.killed} killed {err.when}" if err.killed else ""
        raise SystemExit(
            f"train.py: stopped by {err.signal_name} (the ranks were stopped{late}; "
            "the run resumes from its latest committed checkpoint when the same command runs "
            "again)"
        ) from None
    except WorldError as err:
        sys.exit(f"train.py: rank {err.rank} {err.reason}:\n{err.detail}")
    return results[0]


_FILE_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-log format


def setup_logging(rank: int, run_dir: Path) -> logging.Logger:
    """Console: rank 0's lines and every rank's warnings, prefixed `[rank<k>]`. Run dir:
    rank 0's lines in train.log (Hydra's job log, appended to), each rank's warnings and
    errors (Python warnings and other libraries' included) in logs/rank_<k>.log.
    Returns a file-only logger for this rank's failure (the launcher prints it on the console).
    """

    def handler(h: logging.Handler, level: int, fmt: str) -> logging.Handler:
        h.setLevel(level)
        h.setFormatter(logging.Formatter(fmt))
        h.recipes_rank = rank  # ours: replaced, not stacked, when set up again in a process
        return h

    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    files = [
        handler(
            logging.FileHandler(run_dir / "logs" / f"rank_{rank}.log"),
            logging.WARNING,
            _FILE_FORMAT,
        )
    ]
    if rank == 0:
        files.append(
            handler(logging.FileHandler(run_dir / "train.log"), logging.INFO, _FILE_FORMAT)
        )
    console = handler(logging.StreamHandler(sys.stdout), logging.INFO, f"[rank{rank}] %(message)s")
    stderr = handler(
        logging.StreamHandler(sys.stderr),
        logging.WARNING,
        f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
    )
    logger = logging.getLogger("recipes")
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    _replace(logger, [console, *files])
    # Everything else (torch, Python warnings through logging): this rank's file and stderr.
    # Under torchrun, rank 0's root logger also holds Hydra's handlers; they stay.
    root = logging.getLogger()
    _replace(root, [files[0]] + ([] if _has_console(root) else [stderr]))
    for name, other in list(logging.root.manager.loggerDict.items()):
        # torch's loggers print to stderr themselves and do not propagate to the root
        torch_own = name.split(".")[0] == "torch" and isinstance(other, logging.Logger)
        if torch_own and not other.propagate:
            _replace(other, [files[0]])
    logging.captureWarnings(True)
    # A crash (SIGSEGV, SIGABRT, ...) leaves every thread's Python stack in the rank's file,
    # whose last lines the launcher reports.
    faulthandler.enable(files[0].stream, all_threads=True)
    failure = logging.getLogger("recipes.failure")
    failure.propagate = False
    _replace(failure, files)
    return failure


def _has_console(logger: logging.Logger) -> bool:
    return any(
        type(h) is logging.StreamHandler and not hasattr(h, "recipes_rank") for h in logger.handlers
    )


def _replace(logger: logging.Logger, handlers: list[logging.Handler]) -> None:
    for old in [h for h in logger.handlers if hasattr(h, "recipes_rank")]:
        logger.removeHandler(old)
        old.close()
    for h in handlers:
        logger.addHandler(h)


def rank_main(payload: dict[str, Any]) -> dict[str, Any] | None:
    """One rank: join the world, train, return rank 0's summary (None on other ranks)."""
    from recipes.trainer import Trainer

    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    for name in payload.get("ignore_signals", ()):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    # torch's own FSDP/DTensor internals call the deprecated collective names, once per rank.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use", category=FutureWarning
    )
    cfg = from_yaml(payload["config"])
    # every process group's (torch gives groups made later its own 30-minute gloo default)
    timeout = set_collective_timeout(float(cfg.mesh.collective_timeout_s))
    if payload["device"] == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        if os.environ.get("OMP_NUM_THREADS") == "1":
            torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timeout)
    try:
        box = [payload["run_dir"]]
        dist.broadcast_object_list(box, src=0)  # torchrun: every rank ran Hydra; rank 0 wins
        run_dir = Path(box[0])
        failure = setup_logging(rank, run_dir)
        try:
            return Trainer(cfg, run_dir, device).train()
        except BaseException as err:
            failure.error("rank %d failed: %r", rank, err, exc_info=True)
            raise
    finally:
        # A stop request that comes after training (scripts/slurm/torchrun_node.sh resends it
        # until torchrun exits) must not kill a rank on its way out: Python puts back the
        # default action, termination, for the signals it handled when it finalizes.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        dist.destroy_process_group()
