"""Context parallelism in the step estimate and the planner: what a cp rank holds and moves.

Under `mesh.cp` (`models/glm/infra/context_parallel.py`) each rank computes T = S / cp tokens
of every sequence of S tokens it reads, and each attention's key side is all-gathered over the
cp group. Per decoder layer (`layer_share`):
- the local tokens' activations: what `recipes.activation_bytes` counts per token, for T
  queries attending S keys, less what is saved per key, plus the causal mask SDPA then keeps
  ([T, S] in the compute dtype, once per layer, for GQA, dense MLA and DSA's masked reference
  when S <= index_topk: with cp = 1 they run is_causal, maskless);
- the key side (`key_side_bytes_per_key`): what the attention and a KL-trained indexer save
  per position of the whole sequence, S rows: kept for every layer (`model.cp_keep_gathered`,
  without activation checkpointing), else gathered again in backward, one layer's at a time;
- its gradient in backward: the saved key side's gradients plus, per gather, the
  global-order gradient reordered rank-major for the reduce-scatter;
- the collectives (`collectives`): per gather (the attention's key side: MLA's normed latent
  and rotary key, L + R values a token, GQA's K and V; the indexer's keys, C values) an
  all-gather of S rows in the compute dtype, and in backward, where the gathered rows take a
  gradient (the attention; an indexer only when KL-trained), a reduce-scatter of as many.
The positions of the local tokens (int64 [T], once per forward, shared by every layer) are not
counted. `indexer_flops` is the DSA indexer's scoring work per rank under either layout of
`models.glm.infra.context_parallel.LAYOUTS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.glm import GLMConfig
from models.glm.infra.context_parallel import TRAIN_LAYOUT, layout_runs
from recipes.activation_bytes import indexer_kl_bytes_per_token, kl_layer, layer_activation_bytes


@dataclass(frozen=True)
class LayerRun:
    """One run of a decoder layer in a step: its index (an MTP depth's layer index is
    num_hidden_layers + depth), whether it is MoE and whether it runs an indexer of its own (a
    "full" DSA layer; an MTP depth after the first reuses depth 1's kept keys under
    index_share_for_mtp_iteration)."""

    layer: int
    is_moe: bool
    runs_indexer: bool


@dataclass(frozen=True)
class LayerShare:
    """A layer's bytes on one rank for a micro-batch: `local`, the activations of its own
    tokens; `keys`, the key side it saves (0 with cp = 1: counted in `local`); `key_grads`,
    the key side's gradients in backward; `gathers`, values per token of each gather."""

    local: int
    keys: int = 0
    key_grads: int = 0
    gathers: dict[str, int] = field(default_factory=dict)


def gathered_widths(config: GLMConfig, run: LayerRun) -> dict[str, int]:
    """Values per token each gather of `run` moves: the attention's key side (MLA: the normed
    kv latent and the rotary key, L + R; GQA: K and V, 2 x kv heads x head width) and, when
    the layer runs its own indexer, the indexer's keys (C)."""
    if config.attention == "mla":
        out = {"attention": config.kv_lora_rank + config.qk_rope_head_dim}
    else:
        out = {"attention": 2 * config.num_key_value_heads * config.head_dim_resolved}
    if run.runs_indexer:
        out["indexer"] = config.index_head_dim
    return out


def _trains_gather(config: GLMConfig, name: str) -> bool:
    """Whether the rows of gather `name` take a gradient (a frozen indexer's do not)."""
    return name == "attention" or config.indexer_training == "kl"


def key_side_bytes_per_key(config: GLMConfig, a: int, *, kl: bool, gathered: bool) -> int:
    """Bytes a layer saves for backward per key position (`a`: compute itemsize); `gathered`:
    under context parallelism (the key side is then the gathered sequence's). GQA: SDPA's
    head-repeated K and V. MLA "latent": the latent key [L + R]. Dense MLA, "per_head",
    "masked": kv_b_proj's input (the normed latent [L]; gathered, a view of the [L + R] rows),
    SDPA's keys [N, P + R] and the kv_b output [N, P + V] the values are a view of. A
    KL-trained indexer (`kl`): its float32 keys [C]."""
    if config.attention != "mla":
        total = 2 * config.num_attention_heads * config.head_dim_resolved * a
    else:
        N, P, R = config.num_attention_heads, config.qk_nope_head_dim, config.qk_rope_head_dim
        L, V = config.kv_lora_rank, config.v_head_dim
        if config.uses_dsa and config.dsa_impl == "latent":
            total = (L + R) * a
        else:
            total = ((L + R) if gathered else L) * a + N * (P + R) * a + N * (P + V) * a
    return total + (config.index_head_dim * 4 if kl else 0)


def keeps_causal_mask(config: GLMConfig, seq_len: int) -> bool:
    """Whether a layer's SDPA reads a causal [T, S] mask under context parallelism where
    one rank runs it maskless (is_causal): GQA, dense MLA, and DSA's masked reference when
    every causal key is kept (S <= index_topk)."""
    if config.attention != "mla":
        return True
    if not config.uses_dsa:
        return True
    return config.dsa_impl == "masked" and seq_len <= config.index_topk


