"""The training config schema: typed dataclasses registered with Hydra's ConfigStore.

`conf/train.yaml` puts `config_schema` first in its defaults list, so every group file and
every command-line override is merged into these types: an unknown key or a value outside an
Enum fails at compose time, naming the key and the allowed values. What types cannot say
(ranges, cross-field rules, files that must exist) `validate` checks, before any rank starts.
Every field carries a one-line help in `metadata["help"]`; `describe()` prints them all.
"""

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from models.glm.config import PRESET_NAMES
from muon.groups import ROUTER_CHOICES
from muon.newton_schulz import NS_ALGORITHMS, NS_COEFFICIENTS
from muon.optimizer import ADJUST_LR, NS_DTYPES
from muon.plan import REMAINDER_CHOICES


class ConfigError(ValueError):
    """A config value that composes but cannot run; the message names the key."""


def _f(default: Any, help: str, factory: bool = False, *, same_run: bool = False) -> Any:
    """A dataclass field with its one-line help. `same_run`: the key never changes what is
    trained (where it is written, how often it is logged or saved, the world it runs on), so it
    stays out of the run directory's name and a restart that changes it resumes the run."""
    metadata = {"help": help, "same_run": same_run}
    if factory:
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _choices(name: str, values: tuple[str, ...]) -> type[StrEnum]:
    """A config Enum whose members are a library's own choice list (one source: muon's
    constants), so a choice added there is accepted here, listed by --help and tested."""
    return StrEnum(name, {v: v for v in values}, module=__name__)


# `hf`: the model of a transformers directory (model.path), not a preset of models.glm
ModelPreset = _choices("ModelPreset", (*PRESET_NAMES, "hf"))


class OptimName(StrEnum):
    muon = "muon"
    adamw = "adamw"


RemainderStrategy = _choices("RemainderStrategy", REMAINDER_CHOICES)


NsDtype = _choices("NsDtype", NS_DTYPES)


NsCoefficients = _choices("NsCoefficients", tuple(NS_COEFFICIENTS))


NsAlgorithm = _choices("NsAlgorithm", NS_ALGORITHMS)


RouterOptim = _choices("RouterOptim", ROUTER_CHOICES)


#: optim.muon_split (recipes.parallel.muon_split_on): auto = on for MLA, off for GQA
MUON_SPLIT = ("auto", "on", "off")
MuonSplit = _choices("MuonSplit", MUON_SPLIT)
AdjustLr = _choices("AdjustLr", ADJUST_LR)


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


class IndexerTraining(StrEnum):
    kl = "kl"
    frozen = "frozen"


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
    name: str = _f("default", "run family; the run dir is <root>/<name>/<overrides>", same_run=True)
    root: str = _f(
        "outputs", "directory holding all runs (relative to the launch cwd)", same_run=True
    )


@dataclass
class MeshConfig:
    world_size: int = _f(
        4, "number of ranks (a local world is started when no launcher env)", same_run=True
    )
    ep: int = _f(2, "expert-parallel degree; divides world_size", same_run=True)
    device: Device = _f(
        Device.auto, "auto: CUDA+NCCL when enough GPUs, else CPU+gloo", same_run=True
    )


@dataclass
class ModelConfig:
    preset: ModelPreset = _f(ModelPreset.tiny, "models.glm preset name; hf: from model.path")
    path: str | None = _f(
        None, "model=hf: a transformers glm4_moe / glm_moe_dsa directory (its config.json)"
    )
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
    qk_clip_tau: float | None = _f(
        None, "QK-clip: rescale W_q/W_k of heads whose max attention logit exceeds it; null: off"
    )
    qk_clip_alpha: float = _f(0.5, "QK-clip: W_q takes eta^alpha, W_k eta^(1-alpha), in [0, 1]")


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
    normuon: bool = _f(
        False, "NorMuon: per-row (wide blocks: per-column) second-moment normalization after NS"
    )
    normuon_beta2: float = _f(0.95, "NorMuon second-moment EMA coefficient, in [0, 1)")
    muon_split: MuonSplit = _f(
        MuonSplit.auto,
        "Muon Split: orthogonalize attention projections per head block; auto: on for MLA "
        "(as GLM-5), off for GQA",
    )


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
    path: str | None = _f(
        None,
        "tokens: a scripts/prepare_data.py directory (or one token file); "
        "stdlib: the source dir (None: own)",
    )
    dtype: TokenDtype | None = _f(
        TokenDtype.uint8, "element type of the token file; None: from the directory's meta.json"
    )
    vocab_size: int | None = _f(
        256,
        "vocabulary size (the model's vocab is set to it; model=hf: at most its); "
        "None: from meta.json",
    )
    val_fraction: float = _f(0.05, "stdlib: fraction of the files held out for validation")
    cache_dir: str = _f(
        "~/.cache/moe_muon_recipes", "where built token files are kept", same_run=True
    )
    seq_len: int = _f(128, "tokens per sequence")
    batch_size: int = _f(8, "sequences per rank per micro-step")


