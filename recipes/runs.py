"""Training runs read back for comparison: `train.py` run directories and W&B API runs.

A run is its resolved config (nested as in config.yaml, or flat / `{value: ...}` as W&B's API
gives it) and its logged rows (one per logged step, the keys `recipes.trainer` writes).
Used by `scripts/compare_strategies.py` and `scripts/compare_optimizers.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipes.metrics_file import read_metrics
from recipes.outputs import OutputExists, add_force_argument, check_output, replace_output


@dataclass
class Run:
    """One training run: its resolved config and its logged steps."""

    name: str
    source: str  # "jsonl" or "wandb-api"
    path: str
    config: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)

    def config_value(self, dotted: str) -> Any:
        return lookup(self.config, dotted)


def lookup(config: dict[str, Any], dotted: str) -> Any:
    """`optim.remainder_strategy` of a run's nested config (`nested_config`'s shape); None when
    a part is missing."""
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def nested_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config in the one shape `lookup` reads, train.py's nested one: W&B's
    `{value: ..., desc: ...}` wrappers unwrapped, flat `a.b.c` keys (W&B sweeps) nested."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and "value" in value and set(value) <= {"value", "desc"}:
            value = value["value"]
        if isinstance(value, dict):
            value = nested_config(value)
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def read_hydra_run(run_dir: Path) -> Run:
    """A `train.py` run directory: metrics.jsonl and the resolved config."""
    import yaml

    for name in ("config.yaml", ".hydra/config.yaml"):
        if (run_dir / name).exists():
            config = nested_config(yaml.safe_load((run_dir / name).read_text()) or {})
            break
    else:
        raise FileNotFoundError(f"{run_dir}: no config.yaml or .hydra/config.yaml")
    history = read_metrics(run_dir / "metrics.jsonl").rows  # a cut last line left out
    return Run(run_dir.name, "jsonl", str(run_dir), config, history)


def read_wandb_api(project_path: str, group: str | None = None, api=None) -> list[Run]:
    """Runs of `entity/project` (optionally one group) from the W&B API."""
    if api is None:
        import wandb

        api = wandb.Api()
    filters = {"group": group} if group else None
    runs = []
    for r in api.runs(project_path, filters=filters):
        config = nested_config({k: v for k, v in dict(r.config).items() if not k.startswith("_")})
        history = [dict(row) for row in r.scan_history()]
        for row in history:
            if "step" not in row and "_step" in row:
                row["step"] = row["_step"]
        runs.append(Run(r.name, "wandb-api", f"{project_path}/{r.id}", config, history))
    return runs


def discover(paths: list[Path]) -> list[Run]:
    """`train.py` run directories under `paths` (a run dir, or any directory above run dirs)."""
    runs: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(p)
        if p.suffix == ".wandb" or list(p.glob("run-*.wandb")):
            raise ValueError(
                f"{p}: a W&B offline run; pass the train.py run directory that holds it "
                "(its metrics.jsonl has the same rows), or `wandb sync` it and use --wandb"
            )
        if (p / "metrics.jsonl").exists():
            runs.append(p)
        else:
            runs += sorted(m.parent for m in p.rglob("metrics.jsonl"))
    return [read_hydra_run(r) for r in sorted(set(runs))]


def add_source_arguments(ap) -> None:
    """The run sources of a comparison command line (run/sweep directories, `--wandb`) and
    its output directory (`--out`, `--force`: `recipes.outputs`)."""
    ap.add_argument("paths", nargs="*", type=Path, help="run dirs or sweep dirs of train.py")
    ap.add_argument("--wandb", metavar="ENTITY/PROJECT", help="also read runs from the W&B API")
    ap.add_argument("--group", help="with --wandb: only this W&B group")
    ap.add_argument("--out", type=Path, default=Path("compare"), help="output directory")
    add_force_argument(ap)


def read_sources(ap, args) -> list[Run]:
    """The runs `add_source_arguments`' arguments name (an argparse error when none, or when
    `--out` is taken and `--force` is not given, checked before reading); with `--force`, the
    old `--out` removed (unless it holds a run read)."""
    if not args.paths and not args.wandb:
        ap.error("give run directories or --wandb ENTITY/PROJECT")
    try:
        check_output(args.out, args.force)
        runs = discover(args.paths) if args.paths else []
        if args.wandb:
            runs += read_wandb_api(args.wandb, args.group)
        replace_output(args.out, args.force, [r.path for r in runs if Path(r.path).exists()])
    except OutputExists as err:
        ap.error(str(err))
    return runs


# -------------------------------------------------------------------------------- writing
def fmt(v: Any) -> str:
    """A table cell: 4 significant digits, large numbers whole, None as "-"."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def markdown_table(rows: list[dict], cols: list[str]) -> list[str]:
    """The lines of a markdown table of `cols` over `rows`."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    return lines + ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
