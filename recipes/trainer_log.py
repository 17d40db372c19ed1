"""What a training run reports while it runs: rank 0's metrics.jsonl and summary from every
rank's figures (gathered each logged step), its start line, and its progress (a tqdm bar when
attached to a terminal, a line every tenth of the run). Kept apart from the loop
(`recipes.trainer`)."""

import logging
import socket
from pathlib import Path
from typing import Any

import torch.distributed as dist
from omegaconf import DictConfig

from recipes.config import to_plain
from recipes.metrics import AUX_LOSSES, RANK_EXTREMES, MetricsLog, Summary, memory_extremes
from recipes.ranks import gather_peaks, rank_metrics

log = logging.getLogger("recipes")

MEMORY_KEYS = ("step_peak_mib", "step_peak_delta_mib", "optim_peak_mib", "optim_peak_delta_mib")


class TrainLog:
    """Collective to build (every rank's host joins the record): rank 0's sink, summary and
    progress bar from `step` on (a resumed run appends); other ranks gather and write nothing."""

    def __init__(
        self,
        cfg: DictConfig,
        run_dir: Path,
        step: int,
        *,
        rank: int,
        world: int,
        model: str,
        device_type: str,
    ) -> None:
        """`model`: `recipes.build.describe_model` of the run's model, for the start line."""
        self.cfg, self.rank, self.steps = cfg, rank, cfg.train.steps
        # Which host each rank runs on (collective): multi-node runs show their layout.
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname())
        self.sink, self.bar, self.val_loss = None, None, None
        self.summary = Summary()
        self.report_every = max(1, self.steps // 10)
        if rank != 0:
            return
        self.sink = MetricsLog(
            run_dir, to_plain(cfg), step, world={"world_size": world, "hosts": hosts}
        )
        log.info(
            "model %s (%s); %d ranks, ep=%d, cp=%d, %s; optim=%s remainder=%s",
            cfg.model.preset,
            model,
            world,
            cfg.mesh.ep,
            cfg.mesh.cp,
            device_type,
            cfg.optim.name,
            cfg.optim.get("remainder_strategy", "-"),
        )
        if cfg.metrics.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, initial=step, desc="train", disable=None)

    def log(self, step: int, metrics: dict, measure: bool) -> None:
        """Collective: gather per-rank figures; rank 0 writes one line."""
        mine = {k: metrics[k] for k in MEMORY_KEYS if k in metrics}
        mine["step_s"], mine["optim_s"] = metrics["step_s"], metrics["optim_s"]
        mine.update({k: v for k, v in metrics.items() if k.startswith("muon/")})
        per_rank = gather_peaks(mine)
        if self.rank != 0:
            return
        out = {k: v for k, v in metrics.items() if k not in MEMORY_KEYS}
        out["step_s/max"] = max(r["step_s"] for r in per_rank)
        out["optim_s/max"] = max(r["optim_s"] for r in per_rank)
        for key in RANK_EXTREMES:
            values = [r[key] for r in per_rank if key in r]
            if values:
                out[f"{key}/max"], out[f"{key}/min"] = max(values), min(values)
        if measure:
            mem = [{k: r[k] for k in MEMORY_KEYS if k in r} for r in per_rank]
            out.update(rank_metrics(mem))
            out.update(memory_extremes(mem, MEMORY_KEYS))
        self.sink.log(step, out)
        self.summary.add(step, out, measure)

    def progress(self, step: int, metrics: dict, reported: bool, evaluated: bool) -> None:
        """Rank 0: the bar moves one step (its postfix the loss when read); a reported step
        (every tenth of the run, and evaluations) writes its line above the bar or to the log."""
        if "val/loss" in metrics:
            self.val_loss = metrics["val/loss"]
        if self.bar is not None:
            self.bar.update(1)
            if "loss" in metrics:  # a step whose figures were read
                postfix = {"loss": f"{metrics['loss']:.3f}"}
                if self.val_loss is not None:
                    postfix["val"] = f"{self.val_loss:.3f}"
                self.bar.set_postfix(postfix)
        if self.rank != 0 or not reported:
            return
        extra = "".join(f" {k} {metrics[k]:.4g}" for k in AUX_LOSSES if k in metrics)
        line = (
            f"step {step}/{self.steps} loss {metrics['loss']:.4f}{extra} "
            f"lr {metrics['lr']:.2e} {metrics['tokens_per_s']:.0f} tokens/s"
        )
        if evaluated:
            line += f" val/loss {self.val_loss:.4f}"
        if self.bar is not None and not self.bar.disable:
            self.bar.write(f"[rank0] {line}")  # above the bar, not through it
        else:
            log.info(line)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def finish(self) -> dict[str, Any] | None:
        """Rank 0: the summary, written to the sink as it closes; None elsewhere."""
        if self.rank != 0:
            return None
        result = self.summary.as_dict()
        self.sink.close(result)
        return result