@dataclass
class EvalConfig:
    # Evaluation never changes what is trained: its keys stay out of the run directory's name.
    every: int = _f(
        50, "evaluate on the validation split every N steps and at the end; 0: never", same_run=True
    )
    batches: int = _f(
        4, "validation batches of data.batch_size per rank at each evaluation", same_run=True
    )


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
    mtp_loss_weight: float = _f(
        0.3, "weight of the MTP loss (mean over depths) in the objective; 0: MTP layers idle"
    )
    indexer_training: IndexerTraining = _f(
        IndexerTraining.kl,
        "DSA indexer: kl (DeepSeek-V3.2 KL toward the attention; pretraining) or frozen "
        "(no gradient, not in the optimizer; fine-tuning a released checkpoint)",
    )
    inject_nan_at_step: int | None = _f(None, "debug: poison a gradient at this step")
    param_dtype: TrainDtype = _f(
        TrainDtype.auto, "FSDP2 compute dtype over fp32 masters; auto: bf16 on CUDA, else fp32"
    )
    reduce_dtype: TrainDtype = _f(
        TrainDtype.auto, "FSDP2 gradient reduce-scatter dtype; auto: float32"
    )
    activation_checkpointing: ActivationCheckpointing = _f(
        ActivationCheckpointing.none,
        "none, or full: recompute each decoder layer in backward",
        same_run=True,
    )
    compile: bool = _f(
        False, "torch.compile each decoder layer (CPU needs a C++ compiler)", same_run=True
    )


@dataclass
class MetricsConfig:
    log_every: int = _f(1, "write metrics every N steps", same_run=True)
    memory_every: int = _f(
        25, "measure per-rank memory every N steps (profiling is costly)", same_run=True
    )
    progress: bool = _f(
        True, "tqdm progress bar on rank 0 (when attached to a terminal)", same_run=True
    )
    attn_max_logit: bool = _f(
        True,
        "log attn/max_logit (an extra no-grad Q K^T per layer); on with optim.qk_clip_tau",
        same_run=True,
    )


@dataclass
class CheckpointConfig:
    every: int = _f(100, "save every N steps (and at the end); 0: only at the end", same_run=True)
    keep: int = _f(2, "committed checkpoints kept", same_run=True)
    resume: bool = _f(
        True, "resume from the newest committed checkpoint of the run dir", same_run=True
    )
    async_mode: bool = _f(
        False, "periodic saves through DCP's async_save (a CPU copy per rank)", same_run=True
    )
    export_hf: bool = _f(
        True, "export the final model as a transformers directory (<run>/hf)", same_run=True
    )
    hf_dtype: HFDtype = _f(
        HFDtype.float32, "dtype of the exported matrices (router stays fp32)", same_run=True
    )
    hf_max_shard_gib: float = _f(5.0, "largest exported .safetensors file, GiB", same_run=True)
    init_from: str | None = _f(None, "a transformers GLM directory to start from")


@dataclass
class LoggerConfig:
    backend: LoggerBackend = _f(LoggerBackend.wandb, "wandb or none", same_run=True)
    mode: WandbMode = _f(
        WandbMode.offline, "offline (sync later with `wandb sync`) or online", same_run=True
    )
    project: str = _f("moe-muon-recipes", "W&B project", same_run=True)
    entity: str | None = _f(None, "W&B entity (team); None: your default", same_run=True)
    group: str | None = _f(None, "W&B group; None: run.name", same_run=True)
    job_type: str = _f("train", "W&B job type", same_run=True)
    tags: list[str] = _f(list, "W&B tags", True, same_run=True)
    system_metrics: bool = _f(
        True, "W&B system metrics (CPU, GPU, memory, disk, network)", same_run=True
    )
    git: bool = _f(True, "record this checkout's git commit in the W&B run", same_run=True)


