"""Export the model of a checkpoint as a transformers GLM directory (Glm4Moe or GlmMoeDsa).

    python scripts/export_hf.py <run dir>/checkpoints/step_00001000 <out dir>
    torchrun --nproc-per-node 8 scripts/export_hf.py <checkpoint> <out dir> --dtype bfloat16

Writes `config.json`, `model-0000k-of-0000n.safetensors` (each at most `--max-shard-gib`) and
`model.safetensors.index.json` (MLA models in the glm_moe_dsa layout of GLM-5, MTP layers as
`model.layers.{num_hidden_layers + i}`). One process or any number of ranks (torchrun / srun
set RANK and WORLD_SIZE): rank r writes files r, r + W, ...; each tensor is read from the sharded
checkpoint on its own, so a process holds one tensor at a time, whatever the model size. An
`out` that exists and is not empty is refused; `--force` replaces it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from recipes import checkpoint
from recipes.hf import export_checkpoint
from recipes.outputs import OutputExists, add_force_argument, check_output, clear_output, is_taken


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, export, print the files written; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a committed step_* checkpoint directory")
    parser.add_argument("out", type=Path, help="the transformers directory to write")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-shard-gib", type=float, default=5.0)
    add_force_argument(parser)
    args = parser.parse_args(argv)
    problem = _not_a_checkpoint(args.checkpoint)
    if problem:
        parser.error(problem)
    if args.max_shard_gib <= 0:
        parser.error(f"--max-shard-gib must be > 0, got {args.max_shard_gib}")
    try:  # every rank, before any writes (they wait for each other below)
        check_output(args.out, args.force, "out", inputs=[args.checkpoint])
    except OutputExists as err:
        parser.error(str(err))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")  # only for barriers: no tensor is exchanged
    created = not args.out.exists()
    try:
        if int(os.environ.get("RANK", "0")) == 0 and is_taken(args.out):  # --force
            clear_output(args.out)
        if dist.is_initialized():
            dist.barrier()  # nobody writes before every rank has checked and rank 0 cleared
        written = export_checkpoint(
            args.checkpoint,
            args.out,
            dtype=getattr(torch, args.dtype),
            max_shard_gib=args.max_shard_gib,
        )
    except ValueError as err:  # refused: a damaged checkpoint, non-finite weights
        if created and world == 1:
            shutil.rmtree(args.out, ignore_errors=True)  # no half export left behind
        print(f"export_hf.py: {err}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    rank = int(os.environ.get("RANK", "0"))
    for name in written:
        print(f"[rank {rank}] wrote {args.out / name}")
    return 0


def _not_a_checkpoint(path: Path) -> str | None:
    """What is wrong with `path` as a checkpoint to export (None: it is a committed one), with
    the committed checkpoints beside or inside it (their names are `step_<8 digits>`)."""
    if (path / checkpoint.COMMITTED).is_file():
        return None
    inside = [p.name for p in checkpoint.committed(path)]
    if inside:
        return f"{path}: not a checkpoint but holds the committed ones {', '.join(inside)}"
    beside = [p.name for p in checkpoint.committed(path.parent)]
    found = (
        f"committed checkpoints in {path.parent}: {', '.join(beside)}"
        if beside
        else f"{path.parent} holds no committed checkpoint"
    )
    if not path.exists():
        return f"{path}: no such directory ({found})"
    return f"{path}: not a committed checkpoint (no {checkpoint.COMMITTED}; {found})"


if __name__ == "__main__":
    sys.exit(main())
