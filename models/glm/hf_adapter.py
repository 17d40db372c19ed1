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
Block-wise fp8 releases are dequantized on import (hf_fp8.py); a tensor of the files the model
has no place for is an error, not silently dropped.

Memory: the export holds one tensor at a time in process memory. Each output file is assembled
in a file-backed shared map (page cache, not process memory) and then written by the
safetensors library, which needs every tensor of a file addressable at once. The import fills a
model's local shards (DTensor or plain) from `safe_open(...).get_slice`, reading at most
`chunk_elems` elements per read (by default one expert matrix; fp8: the matching scale rows)
and casting into the shard, so a rank never holds a tensor it does not own, nor a fused expert
stack.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import TensorSpec, safe_open, serialize_file

from models.glm.config import GLMConfig
from models.glm.hf_config import config_from_hf, config_to_hf
from models.glm.hf_fp8 import FP8_DTYPES, SCALE_SUFFIX, dequantize, parse_quantization

__all__ = [
    "HFTensor",
    "config_from_hf",
    "config_to_hf",
    "check_hf",
    "export_hf",
    "hf_tensors",
    "import_hf",
    "load_hf",
    "write_hf",
]

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
    from models.glm.model import GLMForCausalLM

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


# ------------------------------------------------------------------------------------ import


class HFDir:
    """A transformers GLM directory: its config, its quantization format (models/glm/hf_fp8.py)
    and the name, shape, dtype and file of every tensor (read from the safetensors headers
    only). Raw fp8 tensors without a block-wise `quantization_config` are refused here."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"{self.path}: no config.json (a transformers directory?)")
        raw = json.loads((self.path / "config.json").read_text())
        self.quant = parse_quantization(raw, f"{self.path}/config.json")
        self.config = config_from_hf(raw)
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{self.path}: no .safetensors files")
        self.file_of: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for name in files:
            with safe_open(str(self.path / name), "pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    sl = f.get_slice(key)
                    self.file_of[key] = name
                    self.shapes[key] = tuple(sl.get_shape())
                    self.dtypes[key] = sl.get_dtype()
        fp8 = sorted(k for k, d in self.dtypes.items() if d in FP8_DTYPES)
        if fp8 and self.quant is None:
            raise ValueError(
                f"{self.path}: {len(fp8)} tensors are stored as fp8 (e.g. {fp8[:3]}) but "
                "config.json has no quantization_config, so their scales are unknown; refusing "
                "to load quantized values as weights"
            )

    def locate(self, t: HFTensor, config: GLMConfig) -> tuple[str, int | None, int] | None:
        """(key, expert index or None, first row) where `t` is stored, or None if absent:
        per-expert 2-D keys, or a row block of transformers' fused 3-D expert tensors."""
        if t.name in self.shapes:
            return t.name, None, 0
        base, sep, rest = t.name.rpartition(".experts.")
        if not sep:
            return None
        e, part, _ = rest.split(".")
        I = config.moe_intermediate_size
        fused = f"{base}.experts.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}"
        if fused in self.shapes:
            return fused, int(e), I if part == "up_proj" else 0
        return None

    def is_fp8(self, key: str) -> bool:
        """Whether `key` holds block-quantized fp8 values (with a `<key>_scale_inv`)."""
        return self.dtypes[key] in FP8_DTYPES


def _mtp_prefixes(config: GLMConfig) -> list[str]:
    N = config.num_hidden_layers
    return [f"model.layers.{N + i}." for i in range(config.num_mtp_layers)]


def check_hf(hf: HFDir, config: GLMConfig) -> list[str]:
    """Raise ValueError naming every tensor our model of `config` needs that `hf` lacks or
    holds in another shape or format, and every tensor of the files the model would not read.
    Returns the MTP tensors the files lack: a whole MTP layer may be absent (transformers'
    save_pretrained drops it) and keeps its initialization. Also allowed: a missing router
    correction bias (it starts at 0, as in transformers) and an MTP layer's copies of the
    embedding and output head (`embed_tokens`, `shared_head.head`: ours shares the model's)."""
    E, I, D = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    mtp = _mtp_prefixes(config)
    missing, wrong, absent_mtp, used = [], [], {}, set()
    present_mtp: set[str] = set()
    for t in hf_tensors(config):
        layer = next((p for p in mtp if t.name.startswith(p)), None)
        where = hf.locate(t, config)
        if where is None:
            if layer is not None:
                absent_mtp.setdefault(layer, []).append(t.name)
            elif not t.name.endswith("e_score_correction_bias"):
                missing.append(t.name)
            continue
        if layer is not None:
            present_mtp.add(layer)
        key, e, _ = where
        used.add(key)
        want = (
            t.shape if e is None else ((E, 2 * I, D) if key.endswith("gate_up_proj") else (E, D, I))
        )
        if hf.shapes[key] != want:
            wrong.append(f"{key}: {hf.shapes[key]} in the files, the model needs {want}")
        scale = key + SCALE_SUFFIX
        if hf.is_fp8(key):
            used.add(scale)
            if len(want) < 2:
                wrong.append(f"{key}: an fp8 tensor of {len(want)} dims (blocks need 2)")
            elif scale not in hf.shapes:
                missing.append(scale)
            elif hf.shapes[scale] != hf.quant.scale_shape(want):
                wrong.append(
                    f"{scale}: {hf.shapes[scale]} in the files, blocks "
                    f"{list(hf.quant.block)} of {want} need {hf.quant.scale_shape(want)}"
                )
            elif hf.dtypes[scale] not in hf.quant.scale_dtypes():
                wrong.append(f"{scale}: dtype {hf.dtypes[scale]} (scale_fmt {hf.quant.scale_fmt})")
    for layer in present_mtp & set(absent_mtp):  # half an MTP layer is a broken file
        missing += absent_mtp.pop(layer)
    used |= {p + name for p in mtp for name in ("embed_tokens.weight", "shared_head.head.weight")}
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # a tied head saved anyway is the embedding again
    unused = sorted(set(hf.shapes) - used)
    if missing or wrong or unused:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensors: {missing[:8]}")
        if wrong:
            parts.append(f"{len(set(wrong))} of the wrong shape: {sorted(set(wrong))[:8]}")
        if unused:
            parts.append(f"{len(unused)} tensors the model has no place for: {unused[:8]}")
        raise ValueError(f"{hf.path} does not fit the model: " + "; ".join(parts))
    return [name for names in absent_mtp.values() for name in names]


