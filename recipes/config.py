"""The training config schema: typed dataclasses registered with Hydra's ConfigStore.

`conf/train.yaml` puts `config_schema` first in its defaults list, so every group file and
every command-line override is merged into these types: an unknown key or a value outside an
Enum fails at compose time, naming the key and the allowed values. What types cannot say
(ranges, cross-field rules, files that must exist) `validate` checks, before any rank starts.
Every field carries a one-line help in `metadata["help"]`; `describe()` prints them all.
"""

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf


class ConfigError(ValueError):
    """A config value that composes but cannot run; the message names the key."""


def _f(default: Any, help: str, factory: bool = False) -> Any:
    """A dataclass field with its one-line help."""
    if factory:
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


class ModelPreset(StrEnum):
    tiny = "tiny"
    small = "small"
    glm45_air = "glm45_air"
    glm52 = "glm52"


class OptimName(StrEnum):
    muon = "muon"
    adamw = "adamw"


class RemainderStrategy(StrEnum):
    agrs = "agrs"
    pad_all2all = "pad_all2all"
    ragged_all_to_all = "ragged_all_to_all"
    auto = "auto"


class NsDtype(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"
    float16 = "float16"


class NsCoefficients(StrEnum):
    fixed = "fixed"
    tuned = "tuned"
    polar_express = "polar_express"


class NsAlgorithm(StrEnum):
    standard = "standard"
    gram = "gram"
    auto = "auto"


class RouterOptim(StrEnum):
    adamw = "adamw"
    muon = "muon"


class AdjustLr(StrEnum):
    original = "original"
    match_rms_adamw = "match_rms_adamw"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TrainDtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class ActivationCheckpointing(StrEnum):
    none = "none"
    full = "full"


class DataSource(StrEnum):
    stdlib = "stdlib"
    tokens = "tokens"


class TokenDtype(StrEnum):
    uint8 = "uint8"
    uint16 = "uint16"
    uint32 = "uint32"


class HFDtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class Schedule(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class LoggerBackend(StrEnum):
    wandb = "wandb"
    none = "none"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"


@dataclass
class RunConfig:
    name: str = _f("default", "run family; the run dir is <root>/<name>/<overrides>")
    root: str = _f("outputs", "directory holding all runs (relative to the launch cwd)")


@dataclass
class MeshConfig:
    world_size: int = _f(4, "number of ranks (a local world is started when no launcher env)")
    ep: int = _f(2, "expert-parallel degree; divides world_size")
    device: Device = _f(Device.auto, "auto: CUDA+NCCL when enough GPUs, else CPU+gloo")


@dataclass
class ModelConfig:
    preset: ModelPreset = _f(ModelPreset.tiny, "models.glm preset name")
    overrides: dict[str, Any] = _f(dict, "GLMConfig fields replacing the preset's", True)


@dataclass
class OptimConfig:
    """What every optimizer option has. Each option (`conf/optim/<name>.yaml`) extends its own
    schema below (`OPTIM_SCHEMAS`), so a run carries only its optimizer's keys: an AdamW run has
    no `optim.remainder_strategy`, and grouping runs by it never mixes AdamW baselines in."""

    name: OptimName = _f(MISSING, "muon: Muon for matrices + AdamW; adamw: AdamW for all")
    lr: float = _f(0.02, "peak learning rate of the Muon groups (all groups for adamw)")
    weight_decay: float = _f(0.0, "decoupled weight decay of the Muon groups (all for adamw)")
    betas: list[float] = _f(lambda: [0.9, 0.95], "AdamW betas", True)
    eps: float = _f(1e-8, "AdamW epsilon")


@dataclass
class MuonOptimConfig(OptimConfig):
    """`optim=muon`: muon.Muon for hidden matrices (experts blockwise), AdamW for the rest."""

    name: OptimName = _f(OptimName.muon, "muon: Muon for matrices + AdamW; adamw: AdamW for all")
    momentum: float = _f(0.95, "Muon momentum")
    nesterov: bool = _f(True, "Muon Nesterov momentum")
    ns_steps: int = _f(5, "Newton-Schulz iterations")
    ns_dtype: NsDtype = _f(
        NsDtype.bfloat16, "Newton-Schulz compute dtype; float32: same update on every layout/CPU"
    )
    ns_coefficients: NsCoefficients = _f(
        NsCoefficients.polar_express, "Newton-Schulz coefficients: polar_express, fixed or tuned"
    )
    ns_algorithm: NsAlgorithm = _f(
        NsAlgorithm.auto,
        "auto: Gram Newton-Schulz on rectangular blocks of >= 256 rows and columns; gram: on "
        "every block where it needs fewer FLOPs; standard: never",
    )
    adjust_lr: AdjustLr = _f(AdjustLr.match_rms_adamw, "Muon per-matrix learning-rate rule")
    adamw_lr: float = _f(3e-3, "peak learning rate of the AdamW groups under muon")
    adamw_weight_decay: float = _f(0.0, "weight decay of the AdamW groups under muon")
    router: RouterOptim = _f(RouterOptim.adamw, "which algorithm updates router weights")
    remainder_strategy: RemainderStrategy = _f(
        RemainderStrategy.pad_all2all,
        "Muon exchange for batches smaller than the FSDP group; auto: the fastest that fits "
        "memory_budget_gib, per batch",
    )
    memory_budget_gib: float | None = _f(
        None, "GiB one Muon batch may hold on a rank, for remainder_strategy=auto; null: no bound"
    )
    enable_all2all: bool = _f(True, "Muon all-to-all exchanges; false forces agrs")
    max_inflight: int = _f(3, "Muon batches in flight at once")


@dataclass
class AdamWOptimConfig(OptimConfig):
    """`optim=adamw`: torch.optim.AdamW over every parameter, the baseline for Muon."""

    name: OptimName = _f(OptimName.adamw, "muon: Muon for matrices + AdamW; adamw: AdamW for all")
    lr: float = _f(3e-3, "peak learning rate of every group")
    weight_decay: float = _f(0.0, "decoupled weight decay of every group")


#: the schema of each `optim=<name>` option
OPTIM_SCHEMAS: dict[str, type[OptimConfig]] = {
    OptimName.muon.value: MuonOptimConfig,
    OptimName.adamw.value: AdamWOptimConfig,
}


@dataclass
class DataConfig:
    source: DataSource = _f(DataSource.stdlib, "stdlib: this Python's .py files as bytes")
    path: str | None = _f(None, "tokens: the token file; stdlib: the source dir (None: own)")
    dtype: TokenDtype = _f(TokenDtype.uint8, "element type of the token file")
    vocab_size: int = _f(256, "vocabulary size; the model's vocab is set to it")
    cache_dir: str = _f("~/.cache/moe_muon_recipes", "where built token files are kept")
    seq_len: int = _f(128, "tokens per sequence")
    batch_size: int = _f(8, "sequences per rank per micro-step")


@dataclass
class TrainConfig:
    steps: int = _f(300, "optimizer steps to train")
    seed: int = _f(0, "seed of weights and data order")
    grad_accum_steps: int = _f(1, "micro-steps per optimizer step")
    warmup_steps: int = _f(20, "linear warmup steps")
    schedule: Schedule = _f(Schedule.cosine, "decay after warmup")
    min_lr_ratio: float = _f(0.1, "final lr as a fraction of the peak")
    grad_clip: float = _f(1.0, "max total grad norm of the clipped groups; 0 disables")
    clip_muon: bool = _f(False, "clip Muon groups too (AdamW groups always)")
    router_bias_rate: float = _f(1e-3, "router score-correction bias update rate; 0 disables")
    inject_nan_at_step: int | None = _f(None, "debug: poison a gradient at this step")
    param_dtype: TrainDtype = _f(
        TrainDtype.auto, "FSDP2 compute dtype over fp32 masters; auto: bf16 on CUDA, else fp32"
    )
    reduce_dtype: TrainDtype = _f(
        TrainDtype.auto, "FSDP2 gradient reduce-scatter dtype; auto: float32"
    )
    activation_checkpointing: ActivationCheckpointing = _f(
        ActivationCheckpointing.none, "none, or full: recompute each decoder layer in backward"
    )
    compile: bool = _f(False, "torch.compile each decoder layer (CPU needs a C++ compiler)")


@dataclass
class MetricsConfig:
    log_every: int = _f(1, "write metrics every N steps")
    memory_every: int = _f(25, "measure per-rank memory every N steps (profiling is costly)")
    progress: bool = _f(True, "tqdm progress bar on rank 0 (when attached to a terminal)")


@dataclass
class CheckpointConfig:
    every: int = _f(100, "save every N steps (and at the end); 0: only at the end")
    keep: int = _f(2, "committed checkpoints kept")
    resume: bool = _f(True, "resume from the newest committed checkpoint of the run dir")
    async_mode: bool = _f(False, "periodic saves through DCP's async_save (a CPU copy per rank)")
    export_hf: bool = _f(True, "export the final model as a transformers directory (<run>/hf)")
    hf_dtype: HFDtype = _f(HFDtype.float32, "dtype of the exported matrices (router stays fp32)")
    hf_max_shard_gib: float = _f(5.0, "largest exported .safetensors file, GiB")
    init_from: str | None = _f(None, "a transformers Glm4Moe directory to start from")


@dataclass
class LoggerConfig:
    backend: LoggerBackend = _f(LoggerBackend.wandb, "wandb or none")
    mode: WandbMode = _f(WandbMode.offline, "offline (sync later with `wandb sync`) or online")
    project: str = _f("moe-muon-recipes", "W&B project")
    entity: str | None = _f(None, "W&B entity (team); None: your default")
    group: str | None = _f(None, "W&B group; None: run.name")
    job_type: str = _f("train", "W&B job type")
    tags: list[str] = _f(list, "W&B tags", True)
    system_metrics: bool = _f(True, "W&B system metrics (CPU, GPU, memory, disk, network)")
    git: bool = _f(True, "record this checkout's git commit in the W&B run")


@dataclass
class Config:
    """The whole config with its defaults (`optim=muon`): `OmegaConf.structured(Config)`."""

    run: RunConfig = _f(RunConfig, "where the run lives", True)
    mesh: MeshConfig = _f(MeshConfig, "world and device mesh", True)
    model: ModelConfig = _f(ModelConfig, "model preset", True)
    optim: OptimConfig = _f(MuonOptimConfig, "optimizer (its keys depend on optim.name)", True)
    data: DataConfig = _f(DataConfig, "token stream", True)
    train: TrainConfig = _f(TrainConfig, "training loop", True)
    metrics: MetricsConfig = _f(MetricsConfig, "metrics and memory sampling", True)
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "checkpoints", True)
    logger: LoggerConfig = _f(LoggerConfig, "experiment logger", True)


@dataclass
class ConfigSchema(Config):
    """What Hydra composes into: `optim` is left for the `optim=<name>` group option to fill
    with its own schema (conf/optim/<name>.yaml lists `<name>_schema` in its defaults)."""

    optim: OptimConfig = _f(MISSING, "optimizer (its keys depend on optim.name)")


def register() -> None:
    """Register the schemas and the resolvers of conf/train.yaml (idempotent)."""
    from recipes.help import config_groups, schema_help

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


def run_id(override_dirname: str) -> str:
    """The run-dir leaf for a set of overrides: stable for the same command, never empty."""
    return override_dirname.replace("/", "_") or "base"


def describe(node: type = None, prefix: str = "") -> list[str]:
    """One line per leaf key: `key = default  # help`, for `python train.py --help`-like use."""
    lines = []
    for f in dataclasses.fields(node or Config):
        if node is None and f.name == "optim":  # each option has its own keys
            lines += _describe_optim()
            continue
        if dataclasses.is_dataclass(f.default_factory):
            lines += describe(f.default_factory, f"{prefix}{f.name}.")
            continue
        value = f.default_factory() if f.default is dataclasses.MISSING else f.default
        value = value.value if isinstance(value, Enum) else value
        lines.append(f"{prefix}{f.name} = {value!r}  # {f.metadata['help']}")
    return lines


def _describe_optim() -> list[str]:
    """`optim.*` once per key: the first option's default, the others' where they differ."""
    defaults: dict[str, dict[str, Any]] = {}
    helps: dict[str, str] = {}
    for name, schema in OPTIM_SCHEMAS.items():
        for f in dataclasses.fields(schema):
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            defaults.setdefault(f.name, {})[name] = (
                value.value if isinstance(value, Enum) else value
            )
            helps.setdefault(f.name, f.metadata["help"])
    lines = []
    for key, by_option in defaults.items():
        (first, value), *others = by_option.items()
        notes = [f"optim={n}: {v!r}" for n, v in others if key != "name" and v != value]
        if len(by_option) < len(OPTIM_SCHEMAS):
            notes.append(f"optim={first} only")
        note = f" [{'; '.join(notes)}]" if notes else ""
        lines.append(f"optim.{key} = {value!r}  # {helps[key]}{note}")
    return lines


def _help(key: str) -> str:
    """The help of `key`, or of its nearest schema ancestor (a list element, an override)."""
    node: Any = Config
    help_text = ""
    for part in key.split("[")[0].split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if node else {}
        if part not in fields:
            return help_text
        help_text = fields[part].metadata["help"]
        node = fields[part].default_factory
        node = node if dataclasses.is_dataclass(node) else None
    return help_text


def _fail(key: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{key}={value}: {rule} ({key}: {_help(key)})")


def _positive(cfg: DictConfig, *keys: str, allow_zero: bool = False) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value < 0 or (value == 0 and not allow_zero):
            raise _fail(key, value, "must be >= 0" if allow_zero else "must be > 0")


def validate(
    cfg: DictConfig, env_world_size: int | None = None, *, check_devices: bool = True
) -> None:
    """Check what the types cannot: finite numbers, ranges, divisibility, files, the model
    config and its layout on the mesh. Raises ConfigError naming the key."""
    _finite(cfg)
    _positive(cfg, "mesh.world_size", "mesh.ep", "optim.lr", "optim.eps")
    _positive(cfg, "data.vocab_size", "data.seq_len")
    _positive(cfg, "data.batch_size", "train.steps", "train.grad_accum_steps")
    _positive(cfg, "metrics.log_every", "metrics.memory_every", "checkpoint.keep")
    _positive(cfg, "optim.weight_decay", allow_zero=True)
    _validate_optim_option(cfg)
    _positive(cfg, "train.warmup_steps", "train.grad_clip", "checkpoint.every", allow_zero=True)
    _positive(cfg, "train.router_bias_rate", allow_zero=True)
    if cfg.optim.get("memory_budget_gib") is not None:
        _positive(cfg, "optim.memory_budget_gib")
    mesh = cfg.mesh
    if mesh.world_size % mesh.ep:
        allowed = [d for d in range(1, mesh.world_size + 1) if mesh.world_size % d == 0]
        raise _fail(
            "mesh.ep",
            mesh.ep,
            f"must divide mesh.world_size={mesh.world_size}; "
            f"allowed: {', '.join(map(str, allowed))}",
        )
    if env_world_size is not None and env_world_size != mesh.world_size:
        raise _fail(
            "mesh.world_size",
            mesh.world_size,
            f"the launcher started WORLD_SIZE={env_world_size} ranks; "
            f"pass mesh.world_size={env_world_size}",
        )
    if len(cfg.optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.optim.betas):
        raise _fail("optim.betas", list(cfg.optim.betas), "must be two values in [0, 1)")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise _fail("train.min_lr_ratio", cfg.train.min_lr_ratio, "must be in [0, 1]")
    nan_step = cfg.train.inject_nan_at_step
    if nan_step is not None and not 1 <= nan_step <= cfg.train.steps:
        raise _fail("train.inject_nan_at_step", nan_step, f"must be in [1, {cfg.train.steps}]")
    if cfg.data.source == DataSource.stdlib and cfg.data.vocab_size < 256:
        raise _fail(
            "data.vocab_size", cfg.data.vocab_size, "data.source=stdlib has byte tokens: >= 256"
        )
    max_token = {"uint8": 2**8, "uint16": 2**16, "uint32": 2**32}[cfg.data.dtype.value]
    if cfg.data.vocab_size > max_token:
        raise _fail(
            "data.vocab_size",
            cfg.data.vocab_size,
            f"does not fit data.dtype={cfg.data.dtype.value} (max {max_token})",
        )
    _validate_data_path(cfg.data)
    _validate_model(cfg)
    _validate_checkpoint(cfg)
    if check_devices and mesh.device == Device.cuda:
        import torch

        if torch.cuda.device_count() < (1 if env_world_size else mesh.world_size):
            raise _fail(
                "mesh.device",
                "cuda",
                f"needs {mesh.world_size} CUDA devices; "
                f"this machine has {torch.cuda.device_count()}; allowed: auto, cpu, cuda",
            )


def _validate_optim_option(cfg: DictConfig) -> None:
    """`optim.name` matches the schema its group option composed; Muon's own ranges."""
    optim = cfg.optim
    name = optim.name.value if isinstance(optim.name, Enum) else str(optim.name)
    if OmegaConf.get_type(optim) is not OPTIM_SCHEMAS[name]:
        composed = next(k for k, v in OPTIM_SCHEMAS.items() if v is OmegaConf.get_type(optim))
        raise _fail(
            "optim.name",
            name,
            f"the optimizer is chosen with the config group: optim={name} instead of "
            f"optim.name={name} (this config composed optim={composed}); "
            f"allowed: {', '.join(OPTIM_SCHEMAS)}",
        )
    if name != OptimName.muon:
        return
    _positive(cfg, "optim.adamw_lr", "optim.ns_steps", "optim.max_inflight")
    _positive(cfg, "optim.adamw_weight_decay", allow_zero=True)
    if not 0.0 <= optim.momentum < 1.0:
        raise _fail("optim.momentum", optim.momentum, "must be in [0, 1)")


def _validate_data_path(data: DictConfig) -> None:
    if data.source == DataSource.tokens:
        if data.path is None:
            raise _fail("data.path", None, "data.source=tokens needs a token file")
        if not Path(os.path.expanduser(data.path)).is_file():
            raise _fail(
                "data.path",
                data.path,
                "no such token file (a flat numpy memmap "
                f"of {data.dtype.value}, e.g. written by recipes.data.write_tokens)",
            )
    elif data.path is not None and not Path(os.path.expanduser(data.path)).is_dir():
        raise _fail("data.path", data.path, "no such source directory of .py files")


def _validate_model(cfg: DictConfig) -> None:
    """The model the ranks would build, and its layout on the mesh, without building it."""
    from models.glm import GLMConfig, get_preset
    from models.glm.parallelize import check_layout

    model = cfg.model
    allowed = sorted(f.name for f in dataclasses.fields(GLMConfig))
    for key in model.overrides:
        if key not in allowed:
            raise _fail(
                f"model.overrides.{key}",
                model.overrides[key],
                f"not a GLMConfig field; allowed: {', '.join(allowed)}",
            )
    overrides = {**model.overrides, "vocab_size": cfg.data.vocab_size}
    try:
        config = get_preset(str(model.preset), **overrides)
    except (TypeError, ValueError) as err:
        raise _model_error(cfg, str(err)) from None
    try:
        check_layout(config, world_size=cfg.mesh.world_size, ep=cfg.mesh.ep)
    except ValueError as err:
        raise _fail("mesh.ep", cfg.mesh.ep, str(err)) from None


def _model_error(cfg: DictConfig, message: str) -> ConfigError:
    """Name the key the user set that the model's message mentions first (else the preset)."""
    keys = {f"model.overrides.{k}": k for k in cfg.model.overrides}
    keys["data.vocab_size"] = "vocab_size"
    found = [(m.start(), key) for key, name in keys.items() for m in [_word(name, message)] if m]
    if found:
        key = min(found)[1]
        return _fail(key, OmegaConf.select(cfg, key), message)
    return _fail("model.preset", cfg.model.preset.value, message)


def _word(name: str, text: str) -> re.Match | None:
    return re.search(rf"\b{re.escape(name)}\b", text)


def _finite(node: Any, prefix: str = "") -> None:
    """Every float of the config is a finite number (NaN passes every range check)."""
    items = node.items() if isinstance(node, DictConfig) else enumerate(node)
    for key, value in items:
        path = f"{prefix}.{key}" if isinstance(node, DictConfig) else f"{prefix}[{key}]"
        path = path.lstrip(".")
        if isinstance(value, DictConfig | ListConfig):
            _finite(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise _fail(path, value, "must be a finite number")


def _validate_checkpoint(cfg: DictConfig) -> None:
    _positive(cfg, "checkpoint.hf_max_shard_gib")
    path = cfg.checkpoint.init_from
    if path is None:
        return
    if not (Path(os.path.expanduser(path)) / "config.json").is_file():
        raise _fail("checkpoint.init_from", path, "not a transformers directory (no config.json)")
    from recipes.hf import check_init_from
    from recipes.parallel import model_config

    try:  # config fields, every tensor's presence and shape: headers only, no weights read
        check_init_from(os.path.expanduser(path), model_config(cfg))
    except (ValueError, OSError) as err:
        raise ConfigError(f"checkpoint.init_from={path}: {err}") from err


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


register()