def layer_share(
    config: GLMConfig, run: LayerRun, a: int, ep: int, batch: int, seq_len: int, cp: int = 1
) -> LayerShare:
    """Layer `run`'s bytes on one rank of `cp` for `batch` sequences of `seq_len` tokens."""
    own_kl = kl_layer(config, run.layer)
    kl = own_kl and run.runs_indexer
    T = seq_len // cp
    reused = batch * T * indexer_kl_bytes_per_token(config, a, seq_len) if own_kl and not kl else 0
    if cp == 1:
        local = layer_activation_bytes(config, run.layer, run.is_moe, a, ep, batch, seq_len)
        return LayerShare(local - reused)
    local = layer_activation_bytes(config, run.layer, run.is_moe, a, ep, batch, T, keys=seq_len)
    local -= reused + batch * T * key_side_bytes_per_key(config, a, kl=kl, gathered=False)
    if keeps_causal_mask(config, seq_len):
        local += T * seq_len * a
    keys = batch * seq_len * key_side_bytes_per_key(config, a, kl=kl, gathered=True)
    gathers = gathered_widths(config, run)
    trained = sum(f for name, f in gathers.items() if _trains_gather(config, name))
    return LayerShare(local, keys, keys + batch * seq_len * trained * a, gathers)


def collectives(
    config: GLMConfig,
    shares: list[LayerShare],
    a: int,
    batch: int,
    seq_len: int,
    cp: int,
    *,
    gathers_per_step: int,
) -> dict:
    """Per gather kind (attention, indexer): its values per token, the layers that run it,
    the bytes of one all-gather's output on a rank (S rows), what the rank sends into it (a
    ring: cp - 1 of its T-row shares) and whether backward reduce-scatters its gradient (as
    many bytes each way); then the rank's totals sent per step (`gathers_per_step`
    all-gathers of each layer: 2 when the layer recomputes or gathers again in backward)."""
    T = seq_len // cp
    kinds: dict[str, dict] = {}
    for share in shares:
        for name, width in share.gathers.items():
            kind = kinds.setdefault(name, {"values_per_token": width, "layers": 0})
            kind["layers"] += 1
            kind["all_gather_output_bytes"] = batch * seq_len * width * a
            kind["sent_bytes"] = batch * (cp - 1) * T * width * a
            kind["reduce_scatter"] = _trains_gather(config, name)
    sent = sum(k["layers"] * k["sent_bytes"] for k in kinds.values())
    back = sum(k["layers"] * k["sent_bytes"] for k in kinds.values() if k["reduce_scatter"])
    return {
        "kinds": kinds,
        "gathers_per_step": gathers_per_step,
        "step_all_gather_sent_bytes": gathers_per_step * sent,
        "step_reduce_scatter_sent_bytes": back,
    }


def _scored(first: int, count: int, K: int) -> int:
    """Keys the queries at positions first .. first + count - 1 score: max(p + 1, K) each."""
    lo, hi = first + 1, first + count  # p + 1 over the run
    total = (lo + hi) * count // 2
    top = min(hi, K - 1)  # rows scoring the floor K instead of p + 1
    if top >= lo:
        total += (2 * K - lo - top) * (top - lo + 1) // 2
    return total


def indexer_flops(
    config: GLMConfig,
    seq_len: int,
    cp: int,
    layout: str = TRAIN_LAYOUT,
    *,
    batch: int = 1,
    indexers: int = 1,
) -> list[int]:
    """The DSA indexer's scoring FLOPs of each of the `cp` ranks for `batch` sequences of
    `seq_len` over `indexers` indexer runs: a query at global position p scores max(p + 1, K)
    keys (K = min(index_topk, S): a chunk scores at least K candidates), each pair
    2 M C FLOPs for the M heads' C-wide products and 2 M for their weighted sum."""
    K = min(config.index_topk, seq_len)
    per_pair = 2 * config.index_n_heads * (config.index_head_dim + 1)
    return [
        batch
        * indexers
        * per_pair
        * sum(_scored(f, n, K) for f, n in layout_runs(layout, cp, r, seq_len))
        for r in range(cp)
    ]


def indexer_balance(
    config: GLMConfig, seq_len: int, cp: int, *, batch: int = 1, indexers: int = 1
) -> dict:
    """Per layout: the busiest and mean rank's indexer scoring FLOPs and busiest / mean."""
    out = {}
    for layout in ("head_tail", "contiguous"):
        flops = indexer_flops(config, seq_len, cp, layout, batch=batch, indexers=indexers)
        mean = sum(flops) / cp
        out[layout] = {"busiest": max(flops), "mean": mean, "busiest_over_mean": max(flops) / mean}
    return out


def cp_choices(world_size: int, seq_len: int) -> list[int]:
    """The cp degrees a world of `world_size` and sequences of `seq_len` allow, ascending:
    1, and every divisor c > 1 of the world with 2 c dividing the sequence."""
    return [1] + [
        c for c in range(2, world_size + 1) if world_size % c == 0 and seq_len % (2 * c) == 0
    ]


def cp_error(world_size: int, seq_len: int, cp: int) -> str | None:
    """Why `cp` cannot cut this world and these sequences (None when it can)."""
    if cp < 1 or world_size % cp:
        return f"{cp} must be a positive divisor of the world of {world_size} ranks"
    if cp > 1 and seq_len % (2 * cp):
        return (
            f"{cp}: 2 x cp = {2 * cp} must divide the sequence of {seq_len} tokens (each cp "
            "rank holds two equal chunks of it, head-tail)"
        )
    return None
