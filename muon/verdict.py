"""The host's side of skipped steps and refused updates (`muon.guard` defines both): what a
`Muon` knows of them across steps, the device verdicts of the update under way, the process
groups whose ranks agree on each parameter's verdict, and the warning naming refused ones.

A step's verdict stays on the device (`muon.guard.SkipFlag`) until someone asks: the first
`last_step_skipped` after the step reads it, `skipped_steps` reads the flags of the steps
since it was last asked once (earlier steps' flags are summed on the device), `step_skipped`
hands it over unread. Refusals are learnt from the next census's flags (`learn`) or, asked
first, read by `refused_updates`."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from muon.blowups import param_name
from muon.guard import SkipFlag
from muon.wire import collectives_move_data


class StepVerdict:
    """Skipped steps and refused updates so far, and the update under way's verdicts.

    `learn(refusals, written, ranks)` names and counts the refused updates of an update's
    (batch, chunk, verdicts) `refusals` from `written`, one count per parameter position of
    how many of `ranks` wrote it (`refusals_learnt`, bound to the optimizer)."""

    def __init__(self, learn: Callable[[list, list[int], int], int]) -> None:
        self._learn = learn
        self._skipped = 0  # steps the census skipped, and update skips already read
        self._refused = 0  # parameter updates refused, learnt so far
        self._census_skipped = False
        self._flag: SkipFlag | None = None  # the last step's update verdict, on the device
        self._earlier: torch.Tensor | None = None  # earlier steps' verdicts, summed
        self._written: list[torch.Tensor] = []  # the update's verdicts, one per batch chunk
        #: the last update's (batch, chunk, written verdicts), read by the next census
        self._refusals: list[tuple] = []
        self._unfit_on_host = False  # an AdamW update refused by the hyperparameters

    # --------------------------------------------------------------------------- the update
    def start_update(self) -> None:
        """Forget the previous update's verdicts: a new update collects its own."""
        self._written = []
        self._refusals = []
        self._unfit_on_host = False

    def record(self, b, chunk, ok: torch.Tensor) -> None:
        """A batch chunk's agreed verdicts `ok` (bool, one per parameter), on the device."""
        self._written.append(ok)
        self._refusals.append((b, chunk, ok))

    def refuse_on_host(self, count: int) -> None:
        """`count` updates refused on the host (AdamW's scale past the dtype): counted now."""
        self._unfit_on_host = True  # the same on every rank: hyperparameters and dtypes
        self._refused += count

    def finish_update(self) -> None:
        """The update's verdicts into one flag, all-reduced asynchronously, left on the device."""
        self._flag = SkipFlag(self._written, self._unfit_on_host)

    # ------------------------------------------------------------------------- the census
    def settle(self) -> None:
        """Before a step: the last step's flag joins the count (read already) or the device sum
        of the flags not read (no read)."""
        if self._flag is None:
            return
        if self._flag.value is not None:
            self._skipped += self._flag.value
        else:
            flag = self._flag.wait()[0]
            self._earlier = flag if self._earlier is None else self._earlier + flag
        self._flag = None

    def take_refusals(self) -> list[tuple]:
        """The last update's (batch, chunk, verdicts), handed over once (the census carries
        them)."""
        refusals, self._refusals = self._refusals, []
        return refusals

    def learn(self, refusals: list, written: list[int], ranks: int) -> None:
        """Count (and warn of) the refusals the census's sums `written` show."""
        self._refused += self._learn(refusals, written, ranks)

    def census(self, finite: bool) -> None:
        """The census's verdict: a non-finite gradient skips the step."""
        self._census_skipped = not finite
        if not finite:
            self._skipped += 1

    # ---------------------------------------------------------------------------- asked
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped: a non-finite gradient (decided by the census) or
        an update that did not fit (read from the device the first time this is asked after
        the step, so a step nobody asks about waits for nothing)."""
        return self._census_skipped or (self._flag is not None and self._flag.read())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reads the update verdicts not read yet, at most one read)."""
        if self._earlier is not None:
            self._skipped += int(self._earlier.item())
            self._earlier = None
        return self._skipped + int(self._flag is not None and self._flag.read())

    @property
    def step_skipped(self) -> bool | torch.Tensor:
        """`last_step_skipped` without a host read: True (the census skipped the step), or a
        0-d bool tensor on the device (whether an update did not fit, on any rank)."""
        if self._census_skipped:
            return True
        if self._flag is None:
            return False
        return self._flag.wait()[0].bool()

    @property
    def refused_updates(self) -> int:
        """Parameter updates refused so far; the last update's not learnt yet are read here
        (one read: the verdicts were agreed on every rank holding each parameter, so this
        rank's are the parameters')."""
        if self._refusals:
            refusals = self.take_refusals()
            written = torch.cat([ok for _, _, ok in refusals]).tolist()
            self.learn(refusals, written, 1)
        return self._refused


def warn_refused(names: list[str], why: str) -> None:
    """One warning for one step's refused updates (`muon.guard`: what a refusal leaves)."""
    warnings.warn(
        f"Muon: the update of {', '.join(names)} {why} and was refused on every rank: the "
        "parameter kept its value, its optimizer state moved; the step is marked skipped",
        RuntimeWarning,
        stacklevel=2,
    )


def verdict_groups(plan) -> dict:
    """Per sharded mesh plan, the process group whose ranks hold every shard of its parameters
    and agree on their verdicts (`muon.phases.check`): the FSDP group, or with an EP dim the
    whole mesh, which is the default group (every rank is in every parameter's mesh,
    `muon.planner`). None (no agreement needed: every rank holds the whole parameter) for
    unsharded meshes and a single process."""
    if not collectives_move_data():
        return {}
    return {
        mp: dist.group.WORLD if mp.ep_mesh_dim is not None else plan.groups[(mp, 0)]
        for mp, _ in plan.plans
        if mp.sharded
    }


def refusals_learnt(opt, refusals: list, written: list[int], ranks: int) -> int:
    """How many parameter updates `opt`'s previous update refused, named in one warning:
    `refusals` its (batch, chunk, verdicts) in step order, `written` one count per position of
    each chunk, how many of `ranks` wrote it (the census's sum of the agreed verdicts: all of
    them, or none)."""
    names, flat = [], iter(written)
    for b, chunk, _ in refusals:
        for j in chunk.positions:
            if next(flat) < ranks:
                p, gi = opt.plan.params[b.param_indices[j]]
                names.append(param_name(p, gi, opt.param_groups))
    if names:
        why = "could not be written in its dtype, or a Gram Newton-Schulz block left its band"
        warn_refused(names, why)
    return len(names)
