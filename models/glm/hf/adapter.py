"""Export to / import from a transformers GLM directory, tensor by tensor: `Glm4MoeForCausalLM`
(attention "gqa") or `GlmMoeDsaForCausalLM` (attention "mla", GLM-5).

Layout: `config.json` (model_type "glm4_moe" or "glm_moe_dsa", see hf_config.py),
`model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`. Our keys already follow
the transformers names (the MLA and indexer modules included; a "shared" DSA layer has no
indexer, as in the files) except for
- the fused 2-D experts: our `mlp.experts.gate_up_proj [E*2I, D]` / `down_proj [E*D, I]` are
  per expert `mlp.experts.{e}.gate_proj.weight [I, D]`, `.up_proj.weight [I, D]`,
  `.down_proj.weight [D, I]` in the files; on import the fused 3-D in-memory layout of
  transformers (`experts.gate_up_proj [E, 2I, D]`, `experts.down_proj [E, D, I]`) is read too;
- MTP layers: our `model.mtp_layers.{i}.*` are `model.layers.{num_hidden_layers + i}.*`, as in
  the public GLM checkpoints (transformers ignores them). An import accepts files without them
  (transformers' save_pretrained drops them; the layer keeps its initialization and is
  reported) and ignores the public files' MTP copies of the embedding and head;
- with tied embeddings `lm_head.weight` is left out of the files.
The import (checks, sharded loading, block-wise fp8 dequantization) is models/glm/hf/load.py.

Memory: the export holds one tensor at a time in process memory. Each output file is assembled
in a file-backed shared map (page cache, not process memory) and then written by the
safetensors library, which needs every tensor of a file addressable at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import TensorSpec, serialize_file

from models.glm.hf.config import config_from_hf, config_to_hf  # noqa: F401 - re-exported
from models.glm.model.config import GLMConfig

__all__ = ["HFTensor", "config_from_hf", "config_to_hf", "export_hf", "hf_tensors", "write_hf"]

INDEX = "model.safetensors.index.json"
# Kept float32 in a bf16 export, as transformers keeps them (the router; the indexer's head
# weights, `_keep_in_fp32_modules` of GlmMoeDsa).
_FP32_SUFFIXES = (
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    "indexer.weights_proj.weight",
)
_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the transformers checkpoint: rows `row .. row + shape[0]` of our state-dict
    entry `source` (the whole entry for everything but the routed experts)."""

    name: str
    source: str
    row: int
    shape: tuple[int, ...]


def _our_shapes(config: GLMConfig) -> dict[str, tuple[int, ...]]:
    from models.glm.model.model import GLMForCausalLM

    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in GLMForCausalLM(config).state_dict().items()}


def _hf_name(key: str, config: GLMConfig) -> str:
    prefix = "model.mtp_layers."
    if key.startswith(prefix):
        index, rest = key[len(prefix) :].split(".", 1)
        return f"model.layers.{config.num_hidden_layers + int(index)}.{rest}"
    return key


def hf_tensors(config: GLMConfig) -> list[HFTensor]:
    """Every tensor of the transformers checkpoint of `config`, in state-dict order."""
    E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    out = []
    for key, shape in _our_shapes(config).items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = _hf_name(key, config)
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(E):
                out.append(HFTensor(f"{base}{e}.gate_proj.weight", key, e * 2 * I, (I, D)))
                out.append(HFTensor(f"{base}{e}.up_proj.weight", key, e * 2 * I + I, (I, D)))
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(E):
                out.append(HFTensor(f"{base}{e}.down_proj.weight", key, e * D, (D, I)))
        else:
            out.append(HFTensor(name, key, 0, shape))
    return out


# ------------------------------------------------------------------------------------ export


