"""Multirun job directories: every key a sweep varies shows in its jobs' directory names.

A single run's directory leaves out the keys that do not change what is trained (mesh.*,
checkpoint.*, logging: the `same_run` fields of recipes/config/schema.py, which
conf/train.yaml's `exclude_keys` resolves to), so a restart on another world size
resumes the same run. A sweep over one of those keys (`-m mesh.ep=1,2,4`) must still give
each job its own directory, checkpoints and W&B run. `SweepDirs.on_multirun_start`, a Hydra
callback that runs in the `-m` process before the sweeper starts any job:

- removes the swept keys from `exclude_keys`, for the sweep and (as a hydra override, which
  Hydra passes to every job it composes, also under the submitit launcher) for each job;
- composes every job's config, as the sweeper will, and fails when two jobs would share a
  directory or when a job's config is invalid (recipes.config.validate), so nothing starts.

The same `-m` command again gives the same directories: each job resumes its own run.
"""

import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from recipes.config import ConfigError, validate
from recipes.config.compose import hydra_error

EXCLUDE_KEYS = "hydra.job.config.override_dirname.exclude_keys"
_BASIC_SWEEPER = f"{BasicSweeper.__module__}.{BasicSweeper.__name__}"


def swept_keys(config: DictConfig) -> list[str]:
    """Keys (or groups) the sweep varies: command-line sweeps and `hydra.sweeper.params`."""
    return sorted({o.key_or_group for o in _overrides(config) if o.is_sweep_override()})


def _overrides(config: DictConfig) -> list:
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    lines = [f"{k}={v}" for k, v in params.items()]
    lines += list(config.hydra.overrides.task)
    return OverridesParser.create().parse_overrides(lines)


def job_dir(job_config: DictConfig) -> Path:
    """The directory a composed job config trains in (Hydra's sweep dir / subdir)."""
    sweep = job_config.hydra.sweep
    return Path(sweep.dir) / str(sweep.subdir)


def job_configs(config: DictConfig) -> list[tuple[list[str], DictConfig]]:
    """(overrides, composed config) of every job of the sweep, in the sweeper's order; a job
    Hydra cannot compose raises ConfigError naming it."""
    loader = GlobalHydra.instance().config_loader()
    (jobs,) = BasicSweeper.split_arguments(_overrides(config), None)  # one batch of all jobs
    composed = []
    for job in jobs:
        try:
            composed.append((job, loader.load_sweep_config(config, job)))
        except (HydraException, OmegaConfBaseException) as err:  # Hydra's: one line
            raise ConfigError(f"sweep job [{' '.join(job)}]: {hydra_error(err, job)}") from None
    return composed


def check_jobs(config: DictConfig) -> None:
    """Raise ConfigError when a job's config is invalid or two jobs would share a directory."""
    seen: dict[Path, list[str]] = {}
    for overrides, job in job_configs(config):
        where = " ".join(overrides) or "(no overrides)"
        path = job_dir(job).resolve()
        with open_dict(job):
            del job["hydra"]  # the task function's view of the config
        try:
            # The launching process may not be the node that trains (submitit): no device check.
            validate(job, check_devices=False, overrides=overrides)
        except ConfigError as err:
            raise ConfigError(f"sweep job [{where}]: {err}") from None
        if path in seen:
            raise ConfigError(
                f"sweep jobs [{' '.join(seen[path])}] and [{where}] would share the run directory "
                f"{path}: sweep over values that differ (the directory name keeps "
                "each swept key's value, every character but letters, digits and ._+@%- as '_')"
            )
        seen[path] = overrides


class SweepDirs(Callback):
    """Hydra callback (conf/train.yaml `hydra.callbacks`): see the module docstring."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        swept = set(swept_keys(config))
        exclude = list(OmegaConf.select(config, EXCLUDE_KEYS))
        keep = [key for key in exclude if key not in swept]
        if keep != exclude:
            with read_write(config), open_dict(config):
                OmegaConf.update(config, EXCLUDE_KEYS, keep, merge=False)
                config.hydra.overrides.hydra.append(f"{EXCLUDE_KEYS}=[{','.join(keep)}]")
        if OmegaConf.select(config, "hydra.sweeper._target_") != _BASIC_SWEEPER:
            return  # another sweeper picks its jobs as it goes: nothing to expand up front
        try:
            check_jobs(config)
        except ConfigError as err:
            sys.exit(f"train.py: config error: {err}")
