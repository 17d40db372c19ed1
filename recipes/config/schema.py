"""The typed schema: dataclasses registered with Hydra's ConfigStore, one Enum per choice.

Every field carries a one-line help in `metadata["help"]` and says whether it is `same_run`
(never changes what is trained: left out of the run directory's name). A choice is an Enum, so
an unknown value fails at compose time, naming the key and the allowed values; the Enums and the
libraries' choice lists are recipes/config/choices.py's (re-exported here). `ConfigError` is
what a config that composes but cannot run raises (`checks.validate`). The defaults of the Muon
keys are `muon.options.MuonOptions`' (`_MUON`), written there once.
"""

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from recipes.config.choices import (  # noqa: F401 (re-exported: schema.<Enum>)
    ADJUST_LR,
    MUON_SPLIT,
    NS_ALGORITHMS,
    NS_COEFFICIENTS,
    NS_DTYPES,
    PRESET_NAMES,
    REMAINDER_CHOICES,
    ROUTER_CHOICES,
    ActivationCheckpointing,
    AdjustLr,
    DataSource,
    Device,
    DsaImpl,
    HFDtype,
    IndexerTraining,
    LoggerBackend,
    MemoryCheck,
    ModelPreset,
    MuonSplit,
    NsAlgorithm,
    NsCoefficients,
    NsDtype,
    OnDivergence,
    OptimName,
    RemainderStrategy,
    RouterOptim,
    Schedule,
    TokenDtype,
    TrainDtype,
    WandbMode,
)
from recipes.units import GiB


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


def _muon_options() -> Any:
    """`muon.options.DEFAULTS` without importing the `muon` package, whose `__init__` imports
    torch (the config is composed before torch loads): muon/options.py is standard library only,
    so it is loaded from its file; the module itself once torch-side code has imported it."""
    if "muon.options" in sys.modules:
        return sys.modules["muon.options"].DEFAULTS
    name = f"{__name__}._muon_options"
    if name not in sys.modules:
        package = importlib.util.find_spec("muon")  # finds the package without running it
        path = Path(package.submodule_search_locations[0]) / "options.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while they are built
        spec.loader.exec_module(module)
    return sys.modules[name].DEFAULTS


#: muon.Muon's defaults (muon.options.MuonOptions): the Muon keys below take theirs from it
_MUON = _muon_options()


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
    cp: int = _f(
        1,
        "context-parallel degree: cp consecutive ranks share each sequence, each computing "
        "2 of its 2cp chunks (head-tail) with the attention's key side gathered; divides "
        "world_size, and 2cp divides data.seq_len",
        same_run=True,
    )
    device: Device = _f(
        Device.auto, "auto: CUDA+NCCL when enough GPUs, else CPU+gloo", same_run=True
    )
    collective_timeout_s: float = _f(
        600.0,
        "seconds a collective waits for a peer (every process group) before the run fails "
        "naming the rank that stopped responding",
        same_run=True,
    )


@dataclass
class ModelConfig:
    preset: ModelPreset = _f(ModelPreset.tiny, "models.glm preset name; hf: from model.path")
    path: str | None = _f(
        None, "model=hf: a transformers glm4_moe / glm_moe_dsa directory (its config.json)"
    )
    overrides: dict[str, Any] = _f(dict, "GLMConfig fields replacing the preset's", True)
    dsa_impl: DsaImpl | None = _f(
        None,
        "DSA attention path: latent (sparse MLA, absorbed), per_head (sparse), masked (the "
        "dense reference); null: the model's own (latent)",
    )
    cp_keep_gathered: bool = _f(
        False,
        "mesh.cp > 1: keep each MLA layer's gathered key side for backward (true) or gather it "
        "again there (false: one layer's at a time, one all-gather more per layer); "
        "activation-checkpointed layers gather again with their recompute either way",
        same_run=True,
    )


@dataclass
class OptimConfig:
    """What every optimizer option has. Each option (`conf/optim/<name>.yaml`) extends its own
    schema below (`OPTIM_SCHEMAS`), so a run carries only its optimizer's keys: an AdamW run has
    no `optim.remainder_strategy`, and grouping runs by it never mixes AdamW baselines in."""

    name: OptimName = _f(MISSING, "muon: Muon for matrices + AdamW; adamw: AdamW for all")
    lr: float = _f(_MUON.lr, "peak learning rate of the Muon groups (all groups for adamw)")
    weight_decay: float = _f(
        _MUON.weight_decay, "decoupled weight decay of the Muon groups (all for adamw)"
    )
    betas: list[float] = _f(lambda: list(_MUON.betas), "AdamW betas", True)
    eps: float = _f(_MUON.adamw_eps, "AdamW epsilon")
    qk_clip_tau: float | None = _f(
        None, "QK-clip: rescale W_q/W_k of heads whose max attention logit exceeds it; null: off"
    )
    qk_clip_alpha: float = _f(0.5, "QK-clip: W_q takes eta^alpha, W_k eta^(1-alpha), in [0, 1]")


