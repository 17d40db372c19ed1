"""Import of a transformers GLM directory (hf_adapter.py describes the layout), tensor by tensor.

`HFDir` reads config.json and the safetensors headers (tensors stored as integers or booleans
are refused by name: a cast would turn them into weights); `check_hf` compares them with the
model of a GLMConfig (missing, mis-shaped, unplaced and wrongly quantized tensors are errors
naming them; so is a declared MTP layer the files lack, unless `init_missing_mtp` says to
keep it initialized: transformers' save_pretrained drops MTP weights); `load_hf` fills a
model's local shards (DTensor or plain) from `safe_open(...).get_slice`, reading at most
`chunk_elems` elements per read (by default one expert matrix; block-wise fp8: the scale rows
covering them, see hf_fp8.py) and casting into the shard, so a rank never holds a tensor it
does not own, nor a fused expert stack.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from models.glm.hf.adapter import INDEX, HFTensor, hf_tensors
from models.glm.hf.config import config_from_hf
from models.glm.hf.fp8 import FP8_DTYPES, SCALE_SUFFIX, dequantize, parse_quantization
from models.glm.model.config import GLMConfig

# safetensors dtypes that hold weights (fp8 ones with their block scales, hf_fp8.py; e8m0 only
# as a scale)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", *FP8_DTYPES, "F8_E8M0")

__all__ = ["HFDir", "check_hf", "import_hf", "load_hf"]


class HFDir:
    """A transformers GLM directory: its config, its quantization format (models/glm/hf/fp8.py)
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
        other = sorted(
            k
            for k, d in self.dtypes.items()
            if d not in _FLOAT_DTYPES or (d == "F8_E8M0" and not k.endswith(SCALE_SUFFIX))
        )
        if other:
            kinds = sorted({self.dtypes[k] for k in other})
            raise ValueError(
                f"{self.path}: {len(other)} tensors are not floating point ({kinds}; e.g. "
                f"{other[:4]}); weights must be one of {list(_FLOAT_DTYPES)}, refusing to cast "
                "them"
            )
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


def check_hf(
    hf: HFDir,
    config: GLMConfig,
    *,
    init_missing_mtp: bool = False,
    init_missing_mtp_key: str = "init_missing_mtp=True",
) -> list[str]:
    """Raise ValueError naming every tensor our model of `config` needs that `hf` lacks or
    holds in another shape or format, and every tensor of the files the model would not read.
    A whole MTP layer the files lack (transformers' save_pretrained drops them) is an error
    too, unless `init_missing_mtp`: it then keeps its initialization, and the MTP tensors
    the files lack are returned (the message names `init_missing_mtp_key`, the caller's
    spelling of the switch). Also allowed: a missing router correction bias (it starts at 0,
    as in transformers) and an MTP layer's copies of the embedding and output head
    (`embed_tokens`, `shared_head.head`: ours shares the model's)."""
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
    if absent_mtp and not init_missing_mtp:
        layers = sorted(p.rstrip(".") for p in absent_mtp)
        raise ValueError(
            f"{hf.path} declares {config.num_mtp_layers} MTP layers (num_nextn_predict_layers) "
            f"but holds no weights of {layers} (transformers' save_pretrained drops them); "
            f"set {init_missing_mtp_key} to train them from their initialization, or "
            "num_mtp_layers=0 to build none"
        )
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
    model: torch.nn.Module,
    hf: HFDir | str | os.PathLike,
    *,
    chunk_elems: int | None = None,
    init_missing_mtp: bool = False,
) -> list[str]:
    """Fill `model` (a GLMForCausalLM, sharded or not) from a transformers directory: every
    local shard reads only its own rows, at most `chunk_elems` elements per read (default:
    one expert matrix), cast on the fly; block-wise fp8 tensors are dequantized from the
    scale rows covering those rows. Checks the files first (`check_hf`; `init_missing_mtp`
    as there). Returns the MTP tensors the files lack, left as initialized."""
    hf = hf if isinstance(hf, HFDir) else HFDir(hf)
    config = model.config
    initialized = check_hf(hf, config, init_missing_mtp=init_missing_mtp)
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
                step = max(1, chunk_elems // max(1, math.prod(t.shape[1:])))
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


def import_hf(
    path: str | os.PathLike, *, init_missing_mtp: bool = False
) -> tuple[GLMConfig, dict[str, torch.Tensor]]:
    """Read a transformers GLM directory into (GLMConfig, our full float32 state dict) in
    one process (fused and per-expert layouts, one file or an index). Raises ValueError
    naming missing or mis-shaped tensors (`init_missing_mtp` as in `check_hf`)."""
    from models.glm.model.model import GLMForCausalLM

    hf = HFDir(path)
    model = GLMForCausalLM(hf.config)
    load_hf(model, hf, init_missing_mtp=init_missing_mtp)
    return hf.config, model.state_dict()
