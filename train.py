"""Train a GLM-style MoE with distributed Muon: `python train.py [hydra overrides]`.

Composes `conf/` (typed by recipes/config.py), validates it, then joins the launcher's world
(torchrun / SLURM env) or starts a local one of `mesh.world_size` ranks. See README.md.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from recipes import config as _config  # registers the schema and the run-dir resolver

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
        sys.exit(f"train.py: config error: {err}")


if __name__ == "__main__":
    main()