def _file_plan(
    tensors: list[HFTensor], dtypes: dict[str, torch.dtype], max_bytes: int
) -> list[list[HFTensor]]:
    """Consecutive tensors packed into files of at most `max_bytes` (a larger tensor alone)."""
    files: list[list[HFTensor]] = [[]]
    size = 0
    for t in tensors:
        n = _nbytes(t.shape, dtypes[t.name])
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += n
    return files


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return _numel(shape) * dtype.itemsize


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_hf(
    path: str | os.PathLike,
    config: GLMConfig,
    read: Callable[[str, int, int], torch.Tensor],
    *,
    dtype: torch.dtype,
    max_shard_bytes: int,
    rank: int = 0,
    world: int = 1,
) -> list[str]:
    """Write the transformers directory of a model into `path`; returns the files this call
    wrote. `read(source, row, rows)` gives rows `row .. row + rows` of our state-dict entry
    `source` (any dtype; cast to `dtype` here, the router weight and bias stay float32).

    With `world` > 1 every rank calls this with its `rank`: file k is written by rank
    k % world, config.json and the index by rank 0; no collective is involved (the caller
    waits for all ranks before using the directory)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(config)
    dtypes = {t.name: torch.float32 if t.name.endswith(_FP32_SUFFIXES) else dtype for t in tensors}
    files = _file_plan(tensors, dtypes, max_shard_bytes)
    names = [f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))]
    written = []
    for k in range(rank, len(files), world):
        _write_file(path / names[k], files[k], dtypes, read)
        written.append(names[k])
    if rank == 0:
        weight_map = {t.name: names[k] for k, part in enumerate(files) for t in part}
        total = sum(_nbytes(t.shape, dtypes[t.name]) for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX).write_text(json.dumps(index, indent=2))
        (path / "config.json").write_text(json.dumps(config_to_hf(config, dtype), indent=2))
        written += [INDEX, "config.json"]
    return written


def _write_file(out: Path, part: list[HFTensor], dtypes, read) -> None:
    offsets, end = [], 0
    for t in part:
        offsets.append(end)
        end += -(-_nbytes(t.shape, dtypes[t.name]) // 8) * 8  # 8-byte aligned staging slots
    staging_path = out.with_name(f".staging-{out.name}")
    tmp = out.with_name(f".tmp-{out.name}")
    try:
        staging = torch.from_file(
            str(staging_path), shared=True, size=max(end, 1), dtype=torch.uint8
        )
        specs = {}
        for t, off in zip(part, offsets, strict=True):
            dt, n = dtypes[t.name], _nbytes(t.shape, dtypes[t.name])
            slot = staging[off : off + n].view(dt).view(t.shape)
            slot.copy_(read(t.source, t.row, t.shape[0] if t.shape else 1).reshape(t.shape))
            name = str(dt).removeprefix("torch.")
            specs[t.name] = TensorSpec(
                dtype=name, shape=list(t.shape), data_ptr=slot.data_ptr(), data_len=n
            )
        serialize_file(specs, str(tmp), metadata={"format": "pt"})
        del staging, slot
        os.replace(tmp, out)
    finally:
        staging_path.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def export_hf(
    model_or_state_dict,
    config: GLMConfig,
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 << 30,
) -> list[str]:
    """Write a GLMForCausalLM (or its state dict) as a transformers directory from this process.
    `dtype` None: the dtype of the embedding.

    A sharded model (DTensors) is gathered one state-dict entry at a time (the whole entry,
    e.g. a fused expert stack, on every rank; a collective every rank joins) and rank 0 writes:
    for tests and small models. Large models are exported from their checkpoint (the recipe's
    `export_checkpoint`, scripts/export_hf.py), where no rank gathers anything."""
    import torch.distributed as dist

    sd = model_or_state_dict
    sd = sd.state_dict() if hasattr(sd, "state_dict") else sd
    dtype = dtype or sd["model.embed_tokens.weight"].dtype
    cached: dict[str, torch.Tensor] = {}

    def read(source: str, row: int, rows: int) -> torch.Tensor:
        if source not in cached:  # experts come in row order: gather each entry once
            cached.clear()
            t = sd[source].detach()
            cached[source] = t.full_tensor() if hasattr(t, "full_tensor") else t
        t = cached[source]
        return t.narrow(0, row, rows) if t.ndim and rows != t.shape[0] else t

    if dist.is_initialized() and dist.get_rank() != 0:
        if any(hasattr(v, "full_tensor") for v in sd.values()):
            for t in hf_tensors(config):  # the same gathers, in the same order, as rank 0
                read(t.source, t.row, t.shape[0] if t.shape else 1)
        return []
    return write_hf(path, config, read, dtype=dtype, max_shard_bytes=max_shard_bytes)
