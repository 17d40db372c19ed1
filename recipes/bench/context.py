"""One MLA + DSA layer under context parallelism: per rank, forward + backward seconds, peak
memory and the DSA indexer's FLOPs, for each sequence layout, with the gathered key side kept
for backward or gathered again there.

The layer is the attention benchmark's (`recipes.bench.attention.LAYER`: mla_tiny's fields at
hidden 512, 16 heads, q/kv ranks 128, indexer 4 heads x 32; the latent sparse path) with the
given `index_topk`, indexer training mode and `dsa_chunk_mib`. One world of cp gloo ranks
(`recipes.world.run_world`, one thread each) per cp. Every rank builds the same layer and the
same full-sequence input and loss probe (fixed seeds), then, per variant, installs the
key-side gather over the world (`apply_context_parallel(layer, group, layout,
keep_gathered=...)`) and runs its own tokens, `local_tokens(layout, cp, rank, S)`, through the
layer's forward (`tokens=`). A variant is (layout, keep_gathered); `keep_gathered=False` runs
only where this checkout's `apply_context_parallel` takes the keyword (`regather_supported`).

The step: forward of the rank's tokens, a fixed random projection of the output as the loss
(plus the indexer KL in kl mode), backward into the parameters and the rank's input. Per
variant and rank:
- seconds: one warm-up step per variant, then `repeats` rounds in which the variants take
  turns step by step, each step after a barrier: the median of the rank's process CPU time
  (its own work and its gloo threads'; a wait for a peer costs none, so the figure is the
  rank's work even on an oversubscribed machine) and of its wall time;
- peak MiB: `MemoryMeter.peak_delta_bytes` of one more step; saved MiB: the live bytes its
  forward (and loss) left for backward (`end_bytes - start_bytes` of that region);
- GFLOP: `torch.utils.flop_counter.FlopCounterMode` around one more forward and its
  backward: the indexer's top-k scoring (every chunk of queries times the keys up to its last
  query, the part that grows with a query's position), the indexer module's forward (its
  projections and the kept keys' scores too), the whole layer's forward + backward; and the
  causal keys, the sum over the rank's queries of max(position + 1, K): what the top-k scoring
  would score with one query per chunk. The counts are deterministic.
"""

from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from recipes.bench.attention import layer_config
from recipes.units import MiB

VARIANTS = tuple((layout, keep) for layout in ("head_tail", "contiguous") for keep in (True, False))
GATHERS = {"keep": True, "regather": False}  # --gather names -> keep_gathered
GFLOP = 1e9
#: the columns of results.csv
FIELDS = (
    *("cp", "variant", "layout", "keep_gathered", "rank", "tokens", "runs"),
    *("cpu_s", "wall_s", "repeats", "peak_mib", "saved_mib"),
    *("topk_gflop", "indexer_gflop", "layer_fwd_gflop", "layer_gflop", "causal_keys", "skipped"),
)


def regather_supported() -> bool:
    """Whether `apply_context_parallel` takes `keep_gathered` (False: the gathered key side is
    gathered again in backward instead of being kept)."""
    from models.glm.infra.context_parallel import apply_context_parallel

    return "keep_gathered" in inspect.signature(apply_context_parallel).parameters


def variant_name(layout: str, keep: bool) -> str:
    """`head_tail`, `head_tail re-gather`, ...: a variant as the tables name it."""
    return layout if keep else f"{layout} re-gather"


def context_config(seq_len: int, topk: int, mode: str, chunk_mib: int):
    """The benchmarked layer's GLMConfig: the attention benchmark's layer on the latent sparse
    path, with its own index_topk and query-chunk budget."""
    from dataclasses import replace

    config = layer_config(seq_len, "latent", mode)
    return replace(config, index_topk=topk, dsa_chunk_mib=chunk_mib)


