"""Gram Newton-Schulz's blow-ups in a step, counted on the device and acted on without a read.

In bf16 the Gram iteration can lose a block whose singular values span a wide range; its
output check (`muon.newton_schulz`) flags such a block on the device. Reading the flags in the
step would cost a host sync per Gram call, so the optimizer does not: the blown-up block's
output becomes NaN (`muon.blocks.refuse_blown_up`), which the update check (`muon.guard`)
refuses for the whole parameter on every rank holding a shard of it (its value and weight
decay unchanged, the step marked skipped), and the count joins a per-batch counter on the
device. The next step's gradient census carries the counters in its one all-reduce and read
(`muon.census`); a batch whose Gram output blew up on any rank then runs the standard
iteration from that step on, on every rank, with one warning naming its parameters. The
demotion is each of those parameters' state (`gram_demoted`, a bool the same on every rank, so
a state dict keeps it and DCP reshards it with the rest): a new plan (`add_param_group`, a load
that changes planning keys) and a resumed run demote the batches holding such a parameter
again (`restore`, one read at planning or load). So a blow-up costs the parameter one step's
update, once, and never a read in the step. Every rank has the same counters (the plan,
`ns_algorithm` and `ns_steps` included, is fingerprinted across ranks at construction,
`muon.plan.fingerprint`), so the census's all-reduce has one length. A loop that runs
`Muon.update` alone (a captured CUDA graph) still refuses such updates; learning
from the counts, the demotion, is the census's, i.e. `Muon.step`'s.
"""

from __future__ import annotations

import warnings

import torch

from muon.cost import effective_algorithm
from muon.layout import local


def may_run_gram(b) -> bool:
    """Whether batch `b`'s plan runs Gram Newton-Schulz on some block (`effective_algorithm`
    on its block shapes: each height of blocks of unequal heights)."""
    rows, cols = b.block_shape
    heights = {rows} if len(b.global_shape) > 2 else set(b.block_heights)
    return any(effective_algorithm(h, cols, b.ns_steps, b.ns_algorithm) == "gram" for h in heights)


class GramBlowups:
    """Per-batch blow-up counters of a plan's batches that may run Gram Newton-Schulz, on the
    parameters' device, and the batches demoted to the standard iteration."""

    def __init__(self, plan) -> None:
        #: the batches that may run Gram, in step order; a batch's counter is its position
        self.batches = [b for _, batches in plan.plans for b in batches if may_run_gram(b)]
        self._slots = {b: k for k, b in enumerate(self.batches)}
        self.demoted: set = set()
        #: int32 `[len(batches)]`: blocks whose Gram output blew up in the last update, per batch
        self.counts: torch.Tensor | None = None
        if self.batches:
            device = local(plan.params[self.batches[0].param_indices[0]][0]).device
            self.counts = torch.zeros(len(self.batches), dtype=torch.int32, device=device)
        #: each batch's counter as a 0-d view, made once (a step dispatches no indexing op)
        self._views = [] if self.counts is None else list(self.counts.unbind())

    def reset(self) -> None:
        """Zero the counters before an update writes them (one fill, none without Gram)."""
        if self.counts is not None:
            self.counts.zero_()

    def restore(self, param_groups: list[dict], params: list, state) -> None:
        """Demote the batches holding a parameter whose state says `gram_demoted` (a loaded
        state dict's, or one learnt under an earlier plan): one read of the flags, at planning
        or load, never in a step. Silent: the warning was given when it was learnt."""
        if not self.batches:
            return
        flags = [
            state[params[i][0]].get("gram_demoted") for b in self.batches for i in b.param_indices
        ]
        # A meta-device state (the planner's fake world) holds no learnt demotion to read.
        flags = [None if f is None or f.is_meta else f for f in flags]
        known = [f for f in flags if f is not None]
        if not known:
            return
        values = iter(torch.stack([f.to(self.counts.device) for f in known]).tolist())
        marked = [f is not None and next(values) for f in flags]
        at = 0
        for b in self.batches:
            if any(marked[at : at + len(b.param_indices)]):
                self.demoted.add(b)
            at += len(b.param_indices)

    def algorithm(self, b, algorithm: str) -> str:
        """The iteration batch `b` asks Newton-Schulz for: "standard" once it was demoted."""
        return "standard" if b in self.demoted else algorithm

    def counter(self, b) -> torch.Tensor | None:
        """Batch `b`'s 0-d counter (a view), or None where the plan runs no Gram on it. None
        makes Newton-Schulz recompute a blown-up block itself (with a host read): only a
        batch whose group turned to Gram after planning takes that form."""
        k = self._slots.get(b)
        if k is None or b in self.demoted:
            return None
        return self._views[k]

    def demote(self, counts: list[int], param_groups: list[dict], params: list, state) -> None:
        """Demote the batches whose count (summed over ranks: `counts`, read by the census) is
        not 0, warning once for each, and mark their parameters' state `gram_demoted` (so a
        state dict keeps it); `params` is the plan's (parameter, group index) list."""
        for b, count in zip(self.batches, counts, strict=True):
            if not count or b in self.demoted:
                continue
            self.demoted.add(b)
            for i in b.param_indices:
                state[params[i][0]]["gram_demoted"].fill_(True)
            names = [param_name(*params[i], param_groups) for i in b.param_indices]
            warnings.warn(
                f"Muon: Gram Newton-Schulz left its band on {count} block(s) of shape "
                f"{b.block_shape} of the batch of {', '.join(names)}; the update of the "
                "parameter holding such a block was not applied in the previous step (the step "
                "is marked skipped), and this batch runs the standard iteration from now on",
                RuntimeWarning,
                stacklevel=3,
            )


def param_name(p: torch.Tensor, gi: int, param_groups: list[dict]) -> str:
    """A parameter's name when its group lists names, else its shape."""
    g = param_groups[gi]
    names = g.get("param_names")
    if names:
        for q, name in zip(g["params"], names, strict=True):
            if q is p:
                return repr(name)
    return f"a parameter of shape {tuple(p.shape)}"
