"""The training loop of one rank: resume, train, measure, log, checkpoint, summarize.

One optimizer step:
  1. `grad_accum_steps` micro-steps of forward + backward (FSDP gradient sync on the last one)
     of the objective loss + train.mtp_loss_weight * mtp_loss + indexer_kl; `loss` (logged) is
     the next-token loss alone, `mtp_loss` and `indexer_kl` are logged under their own keys.
  2. The global gradient norm per algorithm (AdamW groups, Muon groups), one all-reduce.
  3. Clipping of the AdamW groups (and the Muon groups with `train.clip_muon`) when finite,
     decided on the device: the clip factor is a tensor (exactly 1 when nothing is clipped).
  4. The optimizer step. Non-finite gradients skip it on every rank, whichever the optimizer:
     Muon checks and skips by itself (`step_skipped`: its update guard's verdict stays on the
     device, the router-bias rate is scaled by it there and it is read with the logged
     figures); for AdamW the loop does, from the same all-reduced norm. A skipped step (one
     definition, `muon.guard`) leaves the router bias alone; one skipped for a non-finite
     gradient changes no parameter or optimizer state, one with a refused Muon update keeps
     that parameter's value and updates the others. The schedule and the data stream move on,
     and `skipped_steps` counts it.
  5. The router-bias update (`models.glm.infra.statistics`: loads summed over the ranks),
     then the LambdaLR step.
The step's losses, gradient norms and attention logits stay on the device; on a step that is
logged (`metrics.log_every`, memory, evaluation, rank 0's progress line) they are read once,
stacked into one tensor (`recipes.metrics.DeviceValues`), and only then is the step
synchronized for its timer. The batch reaches the device in one copy per micro-step.
Every `metrics.memory_every` steps (and on step 1) the step runs inside the MemoryMeter, with
an "optim" region around the optimizer; rank 0 gathers all ranks' peaks and its log line holds
`memory/rank_<k>/...` for every rank. Every `eval.every` steps and at the last step the ranks
evaluate the held-out split (`recipes.evaluate`), logged with that step's row.

This file is the loop and the step; resuming, saving and the final export are
`recipes.trainer_state`, the metrics file, summary and progress `recipes.trainer_log`.
"""

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from models.glm.infra import qk_clip, statistics
from models.glm.model.loss_head import check_labels
from recipes import checkpoint, grads, trainer_state
from recipes.build import (
    build_model,
    build_optimizer,
    describe_model,
    lr_lambda,
    model_config,
    records_max_logits,
)
from recipes.context import DataShare
from recipes.data import TokenStream, packing_kwargs, token_files
from recipes.evaluate import Evaluator
from recipes.guards import RunGuard
from recipes.memory import MemoryMeter
from recipes.metrics import DeviceValues, remainder_metrics
from recipes.stop_signal import StopSignal
from recipes.trainer_log import TrainLog

