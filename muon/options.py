"""Every option of `muon.Muon` with its default, written once.

`Muon.__init__` takes its keyword defaults from `MuonOptions` and recipes' config schema takes
the defaults of its Muon keys from it, so a default changed here changes both. Standard library
only (no torch): the config schema reads it before torch loads. `ns_dtype` is a dtype's name
(`Muon` also takes a `torch.dtype`). `link` (a measured or given `muon.cost.LinkModel`) is an
object of the run, not an option with a default value, and stays a keyword of `Muon` alone.
"""

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class MuonOptions:
    """The keyword options of `muon.Muon` and their defaults (the class docstring of `Muon`
    says what each one does)."""

    lr: float = 0.02
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.0
    ns_steps: int = 5
    ns_coefficients: str = "polar_express"
    ns_dtype: str = "bfloat16"
    eps: float = 1e-7
    adjust_lr: str = "match_rms_adamw"
    betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_lr: float = 3e-3
    remainder_strategy: str = "pad_all2all"
    enable_all2all: bool = True
    max_inflight: int = 3
    expert_aware: bool = True
    memory_budget: int | None = None
    ns_algorithm: str = "auto"
    normuon: bool = False
    normuon_beta2: float = 0.95


#: the names of `MuonOptions`' fields, in their order (the keywords `Muon` takes besides `link`)
OPTION_NAMES = tuple(f.name for f in fields(MuonOptions))

#: the defaults, one instance: `Muon.__init__`'s signature reads them from here
DEFAULTS = MuonOptions()
