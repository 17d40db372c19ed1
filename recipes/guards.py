"""Run-level guards of one rank's loop: a run that stopped training ends, a diverging one warns.

- Skipped steps in a row (`train.max_skipped_in_row`, N): a step is skipped when its gradients
  or its update are not finite (nothing changes). One is a bad batch; N in a row means the
  weights or the optimizer state are no longer finite (a NaN checkpoint, an lr that overflowed
  the weights), and every further step would skip too. The run then stops: no checkpoint is
  written after the N-th skip, no export, and train.py exits with status 1 naming the last
  checkpoint whose step trained. The count lives on the device with Muon (its update guard's
  verdict is not read every step: `(streak + 1) * skipped`, no host read), read with the step's
  figures and before each save, so with `metrics.log_every` > 1 the stop comes at the first
  logged step or save after the N-th skip. It is saved in trainer.json: a restart continues it.
- Divergence (`train.divergence_steps`, K): the loss has been, for K steps, either at a uniform
  guess's loss ln(vocab) (within 0.1% of it) after it had been away from it (the model learned
  to predict nothing: `optim.lr=1e6` gives exactly ln 256 = 5.5452 from step 2 on), or more
  than 5% above the higher of its first value and ln(vocab) (an exploding loss; a model at
  init sits within a few percent of ln(vocab)). Rank 0 warns once per episode;
  `train.on_divergence=stop` ends the run as the skip guard does. Read losses only (every
  logged step), all-reduced, so every rank decides the same.
- A checkpoint's `trained` flag (trainer.json): its step was not skipped, the last loss read
  was finite and the loss was not diverging. Rotation never deletes the newest checkpoint that
  trained (recipes.checkpoint.rotate), so a run that skips or diverges for longer than
  `checkpoint.keep` saves still has its last good state.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from recipes.metrics import DeviceValues

log = logging.getLogger("recipes")

#: the streak's name among a step's device values (Trainer._read passes it through)
STREAK_KEY = "skipped_in_row"

#: a loss within this fraction of ln(vocab) is a uniform guess's
UNIFORM_REL_TOL = 1e-3
#: a loss this fraction above max(first loss, ln(vocab)) is exploding
EXPLODED_REL = 0.05


class RunGuard:
    """The skip streak and the divergence check of one rank (the same decisions on every rank:
    the skip verdicts and the read losses are all-reduced)."""

    def __init__(
        self,
        *,
        max_skipped_in_row: int,
        divergence_steps: int,
        on_divergence: str,
        vocab_size: int,
        rank: int,
    ) -> None:
        self.max_skipped, self.k = max_skipped_in_row, divergence_steps
        self.stop_on_divergence = on_divergence == "stop"
        self.uniform = math.log(vocab_size)
        self.rank = rank
        #: skipped steps in a row: an int, or a device tensor (Muon's verdicts, not read yet)
        self.streak: int | torch.Tensor = 0
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.left_uniform = False
        self.diverged_since: int | None = None  # first step of the current divergence
        self.warned = False
        self.stop_reason: str | None = None
        self.last_step = 0

    @classmethod
    def from_config(cls, train: Any, vocab_size: int, rank: int) -> RunGuard:
        """The guard of `train.max_skipped_in_row`, `train.divergence_steps`,
        `train.on_divergence` for a model of `vocab_size` outputs."""
        return cls(
            max_skipped_in_row=int(train.max_skipped_in_row),
            divergence_steps=int(train.divergence_steps),
            on_divergence=str(train.on_divergence),
            vocab_size=vocab_size,
            rank=rank,
        )

    # ---------------------------------------------------------------------- skip streak
    def count(self, skipped: bool | torch.Tensor, values: DeviceValues) -> None:
        """Fold one step's verdict (a host bool, or Muon's 0-d device tensor) into the
        streak, without reading the device; a streak on the device goes into the step's
        `values`, read with its figures when they are read (`take`)."""
        if isinstance(skipped, torch.Tensor):
            self.streak = (self.streak + 1) * skipped.to(torch.int64)
        else:
            self.streak = self.streak + 1 if skipped else 0
        if isinstance(self.streak, torch.Tensor):
            values.add(STREAK_KEY, self.streak)

    def take(self, figures: dict[str, float]) -> None:
        """The streak's value out of a step's read figures (when it was among them)."""
        if STREAK_KEY in figures:
            self.streak_now(figures.pop(STREAK_KEY))

    def streak_now(self, read: float | None = None) -> int:
        """The streak as an int (`read`: its value read with the figures; else one host read)."""
        if isinstance(self.streak, torch.Tensor):
            self.streak = int(self.streak.item() if read is None else read)
        return self.streak

    def state(self) -> dict[str, Any]:
        """What trainer.json keeps: the streak, and whether this checkpoint's step trained."""
        streak = self.streak_now()
        finite = self.last_loss is None or math.isfinite(self.last_loss)
        trained = streak == 0 and finite and not self._diverged(self.last_step)
        return {"skipped_in_row": streak, "trained": trained}

    def resume(self, state: dict[str, Any]) -> None:
        """Continue the streak a checkpoint saved (absent in older checkpoints: 0)."""
        self.streak = int(state.get("skipped_in_row", 0))

    # ---------------------------------------------------------------------- decisions
    def check(self, step: int, metrics: dict[str, float]) -> bool:
        """After a step (and before its save): True when the run must stop (`stop_reason`
        says why). `metrics`: the step's figures (its `loss` when they were read)."""
        if self.stop_reason is not None:
            return True
        if "loss" in metrics:
            self._loss(step, float(metrics["loss"]))
        self.last_step = step
        streak = self.streak
        if self.max_skipped and isinstance(streak, int) and streak >= self.max_skipped:
            self.stop_reason = (
                f"{streak} steps in a row skipped (steps {step - streak + 1}-{step}: "
                f"non-finite gradients or updates; train.max_skipped_in_row={self.max_skipped})"
                ": the weights or the optimizer state are most likely not finite"
            )
        elif self.stop_on_divergence and self._diverged(step):
            self.stop_reason = (
                f"the loss diverged ({self._divergence(step)}; train.on_divergence=stop)"
            )
        return self.stop_reason is not None

    def halts(self, step: int, metrics: dict[str, float], *, saving: bool) -> bool:
        """After a step: whether the run stops here (`check`); before a save (`saving`) the
        streak is read now (one host read with Muon), so no checkpoint is written after the
        N-th skip even when that step was not logged. Rank 0 logs the reason as an error."""
        halted = self.check(step, metrics)
        if not halted and saving:
            self.streak_now()
            halted = self.check(step, {})
        if halted and self.rank == 0:
            log.error("stopping: %s", self.stop_reason)
        return halted

    def stopped(self, step: int, ckpt_root: Path) -> str:
        """Rank 0, after a stop: the message train.py exits with, naming the last checkpoint
        whose step trained."""
        from recipes.checkpoint import last_trained

        good = last_trained(ckpt_root)
        return (
            f"{self.stop_reason}; the run stopped at step {step} without a checkpoint of it "
            f"or an export; the last checkpoint whose step trained: {good or 'none of this run'}"
        )

    def _loss(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):  # a non-finite loss skips its step: the streak's case
            self.last_loss = loss
            return
        if self.first_loss is None:
            self.first_loss = loss
        self.last_loss = loss
        uniform = abs(loss - self.uniform) <= UNIFORM_REL_TOL * self.uniform
        exploded = loss > (1 + EXPLODED_REL) * max(self.first_loss, self.uniform)
        bad = exploded or (uniform and self.left_uniform)
        self.left_uniform = self.left_uniform or not uniform
        if not bad:
            self.diverged_since, self.warned = None, False
            return
        if self.diverged_since is None:
            self.diverged_since = step
        if self._diverged(step) and not self.warned and self.rank == 0:
            self.warned = True
            log.warning(
                "the loss diverged: %s; checkpoints written now are marked untrained "
                "(rotation keeps the last trained one); train.on_divergence=stop ends such a run",
                self._divergence(step),
            )

    def _diverged(self, step: int) -> bool:
        since = self.diverged_since
        return bool(self.k) and since is not None and step - since + 1 >= self.k

    def _divergence(self, step: int) -> str:
        last = self.last_loss if self.last_loss is not None else float("nan")
        kind = (
            f"at a uniform guess's ln(vocab) = {self.uniform:.4f}"
            if abs(last - self.uniform) <= UNIFORM_REL_TOL * self.uniform
            else f"above max(first loss {self.first_loss:.4f}, ln(vocab) {self.uniform:.4f}) "
            f"by more than {EXPLODED_REL:.0%}"
        )
        return (
            f"loss {last:.4f} at step {step}, {kind} since step {self.diverged_since} "
            f"(train.divergence_steps={self.k})"
        )
