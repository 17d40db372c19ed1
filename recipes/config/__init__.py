"""The training config: its typed schema, its checks, the run directory's name, its Hydra glue.

`conf/train.yaml` puts `config_schema` first in its defaults list, so every group file and
every command-line override is merged into these types: an unknown key or a value outside an
Enum fails at compose time, naming the key and the allowed values. What types cannot say
(ranges, cross-field rules, files that must exist) `validate` checks, before any rank starts.
Every field carries a one-line help in `metadata["help"]`; `describe()` prints them all.

One module per purpose, every public name re-exported here (`from recipes.config import X`):
- `schema`: the dataclasses and Enums, `OPTIM_SCHEMAS`, `ConfigError`;
- `checks`: `validate` of a composed config, its torch-free first stage `validate_config`;
- `model_checks`: its second stage, `validate_model` (imports models/ and torch when run),
  `check_init_from` (the transformers directory a run starts from);
- `glm_config`: the GLMConfig the config names, `model_config` (models/ imported when called);
- `compose`: the command's config composed before Hydra's run, Hydra's errors as one line
  (`compose_command`, `hydra_error`);
- `preflight`: checks of the run's surroundings any caller may run on their own (`run.name`
  inside `run.root`, on the command line too; token ids below `data.vocab_size`);
- `describe`: the schema as text, one renderer (`schema_lines`, `describe`, `key_help`);
- `help`: `python train.py --help`'s resolvers (`schema_help`: the composed config's keys,
  `config_groups`), registered by `store`;
- `keys`: an unknown key on the command line, with or without `+`, named with the nearest real
  one (`check_command_line`, `known_keys`, `nearest_key`);
- `run_dir`: the run directory's name (`same_run_keys`, `run_id`) and how to pass it back
  (`override_value`, `reuse_export_command`);
- `store`: registration with Hydra and conf/'s resolvers (`register`, `slurm_tasks`), the YAML
  round trip of a resolved config (`to_plain`, `from_yaml`).
Importing the package registers the schema (`register()`).
"""

from recipes.config.checks import validate, validate_config
from recipes.config.describe import describe, key_help
from recipes.config.keys import check_command_line, known_keys, nearest_key
from recipes.config.model_checks import validate_model
from recipes.config.run_dir import (
    RUN_ID_MAX,
    SAME_RUN_GROUPS,
    override_value,
    reuse_export_command,
    run_id,
    same_run_keys,
)
from recipes.config.schema import (
    MUON_SPLIT,
    OPTIM_SCHEMAS,
    ActivationCheckpointing,
    AdamWOptimConfig,
    AdjustLr,
    CheckpointConfig,
    Config,
    ConfigError,
    ConfigSchema,
    DataConfig,
    DataSource,
    Device,
    DsaImpl,
    EvalConfig,
    HFDtype,
    IndexerTraining,
    LoggerBackend,
    LoggerConfig,
    MemoryCheck,
    MeshConfig,
    MetricsConfig,
    ModelConfig,
    ModelPreset,
    MuonOptimConfig,
    MuonSplit,
    NsAlgorithm,
    NsCoefficients,
    NsDtype,
    OptimConfig,
    OptimName,
    RemainderStrategy,
    RouterOptim,
    RunConfig,
    Schedule,
    TokenDtype,
    TrainConfig,
    TrainDtype,
    WandbMode,
)
from recipes.config.store import from_yaml, register, slurm_tasks, to_plain

__all__ = [
    "MUON_SPLIT",
    "OPTIM_SCHEMAS",
    "RUN_ID_MAX",
    "SAME_RUN_GROUPS",
    "ActivationCheckpointing",
    "AdamWOptimConfig",
    "AdjustLr",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "ConfigSchema",
    "DataConfig",
    "DataSource",
    "Device",
    "EvalConfig",
    "HFDtype",
    "IndexerTraining",
    "DsaImpl",
    "LoggerBackend",
    "LoggerConfig",
    "MemoryCheck",
    "MeshConfig",
    "MetricsConfig",
    "ModelConfig",
    "ModelPreset",
    "MuonOptimConfig",
    "MuonSplit",
    "NsAlgorithm",
    "NsCoefficients",
    "NsDtype",
    "OptimConfig",
    "OptimName",
    "RemainderStrategy",
    "RouterOptim",
    "RunConfig",
    "Schedule",
    "TokenDtype",
    "TrainConfig",
    "TrainDtype",
    "WandbMode",
    "check_command_line",
    "describe",
    "from_yaml",
    "key_help",
    "known_keys",
    "nearest_key",
    "override_value",
    "register",
    "reuse_export_command",
    "run_id",
    "same_run_keys",
    "slurm_tasks",
    "to_plain",
    "validate",
    "validate_config",
    "validate_model",
]

register()
