"""Train a GLM-style MoE with distributed Muon: `python train.py [hydra overrides]`.

Composes `conf/` (typed by recipes/config/) and checks it without torch
(`recipes.config.compose.preflight`: unknown keys, Hydra's errors as one line, the torch-free
checks); then starts the local world's fork server (its torch import runs beside Hydra's
composition), validates the model, and joins the launcher's world (torchrun / SLURM env) or
starts a local one of `mesh.world_size` ranks. See README.md.
"""

import contextlib
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

# torch-free (recipes/config/): registers the schema and the run-dir resolver
from recipes import config as _config
from recipes.config.compose import preflight
from recipes.config.preflight import check_path_overrides

_HYDRA_ONLY = ("-h", "--help", "--hydra-help", "-c", "--cfg", "--info", "-sc", "--shell-completion")


def starts_a_local_world(argv: list[str]) -> bool:
    """No launcher's world to join (torchrun, Slurm), no job for another Hydra launcher, no
    help or config printout asked instead of training."""
    launched = "RANK" in os.environ or "SUBMITIT_FOLDER" in os.environ
    asked = any(a in _HYDRA_ONLY or a.startswith("hydra/launcher=") for a in argv)
    return not (launched or asked)


if os.environ.get("RANK", "0") != "0" and __name__ == "__main__":
    # Under torchrun/SLURM every rank runs this file; only rank 0 writes Hydra's output.
    sys.argv += ["hydra/job_logging=none", "hydra/hydra_logging=none"]


@hydra.main(config_path="conf", config_name="train", version_base=None)
def main(cfg: DictConfig) -> float | None:
    """Validate and run one training job; returns the final loss (for sweepers)."""
    from recipes.launch import run

    try:
        return run(cfg)
    except _config.ConfigError as err:
        _drop_empty_run_dir()
        sys.exit(f"train.py: config error: {err}")


def _drop_empty_run_dir() -> None:
    """Hydra made the run dir and an empty train.log before validation; a rejected command
    leaves nothing behind (a dir holding anything else, e.g. a run to resume, stays)."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    log_file = run_dir / "train.log"
    if [p.name for p in run_dir.iterdir()] == ["train.log"] and log_file.stat().st_size == 0:
        log_file.unlink()
        run_dir.rmdir()
        with contextlib.suppress(OSError):
            run_dir.parent.rmdir()  # the run family's dir, when this was its only run


def cli(argv: list[str]) -> None:
    """train.py's command line: the checks that need no torch (`preflight`), then the local
    world's fork server (its torch import runs on another core while Hydra composes), then
    Hydra's run (`main`, which reads sys.argv itself)."""
    try:  # a bad override's one line within a second (docs/training.md)
        check_path_overrides(argv)  # sweeps too, before Hydra makes a run dir from run.name
        preflight(argv)
    except _config.ConfigError as err:
        sys.exit(f"train.py: config error: {err}")
    if starts_a_local_world(argv):
        from recipes.world import start_fork_server

        start_fork_server()
    main()


if __name__ == "__main__":
    cli(sys.argv[1:])
