"""QK-clip's recording (Kimi K2's MuonClip): watch each head's largest attention logit.

An attention with `record_max_logits` on keeps, per query head, the largest pre-softmax logit
q.k / sqrt(K) (after RoPE, QK-norm and the causal mask) over everything its training forwards
saw since the last `take_local_max_logits`: every micro-batch of a step, but not the
activation-checkpoint recomputation (`models.glm.model.execution.recomputing`), and not
forwards without grad (evaluation). GQA, dense MLA and DSA's masked reference pay one more
(causal) Q K^T per layer for it, without grad, in query chunks (`recording_flops`); DSA's
sparse attention hands over the maxima it computes as it goes (`record_max`), at no extra
cost.
The clip itself, which rescales W_q / W_k from these maxima, is `models.glm.infra.qk_clip`.
"""

from __future__ import annotations

import torch

from models.glm.model.execution import eager, is_recomputing, work_dtype

#: query rows per chunk of the recording's Q K^T: bounds its temporary to B * N * chunk * T
#: float32 logits (with B * N = 64 and T = 4096: 128 MiB); a chunk reads only the keys up to its
#: last query, so the recording computes about half of the T x T logits
QUERY_CHUNK = 128


@torch.no_grad()
def head_max_logits(
    q_BNTK: torch.Tensor,
    k_BNSK: torch.Tensor,
    scale: float,
    keep_B1TS: torch.Tensor | None = None,
    tokens=None,
) -> torch.Tensor:
    """The largest pre-softmax logit of each head, `[N]` float32, over the keys each query may
    attend: `keep_B1TS` (True = attended: DSA's sparse mask, packed documents, or the causal
    mask of `tokens`, the queries' global positions among the S keys
    (`models.glm.model.sequence.LocalTokens`)) or, when None, the causal ones."""
    if not scale > 0:
        raise ValueError(f"head_max_logits: scale={scale!r} must be > 0 (a softmax scale)")
    if tokens is not None and keep_B1TS is None:
        raise ValueError("head_max_logits: queries of a longer sequence need their keep mask")
    T = q_BNTK.size(2)
    work = work_dtype(q_BNTK.dtype)  # float64 models record in float64
    k = k_BNSK.to(work)
    best = torch.full((q_BNTK.size(1),), -torch.inf, device=q_BNTK.device, dtype=work)
    keys = torch.arange(T, device=q_BNTK.device)
    for start in range(0, T, QUERY_CHUNK):
        q = q_BNTK[:, :, start : start + QUERY_CHUNK].to(work)
        stop = start + q.size(2)
        # keys past the chunk's last query are masked either way
        end = stop if tokens is None else tokens.key_end(stop)
        s_BNQS = torch.matmul(q, k[:, :, :end].transpose(-1, -2))
        if keep_B1TS is None:
            masked = keys[None, :end] > keys[start:stop, None]  # the future
        else:
            masked = ~keep_B1TS[:, :, start:stop, :end]
        s_BNQS.masked_fill_(masked, -torch.inf)
        best = torch.maximum(best, s_BNQS.amax(dim=(0, 2, 3)))
    # The scale after the maximum, on N values instead of every logit: rounding is monotone,
    # so for a scale > 0 max(fl(s * scale)) == fl(max(s) * scale) bit for bit (infinities and
    # NaN included).
    return best * scale


class MaxLogitRecorder:
    """Mixin of the attention modules: `record(q, k, scale, keep)` keeps the per-head maximum of
    training forwards in `max_logits_N` while `record_max_logits` is on."""

    record_max_logits = False
    max_logits_N: torch.Tensor | None = None  # per instance once set; never a checkpointed buffer

    @eager
    def record(self, q_BNTK, k_BNSK, scale: float, keep_B1TS=None, tokens=None) -> None:
        """Eager, as the router's load counts: the recomputation flag must not be traced."""
        if self._recording():
            q, k = q_BNTK.detach(), k_BNSK.detach()
            self.record_max(head_max_logits(q, k, scale, keep_B1TS, tokens))

    @eager
    def record_max(self, best_N: torch.Tensor) -> None:
        """Keep `best_N`, each head's largest logit of this forward, when recording (DSA's
        sparse attention computes it as it goes)."""
        if self._recording():
            prev = self.max_logits_N
            best = best_N.detach()
            self.max_logits_N = best if prev is None else torch.maximum(prev, best)

    def _recording(self) -> bool:
        return self.record_max_logits and torch.is_grad_enabled() and not is_recomputing()


def recording_flops(seq_len: int, heads: int, qk_dim: int, tokens=None) -> int:
    """FLOPs of one sequence's recording in one layer (the chunked causal Q K^T: each chunk of
    queries against the keys up to its last query's). `tokens`: the queries are these tokens
    of the sequence (`models.glm.model.sequence.LocalTokens`), as in `head_max_logits`."""
    T = seq_len if tokens is None else tokens.count
    keys = 0
    for start in range(0, T, QUERY_CHUNK):
        stop = min(start + QUERY_CHUNK, T)
        keys += (stop - start) * (stop if tokens is None else tokens.key_end(stop))
    return 2 * heads * qk_dim * keys