def _local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, its first global row); only row (dim-0) sharding."""
    if not hasattr(t, "to_local"):
        return t, 0
    (chunk,) = t.__create_chunk_list__()
    if any(o for o in chunk.offsets[1:]) or tuple(chunk.sizes[1:]) != tuple(t.shape[1:]):
        raise ValueError(f"only row-sharded tensors can be loaded; got {t.placements}")
    return t.to_local(), (chunk.offsets[0] if len(chunk.offsets) else 0)


@torch.no_grad()
def load_hf(
    model: torch.nn.Module, hf: HFDir | str | os.PathLike, *, chunk_elems: int | None = None
) -> list[str]:
    """Fill `model` (a GLMForCausalLM, sharded or not) from a transformers directory: every
    local shard reads only its own rows, at most `chunk_elems` elements per read (default:
    one expert matrix), cast on the fly; block-wise fp8 tensors are dequantized from the
    scale rows covering those rows. Checks the files first (`check_hf`). Returns the MTP
    tensors the files lack, left as initialized."""
    hf = hf if isinstance(hf, HFDir) else HFDir(hf)
    config = model.config
    initialized = check_hf(hf, config)
    chunk_elems = chunk_elems or config.moe_intermediate_size * config.hidden_size
    by_source: dict[str, list[HFTensor]] = {}
    for t in hf_tensors(config):
        by_source.setdefault(t.source, []).append(t)
    skip = set(initialized)
    with ExitStack() as files:
        handles = {}

        def slice_of(name: str):
            file = hf.file_of[name]
            if file not in handles:
                handles[file] = files.enter_context(safe_open(str(hf.path / file), "pt"))
            return handles[file].get_slice(name)

        for key, tensor in model.state_dict().items():
            if key not in by_source:
                continue  # the tied lm_head shares the embedding
            local, first = _local_rows(tensor)
            for t in by_source[key]:
                if t.name in skip:
                    continue
                rows = t.shape[0] if t.shape else 1
                lo, hi = max(first, t.row), min(first + local.shape[0], t.row + rows)
                if not local.ndim:
                    lo, hi = 0, 1
                if lo >= hi:
                    continue
                where = hf.locate(t, config)
                if where is None:  # an absent correction bias (check_hf allowed it)
                    local[lo - first : hi - first].zero_()
                    continue
                name, expert, base = where
                sl = slice_of(name)
                scale = slice_of(name + SCALE_SUFFIX) if hf.is_fp8(name) else None
                step = max(1, chunk_elems // max(1, _numel(t.shape[1:])))
                for a in range(lo, hi, step):
                    b = min(hi, a + step)
                    r0, r1 = a - t.row + base, b - t.row + base
                    piece = sl[r0:r1] if expert is None else sl[expert : expert + 1, r0:r1][0]
                    if scale is not None:
                        piece = dequantize(hf.quant, piece, scale, (r0, r1), expert)
                    if not local.ndim:
                        local.copy_(piece.reshape(()))
                    else:
                        local[a - first : b - first].copy_(piece)
    return initialized


def import_hf(path: str | os.PathLike) -> tuple[GLMConfig, dict[str, torch.Tensor]]:
    """Read a transformers GLM directory into (GLMConfig, our full float32 state dict) in
    one process (fused and per-expert layouts, one file or an index). Raises ValueError
    naming missing or mis-shaped tensors."""
    from models.glm.model import GLMForCausalLM

    hf = HFDir(path)
    model = GLMForCausalLM(hf.config)
    load_hf(model, hf)
    return hf.config, model.state_dict()
