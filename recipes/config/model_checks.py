"""The model the ranks would build, checked without building it: its config (the preset or
model=hf's config.json with `model.overrides`), its expert layout on the mesh, its positions,
the transformers export and the directory to start from, the CUDA devices.

The second stage of `checks.validate`: it imports models/ and torch, so train.py runs it after
`checks.validate_config` (torch-free) has passed and the ranks' fork server has started. Every
failure is a `ConfigError` naming the key, as in checks.py.
"""

import dataclasses
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from recipes.config.describe import config_error
from recipes.config.glm_config import model_config
from recipes.config.preflight import check_token_ids
from recipes.config.schema import ConfigError, Device, ModelPreset

if TYPE_CHECKING:
    from models.glm import GLMConfig


def validate_model(
    cfg: DictConfig, env_world_size: int | None = None, *, check_devices: bool = True
) -> None:
    """Check the model config, its layout on the mesh and positions, the export, the
    checkpoint to start from and (`check_devices`) the CUDA devices `mesh.device=cuda` needs."""
    config = _validate_model(cfg)
    _validate_checkpoint(cfg, config)
    check_token_ids(cfg)  # numpy; after meta.json filled data.vocab_size and data.dtype
    mesh = cfg.mesh
    if check_devices and mesh.device == Device.cuda:
        import torch

        if torch.cuda.device_count() < (1 if env_world_size else mesh.world_size):
            raise config_error(
                "mesh.device",
                "cuda",
                f"needs {mesh.world_size} CUDA devices; "
                f"this machine has {torch.cuda.device_count()}; allowed: auto, cpu, cuda",
            )


def _validate_model(cfg: DictConfig) -> "GLMConfig":
    """The model the ranks would build, and its layout on the mesh, without building it;
    returns its GLMConfig (built once here, for the checks after it)."""
    from models.glm import GLMConfig
    from models.glm.infra.parallelize import check_layout

    model = cfg.model
    allowed = sorted(f.name for f in dataclasses.fields(GLMConfig))
    for key in model.overrides:
        if key not in allowed:
            raise config_error(
                f"model.overrides.{key}",
                model.overrides[key],
                f"not a GLMConfig field; allowed: {', '.join(allowed)}",
            )
    from_hf = str(model.preset) == ModelPreset.hf
    try:
        config = model_config(cfg)
    except (TypeError, ValueError) as err:
        raise _model_error(cfg, str(err)) from None
    if from_hf and cfg.data.vocab_size > config.vocab_size:
        raise config_error(
            "data.vocab_size",
            cfg.data.vocab_size,
            f"token ids must fit the vocabulary of {model.path}/config.json "
            f"(vocab_size {config.vocab_size}): <= {config.vocab_size}",
        )
    try:
        check_layout(config, world_size=cfg.mesh.world_size, ep=cfg.mesh.ep)
    except ValueError as err:
        raise config_error("mesh.ep", cfg.mesh.ep, str(err)) from None
    if cfg.data.seq_len > config.max_position_embeddings:
        raise config_error(
            "data.seq_len",
            cfg.data.seq_len,
            f"exceeds the model's max_position_embeddings={config.max_position_embeddings} "
            f"(model.preset={cfg.model.preset.value}; "
            "+model.overrides.max_position_embeddings=N raises it)",
        )
    return config


def _model_error(cfg: DictConfig, message: str) -> ConfigError:
    """Name the key the user set that the model's message mentions first (else the preset)."""
    keys = {f"model.overrides.{k}": k for k in cfg.model.overrides}
    from_hf = str(cfg.model.preset) == ModelPreset.hf
    if not from_hf:  # model=hf takes the vocabulary of its config.json
        keys["data.vocab_size"] = "vocab_size"
    found = [(m.start(), key) for key, name in keys.items() for m in [_word(name, message)] if m]
    if found:
        key = min(found)[1]
        return config_error(key, OmegaConf.select(cfg, key), message)
    if from_hf:
        return config_error("model.path", cfg.model.path, message)
    return config_error("model.preset", cfg.model.preset.value, message)


def _word(name: str, text: str) -> re.Match | None:
    return re.search(rf"\b{re.escape(name)}\b", text)


def _validate_checkpoint(cfg: DictConfig, config: "GLMConfig") -> None:
    from models.glm.hf.config import config_to_hf

    if cfg.checkpoint.export_hf:
        try:  # the final export needs a transformers layout of the model
            config_to_hf(config)
        except ValueError as err:
            raise config_error("checkpoint.export_hf", True, f"{err}; or set it to false") from None
    path = cfg.checkpoint.init_from
    if path is None:
        return
    try:  # config fields, every tensor's presence and shape: headers only, no weights read
        check_init_from(
            os.path.expanduser(path),
            config,
            init_missing_mtp=bool(cfg.checkpoint.init_missing_mtp),
        )
    except (ValueError, OSError) as err:
        raise ConfigError(f"checkpoint.init_from={path}: {err}") from err


def check_init_from(
    path: str | Path, config: "GLMConfig", *, init_missing_mtp: bool = False
) -> list[str]:
    """Raise ValueError unless `path` is a transformers GLM directory of the model of
    `config`: same config fields (naming those that differ) and every tensor present in the
    right shape and a loadable format (naming the tensors; MTP layers the files lack only
    with `init_missing_mtp`, `checkpoint.init_missing_mtp`). Reads config.json and the
    safetensors headers only. Returns the MTP tensors the files lack (left initialized)."""
    from models.glm.hf.config import TRAINING_ONLY, canonical_indexer_types
    from models.glm.hf.load import HFDir, check_hf

    hf = HFDir(path)
    theirs, ours = hf.config.to_dict(), config.to_dict()
    for fields in (theirs, ours):  # all "full" and None say the same
        fields["indexer_types"] = canonical_indexer_types(fields["indexer_types"])
    differ = {
        k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k] and k not in TRAINING_ONLY
    }
    if differ:
        listed = ", ".join(f"{k}: run {a!r}, files {b!r}" for k, (a, b) in sorted(differ.items()))
        raise ValueError(
            f"{path}/config.json differs from the model of this run ({listed}); build the "
            f"model from the directory (model=hf model.path={path}), or set "
            "model.overrides.<field> (vocab_size: data.vocab_size) to match"
        )
    return check_hf(
        hf,
        config,
        init_missing_mtp=init_missing_mtp,
        init_missing_mtp_key="checkpoint.init_missing_mtp=true",
    )
