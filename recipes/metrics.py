"""Rank 0's metric sinks (metrics.jsonl, W&B), the metric names they share, and the summary.

`metrics.jsonl` holds one JSON object per logged step. On a resume, lines past the resumed step
(written by the killed process after its last checkpoint) are dropped, so the file reads as
one uninterrupted run; a last line cut by a crash or a full disk is dropped with a warning, and
any other line that is not a row stops the resume, naming its line (`recipes.metrics_file`).
W&B runs offline by default: files under `<run dir>/wandb/`, nothing sent
(`wandb sync <run dir>/wandb/offline-run-*` uploads later); `logger.mode=online` sends.
The W&B run id is kept in the run dir so a resumed job continues the same W&B run, and so is
the last step sent to it: a resumed job sends only later steps, so no step is logged twice.
W&B records system metrics and the repository's git commit unless `logger.system_metrics` /
`logger.git` turn them off; run summaries hold the peak (max) of every memory and time metric
and the lowest loss, not their last values.
"""

import json
import logging
import math
import os
import statistics
import uuid
from pathlib import Path
from typing import Any

import torch

from recipes.metrics_file import read_metrics

log = logging.getLogger("recipes")

#: the repository whose git commit a W&B run records (train.py's checkout)
REPO_ROOT = Path(__file__).resolve().parents[1]

#: per-rank figures that rank 0 logs as `<key>/max` and `<key>/min` over ranks
RANK_EXTREMES = (
    "muon/bytes_sent",
    "muon/bytes_recv",
    "muon/wait_s",
    "muon/ns_s",
    "muon/remainder/bytes_sent",
    "muon/remainder/bytes_recv",
)

#: the counters `muon.Muon.step_stats` keeps per exchange path (`muon/<path>/<stat>`)
REMAINDER_STATS = ("bytes_sent", "bytes_recv", "matrices", "batches")


def remainder_metrics(step_stats: dict[str, float]) -> dict[str, float]:
    """The remainder exchange's counters under strategy-neutral names.

    `muon.Muon.step_stats` names counters by exchange path (`muon/agrs/bytes_sent`,
    `muon/ragged_all_to_all/bytes_sent`, ...), so each strategy's runs log a different key and
    no single panel overlays them. This returns `muon/remainder/<stat>`: the sum over the
    remainder paths (`muon.plan.REMAINDER_STRATEGIES`), which is the configured strategy's path,
    or with `remainder_strategy=auto` the paths it chose batch by batch. With
    `enable_all2all=false` every exchanged batch takes `agrs` and is counted. A step without a
    remainder batch sent nothing on those paths: 0. Empty for runs without Muon statistics
    (AdamW), and when the optimizer already reports `muon/remainder/*` itself.
    """
    from muon.plan import REMAINDER_STRATEGIES

    if not step_stats or any(key.startswith("muon/remainder/") for key in step_stats):
        return {}
    return {
        f"muon/remainder/{stat}": float(
            sum(step_stats.get(f"muon/{path}/{stat}", 0.0) for path in REMAINDER_STRATEGIES)
        )
        for stat in REMAINDER_STATS
    }


