"""The command-line spellings of the dtypes the dry-run planner and the benchmarks take."""

import torch

#: "bf16", "fp32", "fp16" -> the torch dtype
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