@dataclass
class MuonOptimConfig(OptimConfig):
    """`optim=muon`: muon.Muon for hidden matrices (experts blockwise), AdamW for the rest."""

    name: OptimName = _f(OptimName.muon, "muon: Muon for matrices + AdamW; adamw: AdamW for all")
    momentum: float = _f(_MUON.momentum, "Muon momentum")
    nesterov: bool = _f(_MUON.nesterov, "Muon Nesterov momentum")
    ns_steps: int = _f(_MUON.ns_steps, "Newton-Schulz iterations")
    ns_dtype: NsDtype = _f(
        NsDtype(_MUON.ns_dtype),
        "Newton-Schulz compute dtype; float32: same update on every layout/CPU",
    )
    ns_coefficients: NsCoefficients = _f(
        NsCoefficients(_MUON.ns_coefficients),
        "Newton-Schulz coefficients: polar_express, fixed or tuned",
    )
    ns_algorithm: NsAlgorithm = _f(
        NsAlgorithm(_MUON.ns_algorithm),
        "auto: Gram Newton-Schulz on rectangular blocks of >= 256 rows and columns; gram: on "
        "every block where it needs fewer FLOPs; standard: never",
    )
    adjust_lr: AdjustLr = _f(AdjustLr(_MUON.adjust_lr), "Muon per-matrix learning-rate rule")
    adamw_lr: float = _f(_MUON.adamw_lr, "peak learning rate of the AdamW groups under muon")
    adamw_weight_decay: float = _f(0.0, "weight decay of the AdamW groups under muon")
    router: RouterOptim = _f(RouterOptim.adamw, "which algorithm updates router weights")
    remainder_strategy: RemainderStrategy = _f(
        RemainderStrategy(_MUON.remainder_strategy),
        "Muon exchange for batches smaller than the FSDP group; auto: the fastest that fits "
        "memory_budget_gib, per batch",
    )
    memory_budget_gib: float | None = _f(
        None if _MUON.memory_budget is None else _MUON.memory_budget / GiB,
        "GiB one Muon batch's planned peak may hold on a rank (batches are cut to fit it; "
        "auto picks a remainder that fits); null: 256 MiB batches, auto unbounded",
    )
    enable_all2all: bool = _f(_MUON.enable_all2all, "Muon all-to-all exchanges; false forces agrs")
    max_inflight: int = _f(_MUON.max_inflight, "Muon batches in flight at once")
    normuon: bool = _f(
        _MUON.normuon,
        "NorMuon: per-row (wide blocks: per-column) second-moment normalization after NS",
    )
    normuon_beta2: float = _f(
        _MUON.normuon_beta2, "NorMuon second-moment EMA coefficient, in [0, 1)"
    )
    muon_split: MuonSplit = _f(
        MuonSplit.auto,
        "Muon Split: orthogonalize attention projections per head block; auto: on for MLA "
        "(as GLM-5), off for GQA",
    )


@dataclass
class AdamWOptimConfig(OptimConfig):
    """`optim=adamw`: torch.optim.AdamW over every parameter, the baseline for Muon."""

    name: OptimName = _f(OptimName.adamw, "muon: Muon for matrices + AdamW; adamw: AdamW for all")
    # the baseline's lr is that of the AdamW groups under Muon
    lr: float = _f(_MUON.adamw_lr, "peak learning rate of every group")
    weight_decay: float = _f(_MUON.weight_decay, "decoupled weight decay of every group")


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
    pack: bool = _f(
        False,
        "documents packed in each sequence: positions restart and attention, top-k and "
        "labels stay inside each document (needs the token files' document boundaries)",
    )


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
    max_skipped_in_row: int = _f(
        5,
        "stop the run (exit 1, no export) after this many skipped steps in a row; 0: never",
        same_run=True,
    )
    divergence_steps: int = _f(
        20,
        "loss at ln(vocab) (after leaving it) or >5% above its start this many steps: "
        "diverged; 0: no check",
        same_run=True,
    )
    on_divergence: OnDivergence = _f(
        OnDivergence.warn,
        "a diverged loss: warn, or stop the run (exit 1, no export)",
        same_run=True,
    )
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
    memory_check: MemoryCheck = _f(
        MemoryCheck.error,
        "before the ranks start, the step-memory estimate against this machine's memory: "
        "error (refuse, naming settings that fit), warn, off",
        same_run=True,
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
    fallback: bool = _f(
        False,
        "resume: a newest checkpoint that fails verification goes to refused-step_<n>/ and the "
        "one before it loads; false: the run stops naming what is wrong",
        same_run=True,
    )
    export_hf: bool = _f(
        True, "export the final model as a transformers directory (<run>/hf)", same_run=True
    )
    hf_dtype: HFDtype = _f(
        HFDtype.float32, "dtype of the exported matrices (router stays fp32)", same_run=True
    )
    hf_max_shard_gib: float = _f(5.0, "largest exported .safetensors file, GiB", same_run=True)
    init_from: str | None = _f(None, "a transformers GLM directory to start from")
    init_missing_mtp: bool = _f(
        False, "init_from: initialize MTP layers the directory declares but lacks weights of"
    )


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