@dataclass
class Config:
    """The whole config with its defaults (`optim=muon`): `OmegaConf.structured(Config)`."""

    run: RunConfig = _f(RunConfig, "where the run lives", True)
    mesh: MeshConfig = _f(MeshConfig, "world and device mesh", True)
    model: ModelConfig = _f(ModelConfig, "model preset", True)
    optim: OptimConfig = _f(MuonOptimConfig, "optimizer (its keys depend on optim.name)", True)
    data: DataConfig = _f(DataConfig, "token stream", True)
    train: TrainConfig = _f(TrainConfig, "training loop", True)
    eval: EvalConfig = _f(EvalConfig, "held-out evaluation", True)
    metrics: MetricsConfig = _f(MetricsConfig, "metrics and memory sampling", True)
    checkpoint: CheckpointConfig = _f(CheckpointConfig, "checkpoints", True)
    logger: LoggerConfig = _f(LoggerConfig, "experiment logger", True)


@dataclass
class ConfigSchema(Config):
    """What Hydra composes into: `optim` is left for the `optim=<name>` group option to fill
    with its own schema (conf/optim/<name>.yaml lists `<name>_schema` in its defaults)."""

    optim: OptimConfig = _f(MISSING, "optimizer (its keys depend on optim.name)")


#: config groups whose choice never changes what is trained (an experiment names its own run.name)
SAME_RUN_GROUPS = ("experiment", "logger", "checkpoint")


def same_run_keys() -> list[str]:
    """The keys (and groups) left out of the run directory's name: `SAME_RUN_GROUPS` and every
    field declared `same_run` (conf/train.yaml's `exclude_keys` resolves to this list)."""
    keys = list(SAME_RUN_GROUPS)

    def walk(node: type, prefix: str) -> None:
        for f in dataclasses.fields(node):
            if dataclasses.is_dataclass(f.default_factory):
                walk(f.default_factory, f"{prefix}{f.name}.")
            elif f.metadata["same_run"] and f"{prefix}{f.name}" not in keys:
                keys.append(f"{prefix}{f.name}")

    walk(Config, "")
    for schema in OPTIM_SCHEMAS.values():
        walk(schema, "optim.")
    return keys


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


RUN_ID_MAX = 200  # bytes of a run-dir leaf (file systems allow 255 per name)


def run_id(override_dirname: str) -> str:
    """The run-dir leaf for a set of overrides: stable for the same command, never empty. A
    longer one (paths in `model.path` / `checkpoint.init_from`) keeps its start and ends in a
    hash of the whole, so the same command still finds its run directory."""
    import hashlib

    leaf = override_dirname.replace("/", "_") or "base"
    if len(leaf.encode()) <= RUN_ID_MAX:
        return leaf
    digest = hashlib.sha1(leaf.encode()).hexdigest()[:16]
    return leaf.encode()[: RUN_ID_MAX - 17].decode(errors="ignore") + "-" + digest


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
    config and its layout on the mesh. Raises ConfigError naming the key. Fills
    `data.vocab_size` and `data.dtype` from a prepared token directory's meta.json."""
    _finite(cfg)
    _validate_data(cfg)
    _positive(cfg, "mesh.world_size", "mesh.ep", "optim.lr", "optim.eps")
    _positive(cfg, "data.vocab_size", "data.seq_len")
    _positive(cfg, "data.batch_size", "train.steps", "train.grad_accum_steps")
    _positive(cfg, "metrics.log_every", "metrics.memory_every", "checkpoint.keep")
    _positive(cfg, "optim.weight_decay", allow_zero=True)
    _validate_optim_option(cfg)
    _positive(cfg, "train.warmup_steps", "train.grad_clip", "checkpoint.every", allow_zero=True)
    _positive(cfg, "train.router_bias_rate", "train.mtp_loss_weight", allow_zero=True)
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
    if optim.qk_clip_tau is not None:
        _positive(cfg, "optim.qk_clip_tau")
    if not 0.0 <= optim.qk_clip_alpha <= 1.0:
        raise _fail("optim.qk_clip_alpha", optim.qk_clip_alpha, "must be in [0, 1]")
    if name != OptimName.muon:
        return
    _positive(cfg, "optim.adamw_lr", "optim.ns_steps", "optim.max_inflight")
    _positive(cfg, "optim.adamw_weight_decay", allow_zero=True)
    for key in ("momentum", "normuon_beta2"):
        if not 0.0 <= optim[key] < 1.0:
            raise _fail(f"optim.{key}", optim[key], "must be in [0, 1)")


