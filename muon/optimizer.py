"""Muon with AdamW groups in one optimizer, for plain tensors and FSDP2 / EP DTensors.

The path of one Muon batch through a step: at construction `planner.py` decided which
matrices travel together (`plan.py`) and who assembles them (`owners.py`), and `_prepare` made
once what the step needs on the device (row indices and lr factors of blocks of unequal
heights). A step is the gradient census (`census.py`, one host read), then
`update`: the AdamW groups, then each batch as a task (`task.py`, read top to bottom) that runs
the same phases for every path (`paths.py`): momentum -> launch -> wait -> orthogonalize ->
return -> wait -> check -> apply (the momentum and apply phases in `phases.py`), the math being
the foreach functions of `update.py`. `runtime.py` keeps a sliding window of batches in flight.

Update (per Muon parameter, on local shards; matches torch.optim.Muon):
    M <- lerp(M, G, 1 - momentum);  U = lerp(G, M, momentum) if nesterov else M
    O = NS(U) per block (NorMuon, `normuon=True`: O <- normalize(O, v), `muon.normuon`)
    p <- p * (1 - lr * wd) - adjusted_lr * O
with adjusted_lr from the per-block shape: "original" lr * sqrt(max(1, rows/cols)),
"match_rms_adamw" lr * 0.2 * sqrt(max(rows, cols)), "none" lr.

Skipped steps and refused updates (one definition, `muon.guard`): a non-finite gradient on
any rank skips the whole step on every rank (nothing moves); an update that cannot be written
in its parameter's dtype, or holds NaN (a Gram Newton-Schulz block that left its band, the
block reaching the check as NaN), is refused for the whole parameter on every rank holding a
shard of it (its value kept, its momentum and NorMuon moments moved), while the others are
updated. Both mark the step skipped (`last_step_skipped`, `skipped_steps`); refusals are
counted (`refused_updates`) and warned once, naming the parameters. A Gram blow-up is counted
on the device and learnt by the next census, which demotes its batch to the standard
iteration (`muon.blowups`); the demotion is the parameters' state (`gram_demoted`), kept by a
state dict.

Missing gradients: a parameter whose `.grad` is None on every rank is left untouched, state
included, as in torch.optim.Muon and torch.optim.AdamW (in an exchange its slot travels as
zeros and its result is dropped, so the batch keeps its plan). Ranks that disagree about a
parameter raise a RuntimeError naming it, on every rank, before anything is written. Both
checks share one all-reduce of P + 1 int32 flags per step (P parameters).

Parameter groups added after construction (`add_param_group`) are planned again, collectively:
call it on every rank in the same order, as the constructor is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch

from muon import normuon, update
from muon.blowups import GramBlowups
from muon.census import GradCensus
from muon.chunks import adjusted_lr, prepare_chunks
from muon.cost import LinkModel
from muon.layout import local
from muon.options import DEFAULTS as _D
from muon.plan import BatchPlan, MeshCommPlan
from muon.planner import build_step_plan, resolve_link
from muon.runtime import AsyncRuntime
from muon.state_dict import (
    OWN_DTYPE_STATE,
    check_loaded_groups,
    plan_keys,
    without_own_dtype_state,
)
from muon.stats import StepStats
from muon.task import StepContext, batch_tasks
from muon.validate import (
    ADJUST_LR,
    MUON_ONLY_KEYS,
    NS_DTYPES,
    check_group_keys,
    check_options,
    dtype_name,
    fold_adamw_momentum,
    group_algorithm,
    validate_group,
)
from muon.verdict import StepVerdict, refusals_learnt, verdict_groups, warn_refused
from muon.wire import world_size

__all__ = ["ADJUST_LR", "NS_DTYPES", "Muon", "adjusted_lr"]  # the choice lists recipes read


class Muon(torch.optim.Optimizer):
    """Muon for matrices (plain or DTensor, fused experts as blocks) plus AdamW groups.

    Args:
        params: parameters or group dicts, e.g. from `muon.param_groups(model)`. A group's
            `algorithm` is "muon" (the default) or "adamw"; a Muon group may set `num_blocks`,
            the number of independent blocks stacked along dim 0 of each of its matrices (fused
            experts), and `param_names` (used in error messages and the cross-rank check). Any
            keyword below except the optimizer-wide ones can be overridden per group.
        lr: learning rate before the per-block adjustment (`adjust_lr`).
        momentum: momentum coefficient mu, in [0, 1).
        nesterov: orthogonalize lerp(G, M, mu) instead of M.
        weight_decay: decoupled weight decay: p *= 1 - lr * weight_decay.
        ns_steps: Newton-Schulz iterations.
        ns_coefficients: a named set of `muon.NS_COEFFICIENTS` ("polar_express", the default;
            "fixed", torch.optim.Muon's; "tuned") or a list of (a, b, c) triples.
        ns_dtype: Newton-Schulz compute dtype; matrices also travel in it when it is narrower
            than the parameter (the result is the same, since Newton-Schulz casts first).
        eps: floor of the Frobenius norm Newton-Schulz divides by.
        adjust_lr: "match_rms_adamw", "original" or "none" (see `adjusted_lr`).
        betas, adamw_eps, adamw_lr: defaults of AdamW groups. An AdamW group without its own
            `lr` takes `adamw_lr` (3e-3, `muon.param_groups`' default), never Muon's `lr`: the
            two work on different scales (Muon's update has unit singular values).
        remainder_strategy: how a batch smaller than its FSDP group is exchanged: "agrs",
            "pad_all2all", "ragged_all_to_all", or "auto" (per batch, the lowest modelled time
            whose planned per-rank peak fits `memory_budget`; see `muon.plan.choose_remainder`).
        enable_all2all: False exchanges every batch with all-gather + reduce-scatter ("agrs").
        max_inflight: batches alive at once (a sliding window: when one finishes, the next
            launches its first collective at once).
        expert_aware: False exchanges fused experts as whole matrices (the behaviour before the
            local and sub-group paths existed, kept for planning comparisons).
        memory_budget: bytes a batch's planned peak may hold on a rank: batches are cut to it
            and "auto" fits it; None: 256 MiB batches (`muon.paths.BATCH_BYTES`), "auto" free.
        link: the `muon.cost.LinkModel` (or a (latency_s, bytes_per_s[, flops_per_s]) tuple)
            "auto" models collectives with; None measures it at construction with two tiny
            all-reduces on the default group (collective) when "auto" needs it.
        ns_algorithm: "auto" (the default: Gram Newton-Schulz on blocks of at least 256 rows
            and columns where it needs fewer FLOPs, the standard iteration elsewhere), "gram"
            (wherever it needs fewer FLOPs) or "standard"; see `muon.newton_schulz`.
        normuon: normalize each orthogonalized block by a running second moment per row (per
            column for wide blocks) with a Frobenius rescale (NorMuon, `muon.normuon`); the
            moments are state `normuon_v`, float32 `[num_blocks, rows or cols]` per parameter.
        normuon_beta2: the second moment's EMA coefficient, in [0, 1).

    After a step, `step_stats` holds this rank's bytes, blocks and batches per path and its time
    in Newton-Schulz and in waiting (on CUDA device time, from events: `muon.stats`);
    `plan.ns_flops_per_rank` the planned NS work of every rank.
    """

    def __init__(
        self,
        params: Iterable,
        *,
        lr: float = _D.lr,
        momentum: float = _D.momentum,
        nesterov: bool = _D.nesterov,
        weight_decay: float = _D.weight_decay,
        ns_steps: int = _D.ns_steps,
        ns_coefficients: str | list = _D.ns_coefficients,
        ns_dtype: torch.dtype | str = _D.ns_dtype,
        eps: float = _D.eps,
        adjust_lr: str = _D.adjust_lr,
        betas: tuple[float, float] = _D.betas,
        adamw_eps: float = _D.adamw_eps,
        adamw_lr: float = _D.adamw_lr,
        remainder_strategy: str = _D.remainder_strategy,
        enable_all2all: bool = _D.enable_all2all,
        max_inflight: int = _D.max_inflight,
        expert_aware: bool = _D.expert_aware,
        memory_budget: int | None = _D.memory_budget,
        link: LinkModel | tuple | None = None,
        ns_algorithm: str = _D.ns_algorithm,
        normuon: bool = _D.normuon,
        normuon_beta2: float = _D.normuon_beta2,
    ) -> None:
        remainder_strategy = check_options(
            remainder_strategy=remainder_strategy,
            enable_all2all=enable_all2all,
            expert_aware=expert_aware,
            max_inflight=max_inflight,
            memory_budget=memory_budget,
        )
        self._adamw_defaults = {"lr": adamw_lr, "betas": betas, "eps": adamw_eps}
        defaults = dict(
            lr=lr,
            algorithm="muon",
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_dtype=dtype_name(ns_dtype),
            ns_algorithm=ns_algorithm,
            eps=eps,
            adjust_lr=adjust_lr,
            num_blocks=1,
            split_sizes=None,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
        )
        self.remainder_strategy = remainder_strategy
        self.enable_all2all = enable_all2all
        self.max_inflight = max_inflight
        self.expert_aware = expert_aware
        self.memory_budget = memory_budget
        super().__init__(params, defaults)
        #: skipped steps and refused updates (`muon.verdict`)
        self._verdict = StepVerdict(partial(refusals_learnt, self))
        self.step_stats: dict[str, float] = {}
        #: ids of the parameters without a grad on any rank, this step
        self._gradless: set[int] = set()
        self._link = resolve_link(link, needed=remainder_strategy == "auto")
        self._init_state()
        self._plan()

    def _plan(self) -> None:
        """(Re)build the step plan from the current groups (collective, see `muon.planner`)."""
        if hasattr(self, "plan"):  # owners may move: every copy of NorMuon's moments current
            normuon.sync(self)
        self.plan = build_step_plan(
            self.param_groups,
            remainder_strategy=self.remainder_strategy,
            enable_all2all=self.enable_all2all,
            expert_aware=self.expert_aware,
            memory_budget=self.memory_budget,
            link=self._link,
        )
        self._planned_params = [tuple(map(id, g["params"])) for g in self.param_groups]
        normuon.init_state(self)
        self._prepare()

    def state_dict(self) -> dict:
        """The state dict, with NorMuon's moments made equal on every rank first (collective
        when NorMuon is on: call it on every rank, as DCP's `get_state_dict` does)."""
        normuon.sync(self)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, after `muon.state_dict.check_loaded_groups` has checked everything it
        would load; re-plans (collectively, as the constructor) when planning keys changed."""
        loaded = check_loaded_groups(self.param_groups, state_dict)
        before = plan_keys(self.param_groups)
        # torch's load casts every state tensor to the parameter's dtype; NorMuon's moments
        # (float32) and the demotion flags (bool) keep theirs: loaded apart
        state_dict, kept = without_own_dtype_state(state_dict)
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            for key, value in kept.get(i, {}).items():
                dtype = OWN_DTYPE_STATE[key]
                self.state[p][key] = value.to(device=local(p).device, dtype=dtype, copy=True)
        for g, checked in zip(self.param_groups, loaded, strict=True):
            # what was checked is what is loaded: saved values over current ones, normalized
            g.clear()
            g.update(checked)
        self._init_state()  # keys an older state dict lacks
        if plan_keys(self.param_groups) != before:
            self._plan()
        else:  # the loaded demotions (`muon.blowups`)
            self._blowups.restore(self.param_groups, self.plan.params, self.state)

    def _check_params_unchanged(self) -> None:
        """Parameters appended to (or removed from) a group's list after planning would be
        skipped silently: refuse to step instead."""
        now = [tuple(map(id, g["params"])) for g in self.param_groups]
        if now != self._planned_params:
            planned = self._planned_params + [None] * len(now)  # groups appended by hand too
            changed = next((i for i, ids in enumerate(now) if ids != planned[i]), len(now))
            raise RuntimeError(
                f"Muon: param_groups[{changed}]['params'] changed after the optimizer was "
                "planned; add parameters with add_param_group (on every rank), which plans "
                "them and creates their state"
            )

    @property
    def plans(self) -> list[tuple[MeshCommPlan, list[BatchPlan]]]:
        """(mesh comm plan, its batches) in step order: the plan as plain data."""
        return self.plan.plans

    # ----------------------------------------------------------------- groups and validation
    def add_param_group(self, param_group: dict) -> None:
        """Add a group (see the class docstring for its keys). Everything is checked before the
        optimizer changes: a rejected group leaves groups, state and plan as they were."""
        check_group_keys(param_group, f"param group {len(self.param_groups)}")
        algorithm = group_algorithm(param_group)
        params = param_group["params"]
        if isinstance(params, set):
            raise TypeError("params: a set has no order (ranks would plan differently); use a list")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        extra = self._adamw_defaults if algorithm == "adamw" else {}
        group = {**self.defaults, **extra, **param_group, "params": params, "algorithm": algorithm}
        if algorithm == "adamw":  # Muon's defaults mean nothing to an AdamW group
            for key in MUON_ONLY_KEYS:
                group.pop(key, None)
        validate_group(group)
        planned = hasattr(self, "plan")
        n_groups, known = len(self.param_groups), set(self.state)
        super().add_param_group(group)  # its own checks (duplicates, leaves) append nothing
        if algorithm == "adamw":  # torch filled Muon's defaults in again
            for key in MUON_ONLY_KEYS:
                self.param_groups[-1].pop(key, None)
        if planned:  # after construction: state and plans for the new group
            kept = (self.plan, self._planned_params)
            try:
                self._init_state()
                self._plan()
            except Exception:
                del self.param_groups[n_groups:]
                for p in [p for p in self.state if p not in known]:
                    del self.state[p]
                self.plan, self._planned_params = kept  # the plan of the groups that remain
                raise

    def _init_state(self) -> None:
        """Create every parameter's state now, so all ranks have the same checkpoint keys."""
        for g in self.param_groups:
            for p in g["params"]:
                st, device = self.state[p], local(p).device
                if g["algorithm"] == "muon":
                    st.setdefault("momentum_buffer", torch.zeros_like(p))
                    # learnt by the census (`muon.blowups`); a plain tensor, the same on every
                    # rank, so it reshards with the rest of the state
                    st.setdefault("gram_demoted", torch.zeros((), dtype=torch.bool, device=device))
                else:  # on the parameter's device, as torch.optim's fused AdamW keeps it
                    st.setdefault("step", torch.zeros((), device=device))
                    st.setdefault("exp_avg", torch.zeros_like(p))
                    st.setdefault("exp_avg_sq", torch.zeros_like(p))

    # ---------------------------------------------------------------------------------- step
    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped: a non-finite gradient (decided by the census) or
        an update that did not fit (`muon.guard`, read from the device the first time this is
        asked after the step, so a step nobody asks about waits for nothing)."""
        return self._verdict.last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reads the update verdicts not read yet, at most one read)."""
        return self._verdict.skipped_steps

    @property
    def step_skipped(self) -> bool | torch.Tensor:
        """The last step's `last_step_skipped` without a host read: True (the census skipped
        it), or a 0-d bool tensor on the device (whether an update did not fit, on any rank)."""
        return self._verdict.step_skipped

    @property
    def step_stats(self) -> dict[str, float]:
        """This rank's counters of the last step (`muon.stats`), read when first asked for: on
        CUDA that waits for the step's timing events, so the step itself never does."""
        if self._stats is not None:
            self._step_stats, self._stats = self._stats.as_dict(), None
        return self._step_stats

    @step_stats.setter
    def step_stats(self, value: dict[str, float]) -> None:
        self._step_stats, self._stats = value, None

    def _prepare(self) -> None:
        """What every step reuses, made once per plan (`muon.chunks`), and the Gram blow-up
        counters (`muon.blowups`), whose demotions a new plan forgets."""
        self._census = GradCensus()
        self._chunks = prepare_chunks(self.plan, self.param_groups)
        self._blowups = GramBlowups(self.plan)
        self._blowups.restore(self.param_groups, self.plan.params, self.state)
        self._verdict_groups = verdict_groups(self.plan)
        self._verdict.take_refusals()  # the last update's refusals name the old plan's batches

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One step: the gradient census (one host read, which also brings the previous
        update's Gram blow-up counts, `muon.blowups`), then `update` unless it skips, then
        the update guard's verdict left on the device (`muon.guard.SkipFlag`, read lazily by
        `last_step_skipped` / `skipped_steps`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params_unchanged()
        for g in self.param_groups:  # a scheduler's cycled momentum is an AdamW group's beta1
            if g["algorithm"] == "adamw":
                fold_adamw_momentum(g)
        self._verdict.settle()  # summed on the device until `skipped_steps` is read
        # the census also carries the previous update's Gram blow-up counts (`muon.blowups`)
        # and its refusals, one flag per parameter position of every chunk
        counters = [self._blowups.counts] if self._blowups.counts is not None else []
        refusals = self._verdict.take_refusals()
        counters += [ok for _, _, ok in refusals]  # bool, widened by the cat
        extra = torch.cat(counters) if counters else None
        finite, self._gradless, counts = self._census(self.param_groups, extra)
        n_blown = len(self._blowups.batches) if self._blowups.counts is not None else 0
        self._blowups.demote(counts[:n_blown], self.param_groups, self.plan.params, self.state)
        self._verdict.learn(refusals, counts[n_blown:], world_size())
        self._verdict.census(finite)
        if not finite:
            return loss
        self.update()
        # an update that did not fit was not written; the verdict stays on the device
        self._verdict.finish_update()
        return loss

    @property
    def refused_updates(self) -> int:
        """Parameter updates refused so far (`muon.guard`: each parameter of each step whose
        update could not be written, on every rank holding it). The next step's census learns
        them without a read of its own (and warns, naming them); asked before that, the last
        update's are read here (one read: the verdicts were agreed on every rank holding each
        parameter, so this rank's are the parameters'). AdamW's are counted at once."""
        return self._verdict.refused_updates

    @torch.no_grad()
    def update(self, *, timed: bool = True) -> None:
        """The step after the census, on the gradients as they are: AdamW groups, then every
        Muon batch. No host reads on the local path and the AdamW groups (the exchanges read
        their plan, never a device value), so a CUDA graph can capture it (`timed=False`: no
        timing events, which a graph cannot record: `step_stats` then times on the host). The
        verdicts of `muon.guard` collect in the `muon.verdict.StepVerdict`, which `step` makes
        one flag of afterwards."""
        self._verdict.start_update()
        self._blowups.reset()
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                self._adamw_group(g)
        device = self.plan.params[0][0].device if self.plan.params and timed else None
        stats = StepStats(device)
        ctx = StepContext(
            plan=self.plan,
            param_groups=self.param_groups,
            state=self.state,
            chunks=self._chunks,
            gradless=self._gradless,
            verdict=self._verdict,
            verdict_groups=self._verdict_groups,
            blowups=self._blowups,
        )
        AsyncRuntime(batch_tasks(ctx, stats), max_inflight=self.max_inflight).run()
        self._stats = stats

    def _adamw_group(self, g: dict) -> None:
        """torch's fused AdamW over the group's parameters with a grad (`muon.update`)."""
        params = [p for p in g["params"] if p.grad is not None]
        beta1 = g["betas"][0]
        # the bias-corrected scale lr / (1 - beta1^t) is largest at t = 1: a dtype it passes
        # there cannot be written at all (`muon.guard`), decided on the host without t
        big = {p.dtype for p in params if g["lr"] / (1 - beta1) > torch.finfo(p.dtype).max}
        if big:
            names = g.get("param_names") or [f"shape {tuple(p.shape)}" for p in g["params"]]
            refused = [
                n
                for p, n in zip(g["params"], names, strict=True)
                if p.grad is not None and p.dtype in big
            ]
            self._verdict.refuse_on_host(len(refused))
            why = f"(AdamW, lr / (1 - beta1) = {g['lr'] / (1 - beta1):.3g}) cannot be written"
            warn_refused(refused, why)
            params = [p for p in params if p.dtype not in big]
        update.adamw_group_(
            params,
            self.state,
            lr=g["lr"],
            betas=g["betas"],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
        )
