"""Per-rank cost of materializing and initializing a sharded GLM model, across meshes.

For every mesh (world size, ep) a gloo CPU world is started; each rank builds the preset on the
meta device, parallelizes it (EP + FSDP2), then measures `model.to_empty(device="cpu")` +
`init_weights(model, seed)` (models.glm.infra.init): the peak live bytes (c10's CPU allocator
counter through `recipes.memory.MemoryMeter`), the thread CPU time of init_weights (immune to
other processes on the machine) and the random values drawn. Afterwards the full parameters are
gathered and hashed, so equal digests across meshes show that the values do not depend on the
mesh.

    python scripts/measure_init.py --preset small --meshes 1:1 4:2 8:4 --out init.json

Prints one row per mesh with the per-rank maximum of each figure and its ratio to the first
mesh, and writes the table and per-rank figures as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.ranks import local_tensor
from recipes.units import MiB
from recipes.world import run_world


def _rank_main(preset: str, ep: int, seed: int, repeats: int) -> dict:
    from models.glm import GLMForCausalLM, get_preset
    from models.glm.infra.init import init_weights
    from models.glm.infra.parallelize import build_meshes, parallelize
    from recipes.memory import MemoryMeter

    meter = MemoryMeter("cpu")
    config = get_preset(preset)
    runs = []
    for _ in range(repeats):
        with torch.device("meta"):
            model = GLMForCausalLM(config)
        parallelize(model, build_meshes(dist.get_world_size(), ep, "cpu"))
        dist.barrier()
        with meter.measure("init") as m:
            t0 = time.thread_time()
            model.to_empty(device="cpu")
            t1 = time.thread_time()
            drawn = init_weights(model, seed)
            t2 = time.thread_time()
        runs.append(
            {
                "peak_mib": m.peak_delta_bytes() / MiB,
                "materialize_cpu_s": t1 - t0,
                "init_cpu_s": t2 - t1,
                "drawn": drawn,
            }
        )
        if len(runs) < repeats:
            del model
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    best["shard_mib"] = sum(local_tensor(p).nbytes for p in model.parameters()) / MiB
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        digest.update(name.encode())
        digest.update(full.contiguous().view(torch.uint8).numpy().tobytes())
    best["digest"] = digest.hexdigest()[:16]
    return best


def run_mesh(preset: str, world_size: int, ep: int, seed: int, repeats: int) -> list[dict]:
    """Per-rank figures of one mesh, in rank order."""
    return run_world(_rank_main, world_size, preset, ep, seed, repeats, timeout_s=1800)


def table(rows: list[dict]) -> str:
    """The printed table: per-rank maxima and ratios to the first mesh."""
    base = rows[0]
    head = "mesh          peak MiB  ratio  init cpu s  ratio  drawn/rank  ratio   shard MiB  digest"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"W={r['world_size']:<2} ep={r['ep']:<2}   {r['peak_mib']:8.2f}  "
            f"{r['peak_mib'] / base['peak_mib']:5.3f}  {r['init_cpu_s']:10.4f}  "
            f"{r['init_cpu_s'] / base['init_cpu_s']:5.3f}  {r['drawn']:10d}  "
            f"{r['drawn'] / base['drawn']:5.3f}  "
            f"{r['shard_mib']:10.2f}  {r['digest']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small", help="models.glm preset")
    ap.add_argument(
        "--meshes", nargs="+", default=["1:1", "4:2", "8:4"], help="world_size:ep, first = base"
    )
    ap.add_argument("--seed", type=int, default=0, help="init seed")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per rank (min kept)")
    ap.add_argument("--rounds", type=int, default=2, help="times every mesh is run (interleaved)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    meshes = []
    for spec in args.meshes:
        try:
            meshes.append(tuple(int(x) for x in spec.split(":")))
        except ValueError:
            ap.error(f"--meshes: {spec!r} is not world_size:ep (e.g. 4:2)")
    # Rounds interleave the meshes, so a burst of load from other processes hits them alike;
    # each rank keeps its minimum over rounds and repeats.
    best: dict[tuple[int, int], list[dict]] = {}
    for _ in range(args.rounds):
        for world_size, ep in meshes:
            per_rank = run_mesh(args.preset, world_size, ep, args.seed, args.repeats)
            old = best.setdefault((world_size, ep), per_rank)
            for mine, new in zip(old, per_rank, strict=True):
                for key in ("peak_mib", "init_cpu_s", "materialize_cpu_s"):
                    mine[key] = min(mine[key], new[key])
    rows = []
    for (world_size, ep), per_rank in best.items():
        row = {"world_size": world_size, "ep": ep, "per_rank": per_rank}
        for key in ("peak_mib", "init_cpu_s", "materialize_cpu_s", "drawn", "shard_mib"):
            row[key] = max(r[key] for r in per_rank)
        digests = {r["digest"] for r in per_rank}
        if len(digests) != 1:
            raise RuntimeError(f"ranks of W={world_size} ep={ep} disagree on the digest")
        row["digest"] = digests.pop()
        rows.append(row)
    print(f"preset {args.preset}: per-rank materialize + init (max over ranks)")
    print(table(rows))
    same = len({r["digest"] for r in rows}) == 1
    print(f"values identical across meshes: {same}")
    if args.out:
        args.out.write_text(json.dumps({"preset": args.preset, "rows": rows}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