def _validate_data(cfg: DictConfig) -> None:
    """The data source's path, its held-out split for `eval`, and the vocab size and dtype:
    a prepared directory's meta.json fills them, and a value set that contradicts it fails."""
    data = cfg.data
    _positive(cfg, "eval.every", allow_zero=True)
    _positive(cfg, "eval.batches")
    if not 0.0 <= data.val_fraction < 1.0:
        raise _fail("data.val_fraction", data.val_fraction, "must be in [0, 1)")
    if data.source == DataSource.stdlib:
        if data.path is not None and not Path(os.path.expanduser(data.path)).is_dir():
            raise _fail("data.path", data.path, "no such source directory of .py files")
        if cfg.eval.every and data.val_fraction == 0:
            raise _fail("data.val_fraction", 0.0, "eval.every > 0 needs held-out files")
    elif data.path is None:
        raise _fail("data.path", None, "data.source=tokens needs a prepare_data.py directory")
    elif Path(os.path.expanduser(data.path)).is_dir():
        _resolve_prepared(cfg)
    elif not Path(os.path.expanduser(data.path)).is_file():
        raise _fail(
            "data.path",
            data.path,
            "neither a scripts/prepare_data.py directory (train.bin, val.bin, meta.json) "
            "nor a token file",
        )
    elif cfg.eval.every:
        raise _fail(
            "eval.every",
            cfg.eval.every,
            f"data.path={data.path} is one token file, with no validation split: prepare a "
            "directory with scripts/prepare_data.py, or pass eval.every=0",
        )
    for key in ("vocab_size", "dtype"):
        if data[key] is None:
            raise _fail(
                f"data.{key}",
                None,
                "needed for a token file (a scripts/prepare_data.py directory's meta.json "
                "gives it)",
            )


def _resolve_prepared(cfg: DictConfig) -> None:
    from recipes.data import is_prepared, read_meta

    data = cfg.data
    if not is_prepared(data.path):
        raise _fail(
            "data.path",
            data.path,
            "a directory without meta.json: not a finished scripts/prepare_data.py output",
        )
    try:
        meta = read_meta(Path(os.path.expanduser(data.path)))
    except ValueError as err:
        raise _fail("data.path", data.path, str(err)) from None
    for key in ("vocab_size", "dtype"):
        value = data[key].value if isinstance(data[key], Enum) else data[key]
        if value is None:
            data[key] = meta[key]
        elif value != meta[key]:
            raise _fail(
                f"data.{key}",
                value,
                f"contradicts {data.path}/meta.json ({key}: {meta[key]}); leave it unset",
            )
    val_tokens = meta["splits"].get("val", {}).get("tokens", 0)
    if cfg.eval.every and not val_tokens:
        raise _fail(
            "eval.every",
            cfg.eval.every,
            f"{data.path} has no validation tokens (prepare it with --val-fraction > 0), "
            "or pass eval.every=0",
        )
    if cfg.eval.every and val_tokens < data.seq_len + 1:
        raise _fail(
            "data.seq_len",
            data.seq_len,
            f"a sample is seq_len + 1 tokens; {data.path}'s validation split holds {val_tokens}",
        )


def _validate_model(cfg: DictConfig) -> None:
    """The model the ranks would build, and its layout on the mesh, without building it."""
    from models.glm import GLMConfig
    from models.glm.parallelize import check_layout
    from recipes.parallel import model_config

    model = cfg.model
    chosen = str(cfg.train.indexer_training)
    if str(model.overrides.get("indexer_training", chosen)) != chosen:
        raise _fail(
            "model.overrides.indexer_training",
            model.overrides.indexer_training,
            f"train.indexer_training={chosen} picks it; set that instead (kl or frozen)",
        )
    allowed = sorted(f.name for f in dataclasses.fields(GLMConfig))
    for key in model.overrides:
        if key not in allowed:
            raise _fail(
                f"model.overrides.{key}",
                model.overrides[key],
                f"not a GLMConfig field; allowed: {', '.join(allowed)}",
            )
    from_hf = str(model.preset) == ModelPreset.hf
    if from_hf:
        _validate_model_path(model.path)
    elif model.path is not None:
        raise _fail("model.path", model.path, "is read by model=hf only; drop it or use model=hf")
    try:
        config = model_config(cfg)
    except (TypeError, ValueError) as err:
        raise _model_error(cfg, str(err)) from None
    if from_hf and cfg.data.vocab_size > config.vocab_size:
        raise _fail(
            "data.vocab_size",
            cfg.data.vocab_size,
            f"token ids must fit the vocabulary of {model.path}/config.json "
            f"(vocab_size {config.vocab_size}): <= {config.vocab_size}",
        )
    try:
        check_layout(config, world_size=cfg.mesh.world_size, ep=cfg.mesh.ep)
    except ValueError as err:
        raise _fail("mesh.ep", cfg.mesh.ep, str(err)) from None
    _validate_seq_len(cfg, config.max_position_embeddings)


