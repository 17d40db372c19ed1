"""Per-rank memory of checkpointing and of the transformers export / import, across world sizes.

For each layout (W ranks, ep) a gloo world builds the preset's model and the Muon optimizer as a
run does, takes one optimizer step on random tokens, and measures with `recipes.memory`
(c10's allocator counter on CPU, the caching allocator on CUDA), per rank:

- own:      bytes of the rank's own state (parameter shards, optimizer state, buffers)
- largest:  its largest single local tensor
- save:     peak above the state during a synchronous sharded save (`recipes.checkpoint`)
- load:     peak above the state while a fresh model and optimizer load that checkpoint
- export:   peak during `recipes.hf.export_checkpoint` (rank r writes files r, r + W, ...)
- import:   peak above a fresh model while it fills its shards from the export (`init_from`)
- files:    checkpoint files this rank wrote (model + optimizer)

    python scripts/bench_checkpoint.py --preset small --layouts 1x1 2x2 4x2 --out bench_ckpt

Prints a table (max over ranks) and writes `results.json` and `table.md` into `--out`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from recipes.bench.cli import command_line
from recipes.ranks import local_tensor
from recipes.units import MiB
from recipes.world import run_world as _run_world


def _worker(cfg: dict) -> dict:
    import torch.distributed as dist
    from omegaconf import OmegaConf

    from recipes import checkpoint
    from recipes.build import build_model, build_optimizer, model_config
    from recipes.config import Config
    from recipes.hf import export_checkpoint, init_from
    from recipes.memory import MemoryMeter

    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = [
        f"model.preset={cfg['preset']}",
        f"mesh.world_size={world}",
        f"mesh.ep={cfg['ep']}",
    ]
    run = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(overrides))
    device = torch.device("cpu")
    meter = MemoryMeter(device)
    config = model_config(run)  # one GLMConfig, for every model built below

    def build():
        model = build_model(run, config, device)
        return model, build_optimizer(run.optim, model)

    model, opt = build()
    gen = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, run.data.vocab_size, (2, 32), generator=gen)
    model.loss(ids, ids).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tensors = [local_tensor(t) for t in model.state_dict().values()]
    tensors += [local_tensor(v) for st in opt.state.values() for v in st.values()]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    out = {"rank": rank, "own": sum(t.nbytes for t in tensors)}
    out["largest"] = max(t.nbytes for t in tensors)
    root = Path(cfg["dir"]) / f"w{world}"
    state = {"model_config": config.to_dict()}
    with meter.measure("save") as m:
        ckpt = checkpoint.save(root / "ckpt", 1, model, opt, state, keep=1)
    out["save"] = m.peak_delta_bytes()
    out["files"] = sum(
        (ckpt / part / f"__{rank}_0.distcp").is_file() for part in ("model", "optim")
    )
    with meter.measure("export") as m:
        export_checkpoint(ckpt, root / "hf", max_shard_gib=cfg["max_shard_gib"])
    out["export"] = m.peak_delta_bytes()
    del model, opt, tensors
    fresh, fresh_opt = build()
    with meter.measure("load") as m:
        checkpoint.load(ckpt, fresh, fresh_opt)
    out["load"] = m.peak_delta_bytes()
    del fresh, fresh_opt
    fresh, _ = build()
    with meter.measure("import") as m:
        init_from(fresh, root / "hf")
    out["import"] = m.peak_delta_bytes()
    c = config
    out["expert"] = 3 * c.moe_intermediate_size * c.hidden_size * 4
    return out


def run_world(cfg: dict) -> list[dict]:
    """The W gloo ranks (recipes.world); every rank's record."""
    return _run_world(_worker, cfg["world_size"], cfg, timeout_s=1800)


COLUMNS = ("own", "largest", "save", "load", "export", "import", "expert")


def table(rows: list[dict], command: str) -> str:
    """Markdown: one line per layout, MiB, max over ranks (files: min over ranks)."""
    head = "| W | ep | " + " | ".join(f"{c} MiB" for c in COLUMNS) + " | files/rank |"
    lines = [f"`{command}`", "", head, "|" + "---|" * (len(COLUMNS) + 3)]
    for r in rows:
        figures = " | ".join(f"{r[c] / MiB:.3f}" for c in COLUMNS)
        lines.append(f"| {r['world']} | {r['ep']} | {figures} | {r['files']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    """Measure every layout; print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x2", "4x2"], help="WxEP")
    parser.add_argument("--max-shard-gib", type=float, default=0.001)
    parser.add_argument("--out", type=Path, default=Path("bench_checkpoint_out"))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            world, ep = (int(x) for x in layout.split("x"))
            cfg = dict(preset=args.preset, world_size=world, ep=ep, dir=tmp)
            cfg["max_shard_gib"] = args.max_shard_gib
            ranks = run_world(cfg)
            row = {c: max(r[c] for r in ranks) for c in COLUMNS}
            row.update(world=world, ep=ep, files=min(r["files"] for r in ranks), ranks=ranks)
            rows.append(row)
    text = table(rows, command_line("bench_checkpoint.py", argv))
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    (args.out / "table.md").write_text(text)
    return rows


if __name__ == "__main__":
    main()
