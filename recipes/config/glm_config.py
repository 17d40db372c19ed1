"""The model a composed config names, as the GLMConfig the ranks build (models/ imported when
called, not on import: the torch-free first stage of the checks imports this package).

- `model_config(cfg)`: `model.preset` with `model.overrides`, its vocab the data's, or
  `model=hf`'s config.json;
- `hf_model_config(path, overrides)`: `model=hf model.path=DIR`, the model of DIR's config.json.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

if TYPE_CHECKING:
    from models.glm import GLMConfig


def model_config(cfg: DictConfig) -> GLMConfig:
    """The GLMConfig of `model.preset` with `model.overrides`, its vocab set to the data's and
    its indexer training to `train.indexer_training`; `model=hf`: of `model.path`'s
    config.json, whose vocab it keeps (the data's ids must fit)."""
    from models.glm import get_preset

    overrides = dict(cfg.model.overrides)
    overrides["indexer_training"] = str(cfg.train.get("indexer_training", "kl"))
    if cfg.model.get("dsa_impl") is not None:
        overrides["dsa_impl"] = str(cfg.model.dsa_impl)
    if str(cfg.model.preset) == "hf":
        return hf_model_config(cfg.model.path, overrides)
    overrides["vocab_size"] = cfg.data.vocab_size
    pad = get_preset(str(cfg.model.preset)).pad_token_id
    if pad is not None and pad >= cfg.data.vocab_size and "pad_token_id" not in overrides:
        # The preset's pad id is its tokenizer's (glm52: 154820); data of a smaller vocabulary
        # has no such token, so its embedding has no pad row.
        overrides["pad_token_id"] = None
    return get_preset(str(cfg.model.preset), **overrides)


def hf_model_config(path: str | Path, overrides: dict) -> GLMConfig:
    """`model=hf`: the GLMConfig of a transformers directory's config.json (glm4_moe or
    glm_moe_dsa), with `model.overrides` replacing fields."""
    import json

    from models.glm.hf.config import config_from_hf

    path = Path(path).expanduser()
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    return dataclasses.replace(config, **overrides) if overrides else config