class DeviceValues:
    """A step's figures that live on the device (losses, gradient norms, attention logits),
    kept as tensors until they are logged, then read together: `read` stacks them into one
    float64 tensor and reads it with one device-to-host copy (float64 holds every float32 and
    float64 value exactly, so the floats are those `.item()` of each would give). Figures
    already on the host (Python numbers) are kept as they are."""

    def __init__(self) -> None:
        self._values: dict[str, torch.Tensor | float] = {}

    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Keep `value` (a tensor of any shape, or a number) under `name`."""
        self._values[name] = value.detach() if isinstance(value, torch.Tensor) else float(value)

    def read(self) -> dict[str, list[float]]:
        """Every value as a flat list of floats (one host read; none without tensors)."""
        tensors = {k: v for k, v in self._values.items() if isinstance(v, torch.Tensor)}
        out = {k: [v] for k, v in self._values.items() if not isinstance(v, torch.Tensor)}
        if not tensors:
            return out
        device = next(iter(tensors.values())).device
        flat = [v.reshape(-1).to(device=device, dtype=torch.float64) for v in tensors.values()]
        host = torch.cat(flat).tolist()
        start = 0
        for name, v in zip(tensors, flat, strict=True):
            out[name] = host[start : start + v.numel()]
            start += v.numel()
        return out


#: the auxiliary training losses a step may log next to `loss` (the next-token loss)
AUX_LOSSES = ("mtp_loss", "indexer_kl")


def summary_rule(key: str) -> str | None:
    """How a W&B run summarizes a metric: `min` for the training, auxiliary and validation
    losses, `max` for memory and times (so run tables and bar charts show peaks), None (W&B's
    default: the last value) otherwise."""
    if key in ("loss", "val/loss", "val/bpb") or key in AUX_LOSSES:
        return "min"
    if key.startswith("memory/"):
        return "max"
    base = key.removesuffix("/max").removesuffix("/min")
    if base.endswith("_s") and not base.endswith("per_s"):  # seconds: step_s, muon/wait_s, ...
        return "max"
    return None


def _last_step(path: Path) -> int:
    if not path.exists():
        return 0
    text = path.read_text().strip()
    return int(text) if text else 0


def truncate_after(path: Path, step: int) -> None:
    """Keep the rows up to `step` (a resume drops what the killed process logged after its
    checkpoint); a cut last line is dropped with a warning, any other bad line raises."""
    if not path.exists():
        return
    found = read_metrics(path)
    if found.cut is not None:
        shown = found.cut if len(found.cut) <= 80 else found.cut[:77] + "..."
        log.warning(
            "%s:%d: the last line is cut (a crash or a full disk while writing it), dropped: %r",
            path,
            found.cut_line,
            shown,
        )
    kept = [row for row in found.rows if row["step"] <= step]
    path.write_text("".join(f"{json.dumps(row)}\n" for row in kept))


class MetricsLog:
    """Rank 0's writer of metrics.jsonl and, with `logger.backend=wandb`, one W&B run."""

    def __init__(
        self,
        run_dir: Path,
        config: dict[str, Any],
        start_step: int,
        *,
        world: dict[str, Any] | None = None,
    ) -> None:
        """`world` ({"world_size": W, "hosts": [rank 0's host, ...]}) goes into the first row
        written by this process (each start or resume) and into the W&B run's config."""
        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_after(self.path, start_step)
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.world = dict(world or {})
        self.wandb_run = None
        self.defined: set[str] = set()
        # Steps up to here reached W&B before a restart; W&B keeps them, so they are not sent
        # again (a step logged twice is dropped by W&B online and doubled by `wandb sync`).
        self.wandb_step_file = Path(run_dir) / "wandb_step"
        if start_step == 0:  # a fresh start (or checkpoint.resume=false) is a new W&B run
            for stale in (self.wandb_step_file, Path(run_dir) / "wandb_id"):
                stale.unlink(missing_ok=True)
        self.wandb_logged = _last_step(self.wandb_step_file)
        if config["logger"]["backend"] == "wandb":
            self.wandb_run = _start_wandb(Path(run_dir), config)
            if self.world:
                self.wandb_run.config.update(self.world, allow_val_change=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **metrics, **self.world}
        self.world = {}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb_run is None or step <= self.wandb_logged:
            return
        for key in metrics.keys() - self.defined:
            rule = summary_rule(key)
            if rule is not None:
                self.wandb_run.define_metric(key, summary=rule)
            self.defined.add(key)
        self.wandb_run.log(metrics, step=step)
        self.wandb_logged = step
        self.wandb_step_file.write_text(str(step))

    def close(self, summary: dict[str, Any] | None = None) -> None:
        self.file.close()
        if self.wandb_run is not None:
            if summary:
                self.wandb_run.summary.update(
                    {f"final/{k}": v for k, v in summary.items() if isinstance(v, int | float)}
                )
            self.wandb_run.finish()


def wandb_settings(logger: dict[str, Any]):
    """W&B settings for `logger.*`: system metrics and the git commit unless switched off."""
    import wandb

    system, git = bool(logger.get("system_metrics", True)), bool(logger.get("git", True))
    return wandb.Settings(
        silent=True,
        console="off",
        x_disable_stats=not system,
        x_disable_machine_info=not system,
        x_disable_meta=not (system or git),  # the metadata record carries the commit
        disable_git=not git,
        git_root=str(REPO_ROOT) if git else None,  # the code's checkout, not the launch cwd
        save_code=False,
        disable_job_creation=True,
    )


def _start_wandb(run_dir: Path, config: dict[str, Any]):
    lc = config["logger"]
    # Offline must never reach for the network; silence the banner and console capture.
    os.environ["WANDB_MODE"] = lc["mode"]
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_CONSOLE", "off")
    import wandb

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    return wandb.init(
        project=lc["project"],
        entity=lc["entity"],
        group=lc["group"] or config["run"]["name"],
        job_type=lc["job_type"],
        tags=list(lc["tags"]),
        name=f"{config['run']['name']}/{run_dir.name}",
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=lc["mode"],
        config=config,
        settings=wandb_settings(lc),
    )


