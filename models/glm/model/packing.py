"""Packed documents: several documents in one sequence, each computing what it would alone.

The batch carries per-token `position_ids` (restarting at 0 at each document's first token:
RoPE's positions) and `doc_ids` (equal within a document, non-decreasing along the row), as
Megatron-LM's reset position ids and THD layouts, or transformers' packed `position_ids`, do.
The model turns them into each token's document's first and last positions (`document_bounds`);
attention masks with `models.glm.model.sequence.causal_mask` (dense paths) or keeps only
same-document keys in the DSA indexer's top-k (`models.glm.model.indexer.select_topk`, -1 where
a document has fewer keys than index_topk), and the MTP depths read their k-ahead tokens inside
the document (`ahead_in_document`).

Shape legend: B batch, T sequence, S keys.
"""

from __future__ import annotations

import torch

from models.glm.model.loss_head import IGNORE_INDEX


def document_bounds(input_ids, position_ids, doc_ids):
    """Each token's document's (first, last) position, [B, T] each, from packed documents'
    `doc_ids` (None, None without packing); refuses a half-given or misshapen pair."""
    if position_ids is None and doc_ids is None:
        return None, None
    if position_ids is None or doc_ids is None:
        raise ValueError("packed documents need both position_ids and doc_ids (or neither)")
    for name, t in (("position_ids", position_ids), ("doc_ids", doc_ids)):
        if t.shape != input_ids.shape or t.dtype.is_floating_point:
            raise ValueError(
                f"{name}: integer [B, T] as input_ids {tuple(input_ids.shape)} needed, got "
                f"{t.dtype} {tuple(t.shape)}"
            )
    B, T = doc_ids.shape
    t_BT = torch.arange(T, device=doc_ids.device).expand(B, T)
    change_BT = doc_ids[:, 1:] != doc_ids[:, :-1]  # a document starts at t + 1
    edge_B1 = torch.ones(B, 1, dtype=torch.bool, device=doc_ids.device)
    first_BT = torch.cat([edge_B1, change_BT], 1)
    last_BT = torch.cat([change_BT, edge_B1], 1)
    start_BT = torch.where(first_BT, t_BT, 0).cummax(1).values
    end_BT = torch.where(last_BT, t_BT, T).flip(1).cummin(1).values.flip(1)
    return start_BT, end_BT


def ahead_in_document(input_ids, labels, k, start_BT, end_BT):
    """(the token k positions ahead in each token's own document, wrapping around inside it
    as `roll` does for one document alone; the label there, -100 where the document has no
    token k ahead): MTP depth k's inputs and targets for packed documents."""
    t_BT = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(start_BT)
    length_BT = end_BT - start_BT + 1
    offset_BT = t_BT - start_BT + k
    ahead_BT = start_BT + offset_BT % length_BT
    target = labels.gather(1, ahead_BT).masked_fill_(offset_BT >= length_BT, IGNORE_INDEX)
    return input_ids.gather(1, ahead_BT), target
