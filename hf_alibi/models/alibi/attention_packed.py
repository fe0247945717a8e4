"""`sdpa_packed`: packed rows (transformers' `DataCollatorWithFlattening`, TRL's padding-free batches: `position_ids`
that restart, or `cu_seq_lens_q`) attended one document at a time on the CPU split (`choose_path`), so a row of
documents costs the sum of their squared lengths, not its own squared length under a document mask.

ALiBi depends on `i - j` alone, and a packed row's document mask lets each token see only its own document's earlier
tokens, so a document of a packed row attends exactly as that document would alone in a row of its own: same
queries, same keys, same distances. Each document therefore gets the plan of an uncached batch-1 row of its length
(`plan_alibi_attention`: the split, with certified skipping where the rule says it pays for that length), and the
certificate that covers an unpacked row covers the document (its bound moves each output by at most
2 * eps * max|v| over the document's own keys, which are all the keys it attends). Documents are contiguous, so the
row's output is the concatenation of theirs; autograd flows through each document's call. The document index of a
packed row (from restarting positions or `cu_seq_lens`), which every path's masks read, is found here too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .transformers_compat import find_packed_sequence_indices


def packed_documents(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """Document index of each token of rows whose `position_ids` restart (packed rows), as (B, L) int64, or None.

    transformers' own rule (`masking_utils.find_packed_sequence_indices`, which every model of theirs uses): a new
    document starts wherever a position is not its predecessor + 1. Plain positions (0, 1, 2, ...) give None in eager
    mode; a traced graph keeps the (all-zero) indices rather than branch on data.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (batch, length) or (length,), got shape {tuple(position_ids.shape)}")
    return find_packed_sequence_indices(position_ids.expand(batch, -1))  # positions may be given for one row only


def documents_from_cu_seq_lens(cu_seq_lens: torch.Tensor, length: int, tracing: bool = False) -> torch.Tensor:
    """Document index (1, L) of a flattened row from flash-attention's cumulative lengths `[0, l1, l1 + l2, ...]`."""
    if cu_seq_lens.dim() != 1 or (not tracing and int(cu_seq_lens[-1]) != length):
        raise ValueError(
            f"cu_seq_lens must be 1-D cumulative lengths ending at the row length {length}, got {cu_seq_lens.tolist()}"
        )
    positions = torch.arange(length, device=cu_seq_lens.device)  # (L,)
    return torch.searchsorted(cu_seq_lens[1:].to(positions.dtype), positions, right=True)[None]  # (1, L)


def document_lengths(documents: torch.Tensor) -> list[list[int]]:
    """Each packed row's document lengths, in order, from its (B, L) document index (one host read)."""
    return [torch.unique_consecutive(row, return_counts=True)[1].tolist() for row in documents]


@dataclass(frozen=True, eq=False)
class PackedDocuments:
    """Each packed row's documents in order: (row, first token, end token, the document's own batch-1 plan)."""

    parts: tuple[tuple[int, int, int, object], ...]  # the plan: an AlibiAttentionPlan

    def for_heads(self, heads: slice, plan) -> PackedDocuments:
        return replace(self, parts=tuple((b, s, e, p.for_heads(heads)) for b, s, e, p in self.parts))


def prepare_sdpa_packed(plan, preparation) -> PackedDocuments:
    plans, parts = {}, []  # documents of one length share a plan
    for row, lengths in enumerate(document_lengths(plan.documents)):
        start = 0
        for length in lengths:
            if length not in plans:
                plans[length] = preparation.plan_part(length)
            parts.append((row, start, start + length, plans[length]))
            start += length
    return PackedDocuments(tuple(parts))


def packed_alibi_attention(query, key, value, plan, scaling, layer=None):
    """Each document of each packed row through its own plan; the rows' outputs concatenated, (B, q, H, D)."""
    from .attention_alibi import alibi_attention  # the table's entry point (it imports this module)

    rows = [[] for _ in range(query.shape[0])]
    for row, start, end, part in plan.payload.parts:
        tokens, batch = slice(start, end), slice(row, row + 1)
        out, _ = alibi_attention(
            query[batch, :, tokens], key[batch, :, tokens], value[batch, :, tokens], part, scaling, layer=layer
        )  # (1, l, H, D)
        rows[row].append(out)
    return torch.cat([torch.cat(outputs, dim=1) for outputs in rows], dim=0), None  # (B, q, H, D)