class _Case:
    """One variant on this rank: its tokens, its slice of the input and probe, its rope."""

    def __init__(self, layer, config, spec: dict, layout: str, keep: bool, full: tuple) -> None:
        from models.glm.infra.context_parallel import local_tokens
        from models.glm.model.layers import rope_cos_sin

        rank, cp, S = dist.get_rank(), dist.get_world_size(), spec["seq_len"]
        self.layer, self.layout, self.keep, self.kl = layer, layout, keep, spec["mode"] == "kl"
        self.tokens = local_tokens(layout, cp, rank, S).on(torch.device("cpu"))
        x_BSD, probe_BSD = full
        self.x_BTD = self.tokens.take(x_BSD).clone().requires_grad_(True)
        self.probe_BTD = self.tokens.take(probe_BSD).clone()
        pos_T = self.tokens.positions_T
        self.cos, self.sin = rope_cos_sin(
            pos_T.numel(),
            config.rotary_dim,
            config.rope_theta,
            pos_T.device,
            config.rope_scaling,
            pos_T,
        )
        self.seq_len, self.cpu_s, self.wall_s = S, [], []

    def install(self) -> None:
        from models.glm.infra.context_parallel import apply_context_parallel

        keep = {} if self.keep and not regather_supported() else {"keep_gathered": self.keep}
        apply_context_parallel(self.layer, dist.group.WORLD, self.layout, **keep)

    def forward(self) -> torch.Tensor:
        """The step's loss: the output's projection on the probe (+ the indexer KL)."""
        out, _, kl = self.layer(self.x_BTD, self.cos, self.sin, with_kl=self.kl, tokens=self.tokens)
        loss = (out * self.probe_BTD).sum() / self.seq_len
        return loss if kl is None else loss + kl

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.layer.zero_grad(set_to_none=True)
        self.x_BTD.grad = None

    def timed_step(self) -> None:
        self.install()
        dist.barrier()
        t0, w0 = time.process_time(), time.perf_counter()
        self.backward(self.forward())
        self.cpu_s.append(time.process_time() - t0)
        self.wall_s.append(time.perf_counter() - w0)

    def memory(self, meter) -> dict:
        self.install()
        dist.barrier()
        with meter.measure() as m, m.region("step"):
            with m.region("forward"):
                loss = self.forward()
            self.backward(loss)
        saved = m.end_bytes("forward") - m.start_bytes("forward")
        return {"peak_mib": m.peak_delta_bytes("step") / MiB, "saved_mib": saved / MiB}

    def flops(self) -> dict:
        from torch.utils.flop_counter import FlopCounterMode

        self.install()
        topk_scores: list[int] = []
        with FlopCounterMode(display=False) as fwd, _counting_topk_scores(fwd, topk_scores):
            loss = self.forward()
        with FlopCounterMode(display=False) as bwd:
            self.backward(loss)
        by_module = fwd.get_flop_counts()
        indexer = [sum(v.values()) for k, v in by_module.items() if k.endswith(".indexer")]
        if len(indexer) != 1:
            raise RuntimeError(f"no single indexer module among {sorted(by_module)}")
        K = min(self.layer.indexer.topk, self.seq_len)
        return {
            "topk_gflop": sum(topk_scores) / GFLOP,
            "indexer_gflop": indexer[0] / GFLOP,
            "layer_fwd_gflop": fwd.get_total_flops() / GFLOP,
            "layer_gflop": (fwd.get_total_flops() + bwd.get_total_flops()) / GFLOP,
            "causal_keys": int(self.tokens.positions_T.add(1).clamp(min=K).sum()),
        }

    def row(self) -> dict:
        return {
            "cp": dist.get_world_size(),
            "variant": variant_name(self.layout, self.keep),
            "layout": self.layout,
            "keep_gathered": self.keep,
            "rank": dist.get_rank(),
            "tokens": self.tokens.count,
            "runs": " ".join(f"{f}-{f + n - 1}" for f, n in self.tokens.runs),
            "cpu_s": statistics.median(self.cpu_s),
            "wall_s": statistics.median(self.wall_s),
            "repeats": len(self.cpu_s),
        }


@contextlib.contextmanager
def _counting_topk_scores(counter, into: list[int]) -> Iterator[None]:
    """Inside: each call of the indexer's top-k (`select_topk`: the products of each chunk of
    queries with the keys up to its last query; its top-k and masks count no FLOPs) appends
    the FLOPs `counter` saw it run to `into`."""
    from models.glm.model import indexer as indexer_module

    original = indexer_module.select_topk

    def counted(*args, **kwargs):
        before = counter.get_total_flops()
        out = original(*args, **kwargs)
        into.append(counter.get_total_flops() - before)
        return out

    indexer_module.select_topk = counted
    try:
        yield
    finally:
        indexer_module.select_topk = original


def _layer(config):
    from models.glm.model.mla import MLAttention

    torch.manual_seed(0)
    layer = MLAttention(config, 0)
    for p in layer.parameters():  # std 1/sqrt(fan_in): activations and logits of order one
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5) if p.ndim > 1 else None
    return layer


def rank_main(spec: dict) -> list[dict]:
    """This rank's rows, one per variant of `spec["variants"]` ((layout, keep) pairs); spec:
    seq_len, topk, mode, chunk_mib, repeats. Runs on every rank of a gloo world."""
    from recipes.memory import MemoryMeter

    torch.set_num_threads(1)
    meter = MemoryMeter("cpu")  # before anything is allocated
    S = spec["seq_len"]
    config = context_config(S, spec["topk"], spec["mode"], spec["chunk_mib"])
    layer = _layer(config)
    gen = torch.Generator().manual_seed(1)
    full = tuple(torch.randn(1, S, config.hidden_size, generator=gen) for _ in range(2))
    cases = [_Case(layer, config, spec, layout, keep, full) for layout, keep in spec["variants"]]
    del full
    for case in cases:  # warm-up
        case.install()
        case.backward(case.forward())
    for _ in range(spec["repeats"]):
        for case in cases:
            case.timed_step()
    return [{**c.row(), **c.memory(meter), **c.flops()} for c in cases]


def sweep(
    cps: list[int], variants: list[tuple[str, bool]], spec: dict, *, timeout: float, log=print
) -> list[dict]:
    """Every rank's rows of every variant, one world per cp; a `keep_gathered=False` variant
    this checkout cannot run gives one row per cp saying so."""
    from recipes.world import run_world

    runnable = [v for v in variants if v[1] or regather_supported()]
    rows = []
    for cp in cps:
        t0 = time.perf_counter()
        ranks = run_world(rank_main, cp, {**spec, "variants": runnable}, timeout_s=timeout)
        log(f"cp={cp}: {len(runnable)} variant(s) in {time.perf_counter() - t0:.0f} s")
        order = {variant_name(*v): i for i, v in enumerate(runnable)}
        rows += sorted((r for rank in ranks for r in rank), key=lambda r: order[r["variant"]])
        for layout, keep in variants:
            if (layout, keep) not in runnable:
                rows.append(
                    {
                        "cp": cp,
                        "variant": variant_name(layout, keep),
                        "layout": layout,
                        "keep_gathered": keep,
                        "skipped": "apply_context_parallel takes no keep_gathered here",
                    }
                )
    return rows
