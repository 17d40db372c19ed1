"""Every choice of the config: the libraries' choice lists and one StrEnum per choice key.

The choices of muon and models are spelled out here, not imported: importing either package
imports torch, and the config is composed and checked before torch loads (a bad override's
error comes in well under a second); tests/unit/test_config.py checks that every list equals
the library's own constant. An Enum field fails at compose time, naming the key and the allowed
values, and --help lists its members.
"""

from enum import StrEnum

# The libraries' own choice lists, in their order (tests/unit/test_config.py compares them):
# models.glm.model.presets
PRESET_NAMES = ("tiny", "small", "glm45_air", "mla_tiny", "glm5", "glm52")
REMAINDER_CHOICES = ("agrs", "pad_all2all", "ragged_all_to_all", "auto")  # muon.plan
NS_DTYPES = ("bfloat16", "float32", "float16")  # muon.optimizer
NS_COEFFICIENTS = ("fixed", "tuned", "polar_express")  # muon.newton_schulz
NS_ALGORITHMS = ("standard", "gram", "auto")  # muon.newton_schulz
ROUTER_CHOICES = ("adamw", "muon")  # muon.groups
ADJUST_LR = ("match_rms_adamw", "original", "none")  # muon.optimizer
DSA_IMPLS = ("latent", "per_head", "masked")  # models.glm.model.config_checks


def _choices(name: str, values: tuple[str, ...]) -> type[StrEnum]:
    """A config Enum whose members are a library's choice list (spelled above, compared with
    the library's constant by a test), so it is accepted here, listed by --help and tested."""
    return StrEnum(name, {v: v for v in values}, module=__name__)


# `hf`: the model of a transformers directory (model.path), not a preset of models.glm
ModelPreset = _choices("ModelPreset", (*PRESET_NAMES, "hf"))
DsaImpl = _choices("DsaImpl", DSA_IMPLS)


class OptimName(StrEnum):
    muon = "muon"
    adamw = "adamw"


RemainderStrategy = _choices("RemainderStrategy", REMAINDER_CHOICES)


NsDtype = _choices("NsDtype", NS_DTYPES)


NsCoefficients = _choices("NsCoefficients", NS_COEFFICIENTS)


NsAlgorithm = _choices("NsAlgorithm", NS_ALGORITHMS)


RouterOptim = _choices("RouterOptim", ROUTER_CHOICES)


#: optim.muon_split (recipes.build.muon_split_on): auto = on for MLA, off for GQA
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


class MemoryCheck(StrEnum):
    error = "error"
    warn = "warn"
    off = "off"


class IndexerTraining(StrEnum):
    kl = "kl"
    frozen = "frozen"


class OnDivergence(StrEnum):
    warn = "warn"
    stop = "stop"


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
