"""The dtype a model's sensitive arithmetic runs in, one rule for every module."""

from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, RoPE, attention scores and softmax compute in: float32, or `dtype` when
    it is wider (a float64 model is not cut to float32)."""
    return torch.promote_types(dtype, torch.float32)
