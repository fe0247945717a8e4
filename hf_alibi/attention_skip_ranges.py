"""Certified key ranges for one layer's attention call (`alibi_skip_eps`), from the bounds of `attention_skip.py`.

A plan built with `skip_eps > 0` (inference only: `plan_alibi_attention` decides) has every layer turn its own
queries and keys into `KeyRanges` before attending, with `certified_plan`:
- prefill (the split, FlexAttention): per head and block of `ROWS` query rows, the first key whose predecessors'
  softmax mass is certified <= eps (`certified_key_starts`);
- decoding (one query row over a dynamic cache): per head, from the current query's norm, the exact log-sum-exp of
  its `DECODE_NEAR` nearest keys and the running maximum of key norms per block of cache positions (`RunningKeyNorms`),
  so a step costs the kept keys, not a pass over the whole cache.
Every output moves by at most 2 * eps * max|v| (Theorem 1 there).
"""

from dataclasses import replace

import torch

from .attention_plan import AlibiAttentionPlan, KeyRanges, _flex_block_mask
from .attention_skip import certified_decode_start, certified_key_starts, key_block_norms, near_key_lse

ROWS = 256  # query rows per block: the split's finest chunk, where the CPU kernel runs its 64-row tiles
# Keys per block of the bound. Finer blocks certify more of the steep heads (results/skip/kept_fraction.md: at 8k on
# the demo checkpoint 0.356 of causal work kept with 64-key blocks against 0.381 with 256) for 4x the bound's work.
KEY_BLOCK = 64
# Nearest keys whose exact log-sum-exp bounds each row's from below (Theorem 2). Prefill: the diagonal alone. On the
# demo checkpoint at 8k, 32 near keys certify 0.352 of causal work against 0.381, but their float64 products cost
# more than the kernel work they save (forward 0.93x / 0.87x / 0.74x of GPT-2 SDPA with 32 / 16 / 1). Decoding too:
# a step's few dozen small operations are what the certificate costs there.
NEAR = 1
DECODE_NEAR = 1
# Rows bounded together (sorted by query norm): 16x less work than row by row.
ROW_GROUP = 16


def certified_plan(plan: AlibiAttentionPlan, query, key, scaling: float, layer: int | None) -> AlibiAttentionPlan:
    """`plan` with this layer's certified key ranges for `query` (B, H, q, D) over `key` (B, H, kv, D)."""
    key = key[:, :, : plan.key_length]  # a static cache's buffer: its filled part
    if plan.query_length == 1:  # decoding: one row at position query_offset
        norms = plan.key_norms(layer, key, plan.key_padding) if plan.key_norms is not None else None
        return replace(plan, key_ranges=decode_key_ranges(query, key, plan, scaling, norms))
    starts = certified_key_starts(
        query, key, plan.slopes, scaling, plan.query_offset, plan.skip_eps, ROWS, KEY_BLOCK, plan.key_padding,
        near=NEAR, centroid=False, row_group=ROW_GROUP,  # the centred bound buys ~0.001 of kept work (trained)
    )  # (H, blocks)  # fmt: skip
    ranged = replace(plan, key_ranges=KeyRanges(ROWS, starts), split=None)  # the split plans this layer's calls
    if plan.block_mask is not None:
        ranged = replace(ranged, block_mask=_flex_block_mask(ranged, plan.slopes.device))  # per-head blocks
    return ranged


def decode_key_ranges(query, key, plan: AlibiAttentionPlan, scaling: float, norms=None) -> KeyRanges:
    """One decoding row's first key per head, (H, 1): the minimum over the batch of each row's certified start."""
    position = plan.query_offset
    if norms is None:
        norms = key_block_norms(key, KEY_BLOCK, plan.key_padding).amax(0, keepdim=True)  # (1, H, blocks)
    lse = near_key_lse(query, key, plan.slopes, scaling, position, DECODE_NEAR, plan.key_padding)  # (B, H, 1)
    if plan.key_padding is not None:  # a padded row (its own token is padding) has no certificate: keep it dense
        lse = lse.masked_fill(~plan.key_padding[:, None, position : position + 1], -torch.inf)
    starts = certified_decode_start(query, norms, plan.slopes, scaling, position, plan.skip_eps, KEY_BLOCK, lse)
    return KeyRanges(1, starts.amin(0)[:, None])  # (H, 1)


class RunningKeyNorms:
    """Per layer, the largest key norm per block of `KEY_BLOCK` cache positions, over the whole batch, kept up to date
    as a dynamic cache grows: each step folds in only its new keys.

    The maximum over the batch stays an upper bound for every row whatever transformers does to the batch (beam
    search reorders it, assisted decoding crops it). A cache that shrank, or whose last seen key changed (cropped and
    refilled, reordered), is summarised again from scratch: a running maximum may only ever see keys appended.
    """

    def __init__(self):
        self.layers = {}  # layer -> (norms (1, H, blocks) float64, keys covered, the last covered key (B, H, D))

    def __call__(self, layer, key: torch.Tensor, key_padding: torch.Tensor | None) -> torch.Tensor:
        length = key.shape[2]
        norms, covered, last = self.layers.get(layer, (None, 0, None))
        stale = norms is None or covered > length or not torch.equal(key[:, :, covered - 1], last)
        if stale:
            norms, covered = key.new_full((1, key.shape[1], 0), -torch.inf, dtype=torch.float64), 0
        blocks = -(-length // KEY_BLOCK)
        grown = norms.new_full((1, key.shape[1], blocks), -torch.inf)  # (1, H, blocks)
        grown[..., : norms.shape[-1]] = norms
        new = key[:, :, covered:].double().norm(dim=-1)  # (B, H, n)
        if key_padding is not None:
            new = new.masked_fill(~key_padding[:, None, covered:length], -torch.inf)
        index = (torch.arange(covered, length, device=key.device) // KEY_BLOCK).expand(1, key.shape[1], -1)
        grown.scatter_reduce_(2, index, new.amax(0, keepdim=True), "amax")  # (1, H, blocks)
        self.layers[layer] = (grown, length, key[:, :, length - 1].clone())
        return grown