log = logging.getLogger("recipes")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _groups_by_algorithm(opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {"adamw": [], "muon": []}
    for g in opt.param_groups:
        out[g.get("algorithm", "adamw")] += list(g["params"])
    return out


class Trainer:
    """Builds everything of one rank from the config and runs the loop."""

    def __init__(self, cfg: DictConfig, run_dir: Path, device: torch.device) -> None:
        self.cfg, self.run_dir, self.device = cfg, Path(run_dir), device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.share = DataShare.of(self.rank, self.world, cfg.mesh.cp, cfg.data.seq_len)
        torch.manual_seed(cfg.train.seed)
        # Before the model: absolute memory figures then include weights and optimizer state.
        self.meter = MemoryMeter(device)
        config = model_config(cfg)  # the one GLMConfig of this rank: self.model.config
        self.model = build_model(cfg, config, device)
        self.opt = build_optimizer(cfg.optim, self.model)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.params = _groups_by_algorithm(self.opt)
        self.clipped = self.params["adamw"] + (self.params["muon"] if cfg.train.clip_muon else [])
        self.qk_clip_tau = cfg.optim.qk_clip_tau
        self.max_logits = records_max_logits(cfg)
        self.model.record_max_logits(self.max_logits)
        if self.rank == 0:
            files = token_files(cfg.data)  # builds the stdlib corpus once per machine
        dist.barrier()
        files = token_files(cfg.data)
        d = cfg.data
        stream = (str(d.dtype), d.seq_len, cfg.train.seed, d.vocab_size, d.pack)
        self.data = TokenStream(files.train, *stream)
        self.evaluator = None
        if cfg.eval.every:
            if files.val is None:
                raise ValueError(
                    f"eval.every={cfg.eval.every}: the data has no validation split "
                    f"({files.train} only); pass eval.every=0"
                )
            val = TokenStream(files.val, *stream)
            self.evaluator = Evaluator(
                val, cfg.eval.batches, d.batch_size, files.bytes_per_token, self.share
            )
        self.samples_per_step = self.share.dp_size * cfg.train.grad_accum_steps * d.batch_size
        self.step, self.samples, self.skipped = 0, 0, 0
        #: skipped steps not read yet: Muon's update-guard verdicts, summed on the device
        self.skipped_unread: torch.Tensor | None = None
        self.ckpt_root = self.run_dir / "checkpoints"
        c = cfg.checkpoint
        self.checkpointer = checkpoint.Checkpointer(
            self.ckpt_root, keep=c.keep, async_mode=c.async_mode
        )
        self.guard = RunGuard.from_config(cfg.train, config.vocab_size, self.rank)

    # ------------------------------------------- resume and save (recipes.trainer_state)
    def resume(self) -> None:
        """Load the newest committed checkpoint of the run dir, if any (`trainer_state.resume`)."""
        trainer_state.resume(self)

    def save(self) -> Path:
        """Collective: checkpoint the current step (`trainer_state.save`)."""
        return trainer_state.save(self)

    # -------------------------------------------------------------------------------- step
    def forward_backward(self) -> dict[str, torch.Tensor]:
        """The micro-steps' forward + backward; the step's mean of each loss term."""
        cfg = self.cfg
        accum = cfg.train.grad_accum_steps
        weight = float(cfg.train.mtp_loss_weight)
        sums: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            share = self.share
            x, y, *packed = self.data.micro_batch(
                self.samples, micro, share.dp_rank, share.dp_size, cfg.data.batch_size
            )
            if hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(micro == accum - 1)
            check_labels(y, self.model.config.vocab_size)  # on the host: no device read
            x, y, *packed = self._to_device(x, y, *packed)
            packing = packing_kwargs(packed)
            terms = self.model(
                x, y, with_mtp=weight > 0, labels_checked=True, **packing, **share.model_kwargs()
            )
            terms = share.scaled(terms)
            objective = terms["loss"]
            if "mtp_loss" in terms:
                objective = objective + weight * terms["mtp_loss"]
            if "indexer_kl" in terms:  # its gradient reaches the indexer only
                objective = objective + terms["indexer_kl"]
            (objective / accum).backward()
            for key, value in terms.items():
                sums[key] = sums.get(key, 0.0) + value.detach() / accum
        return sums

    def _to_device(self, *fields: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A micro-batch's input ids and labels (and packed positions and document ids) on the
        device in one copy (from pinned memory and asynchronous on CUDA)."""
        both = torch.stack(fields)
        cuda = self.device.type == "cuda"
        if cuda:
            both = both.pin_memory()
        both = both.to(self.device, non_blocking=cuda)
        return tuple(both.unbind(0))

    def read_skipped(self, unread: float | None = None) -> None:
        """Fold the skipped steps still on the device into `skipped` (`unread`: their count,
        read with the step's figures; None reads it here, one host read)."""
        if self.skipped_unread is not None:
            self.skipped += int(self.skipped_unread.item() if unread is None else unread)
            self.skipped_unread = None

    def optimizer_step(self, values: DeviceValues | None = None) -> bool | torch.Tensor:
        """Clip and step; returns whether the step was skipped (Muon: True, or its update
        guard's verdict, a 0-d bool tensor on the device: `Muon.step_skipped`). The squared
        gradient norms (and the attention logits) go into `values`, still on the device:
        clipping decides on the device (the clip factor is a tensor, exactly 1 when the norm is
        within the limit or not finite), so nothing here reads the device, except AdamW's skip
        decision."""
        cfg = self.cfg
        if cfg.train.inject_nan_at_step == self.step + 1 and self.rank == 0:
            grads.poison_grad(self.params["muon"] + self.params["adamw"])
        sq = grads.squared_norm_tensors(self.params)
        finite = torch.isfinite(torch.stack(list(sq.values()))).all()
        if cfg.train.grad_clip > 0:
            clip_sq = sq["adamw"] + sq["muon"] if cfg.train.clip_muon else sq["adamw"]
            factor = grads.clip_factor(clip_sq, finite, float(cfg.train.grad_clip))
            grads.scale_grads(self.clipped, factor)
        if cfg.optim.name == "muon":
            self.opt.step()  # checks finiteness itself, on every rank
            # True, or the update guard's verdict still on the device (read after the step)
            skipped = self.opt.step_skipped
        else:
            # torch's AdamW cannot skip a step on the device: the one read of an AdamW step
            skipped = not bool(finite)
            if not skipped:
                self.opt.step()
        if values is not None:
            for key, value in sq.items():
                values.add(f"grad_sq/{key}", value)
        if self.max_logits:
            self._qk_clip(values)
        return skipped

    def _qk_clip(self, values: DeviceValues | None) -> None:
        """Collective (one MAX all-reduce): the step's max attention logits into `values`, then
        QK-clip of the updated weights when `optim.qk_clip_tau` is set."""
        logits_LN = statistics.take_max_logits(self.model)
        if values is not None:
            values.add("attn/max_logit", logits_LN.max())
            values.add("attn/max_logit/layer", logits_LN.amax(dim=1))
        if self.qk_clip_tau is not None:
            alpha = self.cfg.optim.qk_clip_alpha
            clipped = qk_clip.qk_clip_(self.model, logits_LN, self.qk_clip_tau, alpha)
            if values is not None:
                values.add("attn/qk_clipped", clipped)

    def _read(self, loss: dict[str, torch.Tensor], values: DeviceValues) -> dict[str, float]:
        """Collective (one all-reduce of the loss terms): the step's losses, gradient norms
        and attention figures, read from the device together (`DeviceValues.read`)."""
        keys = sorted(loss)  # the same terms on every rank: one all-reduce of all of them
        summed = torch.stack([loss[k] for k in keys])
        dist.all_reduce(summed)
        values.add("loss", summed)
        raw = values.read()
        out = {k: v / self.world for k, v in zip(keys, raw["loss"], strict=True)}
        sq = {k.removeprefix("grad_sq/"): v[0] for k, v in raw.items() if k.startswith("grad_sq/")}
        out.update({f"grad_norm/{k}": v**0.5 for k, v in sq.items()})
        out["grad_norm"] = sum(sq.values()) ** 0.5
        if "attn/max_logit" in raw:
            out["attn/max_logit"] = raw["attn/max_logit"][0]
            for i, value in enumerate(raw["attn/max_logit/layer"]):
                out[f"attn/max_logit/layer_{i:02d}"] = value
        if "attn/qk_clipped" in raw:
            out["attn/qk_clipped"] = raw["attn/qk_clipped"][0]
        for key in ("skipped", "skipped_unread", "skipped_in_row"):  # Muon's verdicts (train_step)
            if key in raw:
                out[key] = raw[key][0]
        return out

    def train_step(self, measure: bool, read: bool = True) -> dict[str, float]:
        """One optimizer step; returns this rank's metrics (memory figures when measured).

        With `read=False` (a step that is not logged) the figures that live on the device -
        losses, gradient norms, attention logits - are left unread and the step is not
        synchronized for its timer: no host read beyond the model's and the optimizer's own;
        the metrics then hold the host figures only (lr, skipped, counters)."""
        cfg = self.cfg
        timed = read or measure
        if timed:
            _sync(self.device)
        t0 = time.perf_counter()
        memory: dict[str, float] = {}
        values = DeviceValues()
        if measure:
            with self.meter.measure("step") as m:
                loss = self.forward_backward()
                _sync(self.device)
                t_opt = time.perf_counter()
                with m.region("optim"):
                    skipped = self.optimizer_step(values)
                    _sync(self.device)
            memory = m.summary()
        else:
            loss = self.forward_backward()
            if timed:
                _sync(self.device)
            t_opt = time.perf_counter()
            skipped = self.optimizer_step(values)
            if timed:
                _sync(self.device)
        optim_s = time.perf_counter() - t_opt
        lr = self.sched.get_last_lr()
        # A skipped step leaves the bias alone but still consumes the step's expert counts.
        if isinstance(skipped, torch.Tensor):  # decided on the device, counted when read
            rate = cfg.train.router_bias_rate * (~skipped).to(torch.float32)
            prior = self.skipped_unread
            self.skipped_unread = skipped.to(torch.int64) + (0 if prior is None else prior)
            values.add("skipped", skipped)
        else:
            rate = 0.0 if skipped else cfg.train.router_bias_rate
        if self.skipped_unread is not None:
            values.add("skipped_unread", self.skipped_unread)
        self.guard.count(skipped, values)
        if cfg.train.router_bias_rate > 0:
            statistics.update_router_bias(self.model, rate)
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step += 1
        self.samples += self.samples_per_step
        host = {}
        if not isinstance(skipped, torch.Tensor):
            self.skipped += int(skipped)
            host["skipped"] = float(skipped)
        figures = self._read(loss, values) if read else {}
        if "skipped" in figures:  # the device verdict, read with the figures
            host["skipped"] = figures.pop("skipped")
        if "skipped_unread" in figures:
            self.read_skipped(figures.pop("skipped_unread"))
        self.guard.take(figures)
        if "skipped" in host and self.skipped_unread is None:
            host["skipped_steps"] = float(self.skipped)
        step_s = time.perf_counter() - t0
        tokens = self.samples_per_step * cfg.data.seq_len
        stats = getattr(self.opt, "step_stats", {})
        terms = {k: v for k, v in figures.items() if not k.startswith(("grad_norm", "attn/"))}
        norms = {k: v for k, v in figures.items() if k.startswith(("grad_norm", "attn/"))}
        return {
            **terms,
            "lr": lr[0],
            "lr_adamw": lr[-1],
            **norms,
            **host,  # absent on a step not read whose verdict is still on the device
            "step_s": step_s,
            "optim_s": optim_s,
            "tokens_per_s": tokens / step_s,
            **stats,
            **remainder_metrics(stats),
            **memory,
        }

    # -------------------------------------------------------------------------------- loop
    def train(self) -> dict[str, Any] | None:
        """Resume, then run the steps to `train.steps` (or a halt, or a stop signal), logging,
        evaluating and checkpointing on schedule; export at the end. Rank 0: the summary."""
        cfg = self.cfg
        self.resume()
        record = TrainLog(
            cfg,
            self.run_dir,
            self.step,
            rank=self.rank,
            world=self.world,
            model=describe_model(self.model.config),
            device_type=self.device.type,
        )
        every = cfg.checkpoint.every
        stop = StopSignal(self.device)
        while self.step < cfg.train.steps:
            measure = self.step % cfg.metrics.memory_every == 0
            done = self.step + 1  # the step this iteration completes
            evaluated = self.evaluator is not None and (
                done % cfg.eval.every == 0 or done == cfg.train.steps
            )
            logged = done % cfg.metrics.log_every == 0 or measure or evaluated
            reported = done % record.report_every == 0 or evaluated  # rank 0's progress line
            # The same decision on every rank: reading all-reduces the loss terms.
            metrics = self.train_step(measure, read=logged or reported)
            if evaluated:
                metrics.update(self.evaluator.run(self.model, self.device))
            if logged:
                record.log(self.step, metrics, measure)
            record.progress(self.step, metrics, reported, evaluated)
            due = (every and self.step % every == 0) or self.step == cfg.train.steps
            stopping = self.step < cfg.train.steps and stop.requested()
            if self.guard.halts(self.step, metrics, saving=due or stopping):
                break
            if due or stopping:
                path = self.save()
            if stopping:
                self.checkpointer.wait()  # committed before the process goes away
                if self.rank == 0:
                    by = stop.name or "a peer rank's signal"
                    log.info("%s: stopped at step %d, checkpoint %s", by, self.step, path)
                break
        record.close_bar()
        return self._finish(record)

    def _finish(self, record: TrainLog) -> dict[str, Any] | None:
        """After the loop: the last asynchronous save committed, the transformers export of a
        run that reached `train.steps` unhalted; rank 0's summary (and why it stopped)."""
        self.checkpointer.wait()
        halted = self.guard.stop_reason is not None
        if self.cfg.checkpoint.export_hf and self.step == self.cfg.train.steps and not halted:
            trainer_state.export_hf(self)
        result = record.finish()
        if result is None:
            return None
        if halted:
            result["stopped"] = self.guard.stopped(self.step, self.ckpt_root)
        return result | {"text": record.summary.text()}
