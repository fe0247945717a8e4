"""The facts of packed rows that the plan and several routes read: each token's document index, from restarting
`position_ids` (transformers' `DataCollatorWithFlattening`, TRL's padding-free batches) or flash-attention style
`cu_seq_lens`, and each row's document lengths. Below every route: `attention_plan.plan_facts` derives them,
`choose_path` reads the lengths (`"auto"` asks per document), `attention_packed` splits a row by them.
"""

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