def _validate_seq_len(cfg: DictConfig, max_positions: int) -> None:
    """`data.seq_len` fits the model's positions and the token stream (file sizes only)."""
    seq_len = cfg.data.seq_len
    if seq_len > max_positions:
        raise _fail(
            "data.seq_len",
            seq_len,
            f"exceeds the model's max_position_embeddings={max_positions} "
            f"(model.preset={cfg.model.preset.value}; "
            "+model.overrides.max_position_embeddings=N raises it)",
        )
    count = _token_count(cfg.data)
    if count is not None and count < seq_len + 1:
        raise _fail(
            "data.seq_len",
            seq_len,
            f"a sample is seq_len + 1 tokens; data.path={cfg.data.path} holds {count}",
        )


def _token_count(data: DictConfig) -> int | None:
    """Tokens the stream will hold, from file sizes; None for this Python's own standard
    library (tens of millions of bytes, and summing them costs a second per check)."""
    from recipes.data import stdlib_files

    if data.source == DataSource.stdlib:
        if data.path is None:
            return None
        files = stdlib_files(Path(os.path.expanduser(data.path)))
        if not files:
            raise _fail("data.path", data.path, "no .py files in this source directory")
        return sum(p.stat().st_size for p in files) + 2 * max(len(files) - 1, 0)  # b"\n\n"
    path = Path(os.path.expanduser(data.path))
    if path.is_dir():  # a prepare_data.py directory: its training split
        from recipes.data import PREPARED_FILES

        path = path / PREPARED_FILES["train"]
    itemsize = {"uint8": 1, "uint16": 2, "uint32": 4}[data.dtype.value]
    size = path.stat().st_size
    meta = path.with_suffix(".json")  # written beside it by recipes.data.write_tokens
    written = json.loads(meta.read_text()).get("dtype") if meta.is_file() else None
    if written not in (None, data.dtype.value) or size % itemsize:
        raise _fail(
            "data.dtype",
            data.dtype.value,
            f"{data.path} is {size} bytes"
            + (f", written as {written}" if written else f", not whole {itemsize}-byte tokens"),
        )
    return size // itemsize


def _validate_model_path(path: str | None) -> None:
    if path is None:
        raise _fail("model.path", None, "model=hf needs a transformers directory")
    if not (Path(os.path.expanduser(path)) / "config.json").is_file():
        raise _fail("model.path", path, "not a transformers directory (no config.json)")


def _model_error(cfg: DictConfig, message: str) -> ConfigError:
    """Name the key the user set that the model's message mentions first (else the preset)."""
    keys = {f"model.overrides.{k}": k for k in cfg.model.overrides}
    from_hf = str(cfg.model.preset) == ModelPreset.hf
    if not from_hf:  # model=hf takes the vocabulary of its config.json
        keys["data.vocab_size"] = "vocab_size"
    found = [(m.start(), key) for key, name in keys.items() for m in [_word(name, message)] if m]
    if found:
        key = min(found)[1]
        return _fail(key, OmegaConf.select(cfg, key), message)
    if from_hf:
        return _fail("model.path", cfg.model.path, message)
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
    from models.glm.hf_config import config_to_hf
    from recipes.parallel import model_config

    if cfg.checkpoint.export_hf:
        try:  # the final export needs a transformers layout of the model
            config_to_hf(model_config(cfg))
        except ValueError as err:
            raise _fail("checkpoint.export_hf", True, f"{err}; or set it to false") from None
    path = cfg.checkpoint.init_from
    if path is None:
        return
    if not (Path(os.path.expanduser(path)) / "config.json").is_file():
        raise _fail("checkpoint.init_from", path, "not a transformers directory (no config.json)")
    from recipes.hf import check_init_from

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
