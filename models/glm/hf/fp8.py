"""Block-wise FP8 checkpoints (DeepSeek-V3 / GLM-5 "-FP8" releases): recognized and dequantized.

Such a directory's config.json carries `quantization_config = {"quant_method": "fp8",
"weight_block_size": [bn, bk], "activation_scheme": "dynamic", ...}` and, next to every quantized
matrix `X.weight` (float8_e4m3fn, [rows, cols]), a scale `X.weight_scale_inv` ([ceil(rows / bn),
ceil(cols / bk)], float32, or float8_e8m0fnu with `scale_fmt: "ue8m0"`): the true weight is
`w[i, j] = fp8[i, j] * scale_inv[i // bn, j // bk]` (transformers' finegrained_fp8 dequantization).
Matrices without a scale (embedding, norms, router, lm_head) are stored unquantized.

`dequantize` rebuilds any row range of one matrix from the matching rows of its scale, so a rank
reads only the rows it owns. Any other quantization (compressed-tensors, per-tensor fp8, fp4
experts, static activation scales, ...) is refused by `parse_quantization` with a message
naming it: loading the stored values as weights would be silently wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names of torch.float8_e4m3fn / e5m2
_SCALE_DTYPES = {"float": ("F32", "BF16", "F16"), "ue8m0": ("F8_E8M0",)}


@dataclass(frozen=True)
class Fp8Blocks:
    """The block-wise fp8 format of a checkpoint: scale blocks of `block` = (rows, cols)."""

    block: tuple[int, int]
    scale_fmt: str  # "float" (fp32 scales) or "ue8m0" (power-of-two byte scales)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a quantized tensor of `shape` (last two dims blocked)."""
        bn, bk = self.block
        return (*shape[:-2], -(-shape[-2] // bn), -(-shape[-1] // bk))

    def scale_dtypes(self) -> tuple[str, ...]:
        """The safetensors dtypes a scale of this format may have."""
        return _SCALE_DTYPES[self.scale_fmt]


def describe(qc: dict) -> str:
    """A short name of a quantization_config, for error messages."""
    parts = [f"quant_method={qc.get('quant_method')!r}"]
    for key in ("fmt", "format", "weight_block_size", "activation_scheme", "scale_fmt"):
        if key in qc:
            parts.append(f"{key}={qc[key]!r}")
    return ", ".join(parts)


def parse_quantization(hf: dict, where: str) -> Fp8Blocks | None:
    """The format of config.json's `quantization_config` (None when there is none). Raises
    ValueError naming the format unless it is block-wise fp8 with dynamic activations."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    refuse = (
        f"{where}: quantization_config ({describe(qc)}) cannot be loaded; only block-wise fp8 "
        "(quant_method 'fp8' with weight_block_size [rows, cols] and *.weight_scale_inv scales, "
        "dynamic activations) is dequantized on load"
    )
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8":
        raise ValueError(refuse)
    block = qc.get("weight_block_size")
    ok_block = (
        isinstance(block, list | tuple)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    )
    if not ok_block:
        raise ValueError(refuse + f"; weight_block_size {block!r} is not two positive ints")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(refuse + f"; activation_scheme {qc['activation_scheme']!r}")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise ValueError(refuse + f"; expert_dtype {qc['expert_dtype']!r}")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in _SCALE_DTYPES:
        raise ValueError(refuse + f"; scale_fmt {scale_fmt!r}")
    return Fp8Blocks((block[0], block[1]), scale_fmt)


def dequantize(
    fmt: Fp8Blocks, values: torch.Tensor, scale_sl, rows: tuple[int, int], expert: int | None
) -> torch.Tensor:
    """float32 weights of rows `rows` = (r0, r1) of one quantized matrix: `values` are those
    rows as stored (fp8, [r1 - r0, cols]); `scale_sl` is the scale's safetensors slice (of a
    fused [E, ...] stack when `expert` is given), of which only the block rows covering
    r0 .. r1 are read."""
    bn, bk = fmt.block
    r0, r1 = rows
    b0, b1 = r0 // bn, -(-r1 // bn)
    scale = scale_sl[b0:b1] if expert is None else scale_sl[expert : expert + 1, b0:b1][0]
    scale = scale.float().repeat_interleave(bn, dim=0)[r0 - b0 * bn : r1 - b0 * bn]
    scale = scale.repeat_interleave(bk, dim=1)[:, : values.shape[-1]]
    return values.float() * scale
