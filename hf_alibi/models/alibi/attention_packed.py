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
packed row (from restarting positions or `cu_seq_lens`), which every path's masks read, is `packed_documents.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .packed_documents import document_lengths


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
                plans[length] = preparation.plan_row(preparation.implementation, length, length)
            parts.append((row, start, start + length, plans[length]))
            start += length
    return PackedDocuments(tuple(parts))


def packed_alibi_attention(query, key, value, plan, scaling, layer=None, *, attend):
    """Each document of each packed row through its own plan; the rows' outputs concatenated, (B, q, H, D).

    A composite route: `attend(query, key, value, plan, scaling, layer)` (the dispatcher's, passed down by it) runs
    each document on the route its own plan chose."""
    rows = [[] for _ in range(query.shape[0])]
    for row, start, end, part in plan.payload.parts:
        tokens, batch = slice(start, end), slice(row, row + 1)
        out, _ = attend(
            query[batch, :, tokens], key[batch, :, tokens], value[batch, :, tokens], part, scaling, layer
        )  # (1, l, H, D)
        rows[row].append(out)
    return torch.cat([torch.cat(outputs, dim=1) for outputs in rows], dim=0), None  # (B, q, H, D)
