"""Public SDPA with a bias bank: `sdpa_bank` (per query chunk, each chunk's mask a view of one (B|1, H, chunk, kv)
bank: decoding rows, dropout, GPUs, traced graphs, `alibi_sdpa_split=False`), and the decoding rows that read only
some keys per run of heads (`decode_in_ranges`: certified decoding's, `attention_certified.py`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .alibi_bias import alibi_bidirectional_bias, alibi_causal_bias
from .attention_eager import FullBias
from .attention_plan import AlibiAttentionPlan, mask_in_dtype, visible_keys
from .attention_sdpa_split_calls import head_runs
from .cpu_flash_kernels import _flash


@dataclass(frozen=True, eq=False)
class BiasBank(FullBias):
    """`sdpa_bank` and the decoding rows: the bias (B|1, H, chunk, kv) of the last `chunk` queries against all keys,
    which every chunk's mask slices; `folded`: a single chunk, whose bank already hides padding and documents."""

    folded: bool = False


def bias_bank(plan: AlibiAttentionPlan, query_chunk: int) -> tuple[torch.Tensor, bool]:
    """The bias of the last `chunk` queries against all keys (chunks' masks slice it), and whether masks are in it.

    A single chunk (decoding, short inputs) gets padding and documents folded in once, here. Bidirectional plans'
    chunks see keys on both sides: their bank is (1, H, chunk, 2 kv - 1), -m * |a + kv - 1 - c|, which every chunk
    slices at its own start (`_chunk_mask`).
    """
    chunk, kv = min(plan.query_length, query_chunk), plan.key_length
    if not plan.causal and chunk < plan.query_length:
        return alibi_bidirectional_bias(plan.slopes, chunk, 2 * kv - 1, kv - 1)[None], False  # (1, H, chunk, 2kv-1)
    alibi_bias = alibi_causal_bias if plan.causal else alibi_bidirectional_bias
    bank = alibi_bias(plan.slopes, chunk, kv)[None]  # (1, H, chunk, kv) fp32
    if chunk < plan.query_length:
        return bank, False
    keep = visible_keys(plan)
    return (bank if keep is None else bank.masked_fill(~keep, torch.finfo(torch.float32).min)), True


def prepare_sdpa_bank(plan, preparation) -> BiasBank:
    bank, folded = bias_bank(plan, preparation.query_chunk)  # (B|1, H, chunk, kv)
    return BiasBank(bank, mask_in_dtype(bank, preparation.dtype), folded)


def sdpa_bank_attention(query, key, value, plan, scaling, layer=None):
    """Public SDPA per query chunk; each chunk's mask is a view of the plan's bias bank.

    Rows [s, e) sit at absolute positions query_offset + s .. query_offset + e - 1 and see keys
    [0, query_offset + e). With E = query_offset + e and n = e - s, the bank row a' = a + chunk - n and column
    c = j + kv - E hold exactly -m * ((query_offset + s + a) - j), so the chunk's mask is
    bank[:, :, chunk - n:, kv - E:] (bidirectional: `_chunk_mask`).
    """
    bank = plan.payload.in_dtype(query.dtype)  # (B|1, H, chunk, kv | 2 kv - 1)
    chunk, q_len = bank.shape[2], plan.query_length
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        mask, visible = _chunk_mask(bank, plan, start, end)  # (B|1, H, n, visible), a view
        if not plan.payload.folded:
            keep = visible_keys(plan, slice(start, end), slice(0, visible))  # (B|1, 1|H, n|1, visible) or None
            if keep is not None:
                mask = mask.masked_fill(~keep, torch.finfo(mask.dtype).min)  # (B|1, H, n, visible)
        out = F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, :visible],
            value[:, :, :visible],
            attn_mask=mask,
            dropout_p=plan.dropout,
            scale=scaling,
        )  # (B, H, n, D)
        outputs.append(out)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # (B, H, q, D)
    return output.transpose(1, 2), None  # (B, q, H, D)