def memory_extremes(per_rank: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    """`memory/<key>/max` and `/min` over ranks for each key."""
    out = {}
    for key in keys:
        values = [r[key] for r in per_rank if key in r]
        if values:
            out[f"memory/{key}/max"] = max(values)
            out[f"memory/{key}/min"] = min(values)
    return out


def _figure(v: float) -> str:
    """A loss term for the summary line: 4 decimals, or 4 significant digits below 0.01 (the
    DSA indexer's KL is ~3e-5 on mla_tiny, which 4 decimals print as 0.0000)."""
    return f"{v:.4f}" if v == 0 or abs(v) >= 0.01 or not math.isfinite(v) else f"{v:.3e}"


class Summary:
    """What the end-of-run summary reports, accumulated by rank 0 from the logged steps."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []
        self.val: list[tuple[int, float, float | None]] = []  # step, val/loss, val/bpb
        self.aux: dict[str, list[float]] = {}  # mtp_loss, indexer_kl: first and last logged
        self.step_s: list[float] = []
        self.optim_s: list[float] = []
        self.tokens_per_s: list[float] = []
        self.measured: list[tuple[float, float, float]] = []
        self.peak_mib: dict[int, float] = {}
        self.skipped = 0

    def add(self, step: int, m: dict[str, float], measured: bool) -> None:
        self.losses.append((step, m["loss"]))
        if "val/loss" in m:
            self.val.append((step, m["val/loss"], m.get("val/bpb")))
        for key in AUX_LOSSES:
            if key in m:
                self.aux.setdefault(key, []).append(m[key])
        self.skipped = int(m["skipped_steps"])
        timing = (m["step_s"], m["optim_s"], m["tokens_per_s"])
        if measured:  # profiled steps are slower: used only when no other step was logged
            self.measured.append(timing)
        else:
            self.step_s.append(timing[0])
            self.optim_s.append(timing[1])
            self.tokens_per_s.append(timing[2])
        for key, value in m.items():
            if key.startswith("memory/rank_") and key.endswith("/step_peak_mib"):
                rank = int(key.split("/")[1][len("rank_") :])
                self.peak_mib[rank] = max(self.peak_mib.get(rank, 0.0), value)

    def as_dict(self) -> dict[str, Any]:
        step_s, optim_s, tokens_per_s = self.step_s, self.optim_s, self.tokens_per_s
        if not step_s and self.measured:
            step_s, optim_s, tokens_per_s = (list(t) for t in zip(*self.measured, strict=True))
        speed = tokens_per_s[1:] or tokens_per_s  # step 1 builds optimizer state
        out: dict[str, Any] = {
            "steps_logged": len(self.losses),
            "skipped_steps": self.skipped,
            "tokens_per_s": statistics.median(speed) if speed else None,
            "optim_share": sum(optim_s) / sum(step_s) if step_s else None,
            "peak_mib_per_rank": [self.peak_mib[r] for r in sorted(self.peak_mib)],
        }
        if self.losses:
            out.update(
                first_step=self.losses[0][0],
                loss_first=self.losses[0][1],
                last_step=self.losses[-1][0],
                loss_last=self.losses[-1][1],
            )
        if self.val:
            out.update(val_step=self.val[-1][0], val_loss=self.val[-1][1])
            out["val_loss_min"] = min(v[1] for v in self.val)
            if self.val[-1][2] is not None:
                out["val_bpb"] = self.val[-1][2]
        for key, values in self.aux.items():
            out[f"{key}_first"], out[f"{key}_last"] = values[0], values[-1]
        return out

    def text(self) -> str:
        s = self.as_dict()
        if not self.losses:
            return "nothing trained (the run was already complete)"
        share = f"{100 * s['optim_share']:.0f}%" if s["optim_share"] is not None else "n/a"
        speed = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] is not None else "n/a"
        peaks = ", ".join(f"r{r}={v:.1f}" for r, v in enumerate(s["peak_mib_per_rank"]))
        aux = "".join(
            f"; {k} {_figure(s[k + '_first'])} -> {_figure(s[k + '_last'])}" for k in self.aux
        )
        val = ""
        if self.val:
            bpb = f", {s['val_bpb']:.4f} bits/byte" if "val_bpb" in s else ""
            val = f"; val/loss {s['val_loss']:.4f}{bpb} (step {s['val_step']})"
        return (
            f"loss {s['loss_first']:.4f} (step {s['first_step']}) -> {s['loss_last']:.4f} "
            f"(step {s['last_step']}){aux}{val}; {speed} tokens/s; optimizer {share} of step time; "
            f"skipped steps {s['skipped_steps']}; peak MiB per rank: {peaks or 'not sampled'}"
        )
