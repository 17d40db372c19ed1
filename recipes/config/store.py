"""How a composed config meets Hydra and the workers: the schemas and conf/'s resolvers
registered (`register`), the SLURM launcher's task layout (`slurm_tasks`), and the round trip
of the resolved config through YAML (`to_plain`, `from_yaml`).
"""

from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from recipes.config.run_dir import run_id, same_run_keys
from recipes.config.schema import OPTIM_SCHEMAS, ConfigError, ConfigSchema


def register() -> None:
    """Register the schemas and the resolvers of conf/train.yaml (idempotent)."""
    from recipes.config.help import config_groups, schema_help

    store = ConfigStore.instance()
    store.store(name="config_schema", node=ConfigSchema)
    for name, node in OPTIM_SCHEMAS.items():
        store.store(group="schema/optim", name=name, node=node)
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id)
    if not OmegaConf.has_resolver("schema_help"):
        OmegaConf.register_new_resolver("schema_help", schema_help)
    if not OmegaConf.has_resolver("config_groups"):
        OmegaConf.register_new_resolver("config_groups", config_groups)
    if not OmegaConf.has_resolver("same_run_keys"):
        OmegaConf.register_new_resolver("same_run_keys", same_run_keys)
    if not OmegaConf.has_resolver("slurm_tasks"):
        OmegaConf.register_new_resolver("slurm_tasks", slurm_tasks)


def slurm_tasks(what: str, world_size: int, nodes: int) -> int:
    """Tasks per node or CPUs per task of a submitit job (conf/hydra/launcher/slurm.yaml).

    One node: one task that starts a local world of `world_size` ranks, one CPU per rank.
    Several nodes: one task per rank (submitit's environment gives each its rank), so
    `world_size` must split evenly over `nodes`.
    """
    if nodes < 1 or world_size % nodes:
        raise ConfigError(
            f"hydra.launcher.nodes={nodes} must be a positive divisor of "
            f"mesh.world_size={world_size} (every node runs world_size / nodes ranks)"
        )
    if what == "tasks_per_node":
        return 1 if nodes == 1 else world_size // nodes
    if what == "cpus_per_task":
        return world_size if nodes == 1 else 1
    raise ValueError(f"slurm_tasks: unknown field {what!r} (tasks_per_node, cpus_per_task)")


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data (enums as their values)."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def from_yaml(text: str) -> DictConfig:
    """Rebuild a typed config from the resolved YAML a worker receives."""
    plain = OmegaConf.create(text)
    schema = OPTIM_SCHEMAS[str(OmegaConf.select(plain, "optim.name", default="muon"))]
    return OmegaConf.merge(
        OmegaConf.structured(ConfigSchema), {"optim": OmegaConf.structured(schema)}, plain
    )