def _chunk_mask(bank: torch.Tensor, plan: AlibiAttentionPlan, start: int, end: int) -> tuple[torch.Tensor, int]:
    """Rows [start, end)'s view of the bank and the keys they see: causal, keys [0, query_offset + end); bidirectional,
    every key, column c = kv - 1 - start + j of the (2 kv - 1)-wide bank holding -m * |start + a - j|."""
    chunk, kv, n = bank.shape[2], plan.key_length, end - start
    if plan.causal:
        visible = plan.query_offset + end
        return bank[:, :, chunk - n :, kv - visible :], visible  # (B|1, H, n, visible)
    if plan.payload.folded:  # one chunk: the bank is the rows' whole (B|1, H, q, kv) bias
        return bank, kv
    return bank[:, :, :n, kv - 1 - start : 2 * kv - 1 - start], kv  # (1, H, n, kv)


def decode_in_ranges(query, key, value, plan, bank, ranges, scaling, segmented: bool = False):
    """(B, 1, H, D): each run of heads sharing a first key (`ranges`, (H, 1)) attends keys [first, kv) with the
    `bank`'s per-key bias, so skipped keys are not read at all: one public call per run, or (`segmented`: CPU, batch
    1) the run's keys in `DECODE_SEGMENT`-key segments that go to the CPU flash kernel as one batch (a call over one
    query row cannot spread over threads otherwise), merged exactly by their log-sum-exps."""
    attend_row = _segmented_row if segmented else _public_row
    bias = bank.in_dtype(query.dtype)  # (B|1, H, 1, kv)
    outputs = []
    for head, end, first in head_runs(ranges.first_key[:, 0].tolist()):
        heads = slice(head, end)
        outputs.append(
            attend_row(query[:, heads], key[:, heads], value[:, heads], bias[:, heads], first, plan.dropout, scaling)
        )  # (B, h, 1, D)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (B, H, 1, D)
    return output.transpose(1, 2)  # (B, 1, H, D)


def _public_row(query, key, value, bias, first, dropout, scaling):
    """(B, h, 1, D) over keys [first, kv): one public SDPA call."""
    return F.scaled_dot_product_attention(
        query, key[:, :, first:], value[:, :, first:], attn_mask=bias[..., first:], dropout_p=dropout, scale=scaling
    )


DECODE_SEGMENT = 2048  # keys per segment of a decoding row's long key range


def _segmented_row(query, key, value, bias, first, dropout, scaling):
    """Batch 1, one row (1, h, 1, D) over keys [first, kv): whole segments as one kernel batch, the rest after.

    A range shorter than two segments is one segment, and its one call is the answer.
    """
    kv = key.shape[2]
    count = (kv - first) // DECODE_SEGMENT if kv - first >= 2 * DECODE_SEGMENT else 0
    split = first + count * DECODE_SEGMENT
    parts = []
    if count:

        def segments(tensor):  # keys [first, split) of (1, h, kv, D) as (count, h, S, D), a view
            return tensor[0, :, first:split].unflatten(1, (count, DECODE_SEGMENT)).transpose(0, 1)

        mask = bias[0, :, :, first:split].unflatten(2, (count, DECODE_SEGMENT)).permute(2, 0, 1, 3)  # (count, h, 1, S)
        rows = query.expand(count, -1, -1, -1)  # (count, h, 1, D)
        parts.append(_flash(rows, segments(key), segments(value), mask, scaling))  # (count, h, 1, D), (count, h, 1)
    if split < kv:
        parts.append(_flash(query, key[:, :, split:], value[:, :, split:], bias[:, :, :, split:], scaling))
    if len(parts) == 1 and parts[0][0].shape[0] == 1:
        return parts[0][0].to(query.dtype)  # (1, h, 1, D)
    out, lse = (torch.cat(tensors) for tensors in zip(*parts))  # (segments, h, 1, D), (segments, h, 1)
    weights = torch.softmax(lse.float(), dim=0)[..., None]  # (segments, h, 1, 1): each segment's share of the mass
    return (weights * out.float()).sum(0, keepdim=True).to(query.dtype)  # (1, h, 1, D)
