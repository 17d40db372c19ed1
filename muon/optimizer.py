"""Muon with AdamW groups in one optimizer, for plain tensors and FSDP2 / EP DTensors.

The path of one Muon batch through a step: at construction `planner.py` decided which
matrices travel together (`plan.py`) and who assembles them (`owners.py`); here each batch
becomes an AsyncTask (`_task`) that (1) updates the momentum of its local shards straight into
the send buffer of its path, (2) runs the path's exchange from `comm.py`, in which the owners
orthogonalize with `newton_schulz.py`, and (3) applies the returned shards. `runtime.py` keeps
a sliding window of batches in flight.

Update (per Muon parameter, on local shards; matches torch.optim.Muon):
    M <- lerp(M, G, 1 - momentum);  U = lerp(G, M, momentum) if nesterov else M
    O = NS(U) per block (NorMuon, `normuon=True`: O <- normalize(O, v), `muon.normuon`)
    p <- p * (1 - lr * wd) - adjusted_lr * O
with adjusted_lr from the per-block shape: "original" lr * sqrt(max(1, rows/cols)),
"match_rms_adamw" lr * 0.2 * sqrt(max(rows, cols)), "none" lr.

Non-finite gradients: if any gradient of any parameter on any rank holds a NaN or Inf, the whole
step is skipped on every rank: no parameter or state changes, `last_step_skipped` is True and
`skipped_steps` counts it.

Updates that do not fit: finite gradients can still give an update whose `lr * O` overflows
the parameter's dtype (float16 at 65504, `muon.guard`). Such a parameter keeps its value (its
momentum has moved), the others are updated, and the step is marked skipped on every rank
(`last_step_skipped`, `skipped_steps`).

Missing gradients: a parameter whose `.grad` is None on every rank is left untouched, state
included, as in torch.optim.Muon and torch.optim.AdamW (in an exchange its slot travels as
zeros and its result is dropped, so the batch keeps its plan). Ranks that disagree about a
parameter raise a RuntimeError naming it, on every rank, before anything is written. Both
checks share one all-reduce of P + 1 int32 flags per step (P parameters).

Parameter groups added after construction (`add_param_group`) are planned again, collectively:
call it on every rank in the same order, as the constructor is.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from functools import partial

import torch

from muon import normuon
from muon.blocks import local as _local
from muon.blocks import orthogonalize as _orthogonalize
from muon.comm import PATHS
from muon.cost import LinkModel
from muon.grads import grad_census
from muon.guard import fit, guard_update, updates_finite
from muon.layout import from_rows, moved_shape, to_rows
from muon.plan import REMAINDER_CHOICES, BatchPlan, MeshCommPlan
from muon.planner import build_step_plan, resolve_link
from muon.runtime import AsyncRuntime
from muon.stats import StepStats
from muon.validate import (
    ADJUST_LR,
    MUON_ONLY_KEYS,
    NS_DTYPES,
    check_group_keys,
    check_loaded_groups,
    check_options,
    dtype_name,
    fold_adamw_momentum,
    group_algorithm,
    plan_keys,
    validate_group,
)

__all__ = ["ADJUST_LR", "NS_DTYPES", "Muon", "adjusted_lr"]  # the choice lists recipes read


def adjusted_lr(lr: float, adjust_lr: str, rows: int, cols: int) -> float:
    """The Muon learning rate for one `[rows, cols]` block."""
    if adjust_lr == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


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
        memory_budget: bytes one batch may hold on a rank, for `remainder_strategy="auto"`;
            None means no bound.
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
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: str | list = "polar_express",
        ns_dtype: torch.dtype | str = torch.bfloat16,
        eps: float = 1e-7,
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float = 3e-3,
        remainder_strategy: str = "pad_all2all",
        enable_all2all: bool = True,
        max_inflight: int = 3,
        expert_aware: bool = True,
        memory_budget: int | None = None,
        link: LinkModel | tuple | None = None,
        ns_algorithm: str = "auto",
        normuon: bool = False,
        normuon_beta2: float = 0.95,
    ) -> None:
        if not isinstance(remainder_strategy, str) or remainder_strategy not in REMAINDER_CHOICES:
            raise ValueError(
                f"remainder_strategy: {remainder_strategy!r} is not one of "
                f"{', '.join(REMAINDER_CHOICES)}"
            )
        if not enable_all2all and remainder_strategy not in ("agrs", "auto"):
            warnings.warn(
                f"enable_all2all=False: remainder_strategy {remainder_strategy!r} needs "
                "all-to-all; using 'agrs'",
                UserWarning,
                stacklevel=2,
            )
        if not enable_all2all:
            remainder_strategy = "agrs"  # "auto" too: agrs is the only path without all-to-all
        check_options(
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
        self.skipped_steps = 0
        self.last_step_skipped = False
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

    def state_dict(self) -> dict:
        """The state dict, with NorMuon's moments made equal on every rank first (collective
        when NorMuon is on: call it on every rank, as DCP's `get_state_dict` does)."""
        normuon.sync(self)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, after `muon.validate.check_loaded_groups` has checked everything it
        would load; re-plans (collectively, as the constructor) when planning keys changed."""
        loaded = check_loaded_groups(self.param_groups, state_dict)
        before = plan_keys(self.param_groups)
        super().load_state_dict(state_dict)
        for g, checked in zip(self.param_groups, loaded, strict=True):
            # what was checked is what is loaded: saved values over current ones, normalized
            g.clear()
            g.update(checked)
        if plan_keys(self.param_groups) != before:
            self._plan()

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
                st = self.state[p]
                if g["algorithm"] == "muon":
                    st.setdefault("momentum_buffer", torch.zeros_like(p))
                else:
                    st.setdefault("step", torch.tensor(0.0))
                    st.setdefault("exp_avg", torch.zeros_like(p))
                    st.setdefault("exp_avg_sq", torch.zeros_like(p))

    # ---------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params_unchanged()
        for g in self.param_groups:  # a scheduler's cycled momentum is an AdamW group's beta1
            if g["algorithm"] == "adamw":
                fold_adamw_momentum(g)
        finite, self._gradless = grad_census(self.param_groups)
        if not finite:
            self.skipped_steps += 1
            self.last_step_skipped = True
            return loss
        self.last_step_skipped = False
        self._updates_ok = []
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                self._adamw_group(g)
        stats = StepStats(self.plan.params[0][0].device if self.plan.params else None)
        runtime = AsyncRuntime(self._tasks(stats), max_inflight=self.max_inflight)
        runtime.run()
        self.step_stats = stats.as_dict()
        if not updates_finite(self._updates_ok):  # an update that did not fit was not written
            self.skipped_steps += 1
            self.last_step_skipped = True
        return loss

    def _adamw_group(self, g: dict) -> None:
        b1, b2 = g["betas"]
        for p in g["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            st["step"] += 1
            t = st["step"].item()
            x, grad = _local(p), _local(p.grad)
            m, v = _local(st["exp_avg"]), _local(st["exp_avg_sq"])
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(g["eps"])
            if g["lr"] / (1 - b1**t) > torch.finfo(x.dtype).max:  # cannot be written (guard)
                self._updates_ok.append(torch.tensor(False))
                continue
            x.mul_(1 - g["lr"] * g["weight_decay"])
            x.addcdiv_(m, denom, value=-g["lr"] / (1 - b1**t))

    def _tasks(self, stats: StepStats):
        """One AsyncTask per batch, created lazily in plan order."""
        for mp, batches in self.plan.plans:
            for b in batches:
                yield self._task(mp, b, stats)

    def _task(self, mp: MeshCommPlan, b: BatchPlan, stats: StepStats):
        """One batch, top to bottom: momentum -> exchange + Newton-Schulz -> apply."""
        params = [
            (p, self.param_groups[gi]) for p, gi in (self.plan.params[i] for i in b.param_indices)
        ]
        g0 = params[0][1]
        # blocks are runs of dim 0; a matrix sharded on another dim is exchanged with that dim
        # first and orthogonalized in its own layout (see _orthogonalize)
        ortho = partial(
            _orthogonalize,
            block_rows=b.block_rows,
            block_shape=b.block_shape,
            moved_shape=moved_shape(b.global_shape, b.shard_tensor_dim),
            dim=b.shard_tensor_dim,
            steps=g0["ns_steps"],
            coefficients=g0["ns_coefficients"],
            dtype=getattr(torch, g0["ns_dtype"]),
            eps=g0["eps"],
            algorithm=g0.get("ns_algorithm", "standard"),  # absent in older state dicts
            post=normuon.post_for(self, params, b),
            heights=b.split_sizes,
        )
        stats.batches[b.path] += 1
        if b.path == "local":  # no exchange: one parameter at a time, nothing held across
            first, count = b.unit_blocks(mp.fsdp_rank)
            for j, (p, g) in enumerate(params):
                if id(p) in self._gradless:
                    continue
                shard = self._momentum_step(p, g, mp.shard_tensor_dim)
                if shard.numel():
                    units = [(j, first, count)]
                    shard = stats.orthogonalize(ortho, shard, "local", count, units=units)
                self._apply(p, g, shard, b, mp.fsdp_rank)
            return
        path = PATHS[b.path]
        like = _local(self.state[params[0][0]]["momentum_buffer"])
        # 1. momentum: buffers updated, NS inputs written straight into the send buffer's slots
        send, slots = path.send_buffer(
            b, mp.fsdp_rank, dtype=getattr(torch, b.wire_dtype), device=like.device
        )
        for (p, g), slot in zip(params, slots, strict=True):
            self._momentum_step(p, g, mp.shard_tensor_dim, out=slot)
        # 2. exchange: owners assemble, orthogonalize and return their units
        group = self.plan.groups[(mp, b.subgroup_size if b.path == "subgroup" else 0)]
        results = yield from path.run(
            b, send, fsdp_rank=mp.fsdp_rank, group=group, ortho=ortho, stats=stats
        )
        # 3. apply the orthogonalized shards
        for (p, g), o in zip(params, results, strict=True):
            if id(p) not in self._gradless:  # a parameter without any grad stays untouched
                self._apply(p, g, o, b, mp.fsdp_rank)

    def _apply(self, p, g: dict, o: torch.Tensor, b: BatchPlan, fsdp_rank: int) -> None:
        """Decoupled weight decay, then the orthogonalized update at the per-block lr; neither
        when the update does not fit the parameter's dtype (`muon.guard`)."""
        if len(b.global_shape) > 2:  # each dim-0 slice is a block
            rows, cols = b.block_shape
        else:
            rows, cols = b.global_shape[0] // g["num_blocks"], b.block_cols
        x = _local(p)
        update = from_rows(o, x, b.shard_tensor_dim)
        lrs = {h: adjusted_lr(g["lr"], g["adjust_lr"], h, cols) for h in b.split_sizes or (rows,)}
        update = guard_update(x, update, max(lrs.values()), g, self._updates_ok)
        if not b.split_sizes:
            x.add_(update, alpha=-fit(lrs[rows], x.dtype))
            return
        # blocks of unequal heights: each height its own lr, on this rank's rows of dim 0
        heights = torch.tensor(b.split_sizes)
        row_height = heights.repeat_interleave(heights)
        if b.shard_tensor_dim == 0 and b.fsdp_size > 1:
            start = sum(b.shard_sizes[:fsdp_rank])
            row_height = row_height[start : start + x.shape[0]]
        for h in sorted(set(b.split_sizes)):
            rows = (row_height == h).nonzero().view(-1).to(x.device)
            if rows.numel():
                # the update may arrive in a narrower wire dtype; add_ would promote it too
                x.index_add_(
                    0, rows, update.index_select(0, rows).to(x.dtype), alpha=-fit(lrs[h], x.dtype)
                )

    def _momentum_step(
        self, p: torch.Tensor, g: dict, shard_dim: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """M <- lerp(M, G, 1 - mu); the NS input (lerp(G, M, mu) with Nesterov, else M) as
        `[rows, C]`, sharded dim first: written into `out` (a send-buffer slot, possibly of a
        narrower wire dtype) when given, else returned. A parameter without a grad on any rank
        keeps its momentum and sends zeros."""
        if id(p) in self._gradless:
            return out.zero_()
        buf = _local(self.state[p]["momentum_buffer"])
        grad = _local(p.grad) if p.grad is not None else torch.zeros_like(buf)
        mu = g["momentum"]
        buf.lerp_(grad, 1 - mu)
        if out is None:
            update = grad.lerp(buf, mu) if g["nesterov"] else buf  # read-only from here on
            return to_rows(update, shard_dim)
        target = from_rows(out, buf, shard_dim)
        if not g["nesterov"]:
            target.copy_(buf)
        elif target.dtype == buf.dtype:
            torch.lerp(grad, buf, mu, out=target)
        else:  # a narrower wire dtype: round the way Newton-Schulz's own cast would
            target.copy_(grad.lerp(buf, mu))
        return out
