"""Which tokens of a sequence a forward computes: `LocalTokens`.

A forward normally computes every token of its sequence. Given `LocalTokens` it computes only
the tokens at the global positions its `runs` list (in that order), as part of the full sequence
of `seq_len` tokens: the caller passes the full sequence's ids, labels and packing fields (a few
integers per token), the model embeds and runs only its own tokens, and each attention reads
the keys of the whole sequence through its `gather_keys` hook (installed from outside, by the
context-parallel installer: `models.glm.infra.context_parallel`). Masks compare global
positions: key s is causal for local query t when s <= positions_T[t]. The loss terms are then
this part's contribution to the full sequence's means (its sum over the full sequence's token
count), so the parts' terms add up to the one-forward result.

Shape legend: B batch, T local tokens, S the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True, eq=False)
class LocalTokens:
    """Runs of consecutive global positions (first, count), in local order, out of a sequence
    of `seq_len` tokens; `positions_T` their positions as a device tensor (set by `on`)."""

    runs: tuple[tuple[int, int], ...]
    seq_len: int
    positions_T: torch.Tensor | None = None

    def __post_init__(self) -> None:
        ends = [first + count for first, count in self.runs]
        firsts = [first for first, _ in self.runs]
        ordered = all(e <= f for e, f in zip(ends, firsts[1:], strict=False))
        if not self.runs or not ordered or firsts[0] < 0 or ends[-1] > self.seq_len:
            raise ValueError(
                f"LocalTokens runs {self.runs}: need increasing, non-overlapping "
                f"(first, count) runs inside [0, {self.seq_len})"
            )

    @property
    def count(self) -> int:
        """T, the number of local tokens."""
        return sum(count for _, count in self.runs)

    def on(self, device: torch.device) -> LocalTokens:
        """These tokens with their positions on `device` (one small tensor per forward)."""
        pos_T = torch.cat([torch.arange(f, f + n, device=device) for f, n in self.runs])
        return replace(self, positions_T=pos_T)

    def key_end(self, t1: int) -> int:
        """One past the global position of local token t1 - 1: the keys local queries up to
        t1 can attend (the runs increase, so it bounds every earlier query's keys too)."""
        seen = 0
        for first, count in self.runs:
            if t1 <= seen + count:
                return first + t1 - seen
            seen += count
        raise IndexError(f"local token {t1 - 1} is not one of {self.count}")

    def take(self, x_BS: torch.Tensor | None) -> torch.Tensor | None:
        """The local tokens' entries of a full-sequence tensor [B, S, ...] (None stays None)."""
        if x_BS is None:
            return None
        if x_BS.shape[1] != self.seq_len:
            raise ValueError(
                f"a full-sequence tensor of {self.seq_len} tokens needed, got shape "
                f"{tuple(x_BS.shape)}"
            )
        return x_BS.index_select(1, self.positions_T)


def causal_mask(
    doc_start_BT: torch.Tensor | None, tokens: LocalTokens | None, T: int, device
) -> torch.Tensor | None:
    """bool [B or 1, 1, T, S]: query t attends key s when s is at or below it (global
    positions under `tokens`) and, with packed documents, in its own document
    (`doc_start_BT`, its document's first position); None when plain causal attention over
    the T tokens alone is meant (no packing, no `tokens`)."""
    if doc_start_BT is None and tokens is None:
        return None
    if tokens is None:
        q_T, S = torch.arange(T, device=device), T
    else:
        q_T, S = tokens.positions_T, tokens.seq_len
    keys_S = torch.arange(S, device=device)
    mask_TS = keys_S[None, :] <= q_T[:, None]
    if doc_start_BT is None:
        return mask_TS[None, None]
    return (mask_TS[None] & (keys_S[None, None, :] >= doc_start_BT[:, :, None]))[:, None]


def query_positions(tokens: LocalTokens | None, T: int, device) -> torch.Tensor:
    """The global position of each of the T local queries ([T]: 0..T-1 without `tokens`)."""
    return torch.arange(T, device=device) if tokens is None else tokens.positions_T


def gathered(attn, x_BTF: torch.Tensor, tokens: LocalTokens | None) -> torch.Tensor:
    """The full sequence's rows of a per-token key-side tensor: `x_BTF` itself when this
    forward computes the whole sequence, else `attn.gather_keys(x_BTF, seq_len)` (installed
    by the context-parallel installer)."""
    if tokens is None or tokens.seq_len == x_BTF.shape[1]:
        return x_BTF
    gather = getattr(attn, "gather_keys", None)
    if gather is None:
        raise RuntimeError(
            f"{type(attn).__name__}: a forward of {x_BTF.shape[1]} of {tokens.seq_len} tokens "
            "needs the other tokens' keys: install context parallelism "
            "(models.glm.infra.context_parallel) first"
        )
    return gather(x_BTF, tokens.seq_len)
