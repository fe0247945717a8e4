"""FlexAttention: the analytic ALiBi `score_mod` (no bias tensor at all; `|i - j|` for a bidirectional plan) and a block mask (padding, documents; a
certified layer's key ranges per head) whose empty blocks are skipped. `FlexBlocks.compiled`: FlexAttention's fused
kernel, for a model that runs eagerly on a GPU.
"""

import functools
from dataclasses import dataclass

import torch

from .attention_plan import AlibiAttentionPlan
from .attention_skip import KeyRanges


def flex_block_mask(plan: AlibiAttentionPlan, ranges: KeyRanges | None = None):
    """Causal, padding- and document-aware (and key-range-aware: certified `ranges`, per head): blocks no query of a
    block can see are skipped.

    Padding is read from the mask as given where the plan has it (`AlibiAttentionPlan.attention_mask`): torch 2.13's
    CPU inductor cannot lower a mask_mod that reads the graph's own `.bool()` of it (packed rows' document indices
    lower: `tests/models/alibi/test_compile_export.py` compiles both).
    """
    from torch.nn.attention.flex_attention import create_block_mask

    query_offset, key_padding, documents = plan.query_offset, plan.key_padding, plan.documents
    causal = plan.causal
    given = plan.attention_mask
    if not causal and key_padding is None and documents is None and ranges is None:
        return None  # bidirectional and nothing masked: every block is read

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx + query_offset if causal else kv_idx >= 0
        if given is not None:
            keep = keep & (given[b, kv_idx] != 0)
        elif key_padding is not None:
            keep = keep & key_padding[b, kv_idx]
        if documents is not None:
            keep = keep & (documents[b, q_idx] == documents[b, kv_idx])
        if ranges is not None:
            keep = keep & (kv_idx >= ranges.first_key[h, q_idx // ranges.rows])
        return keep

    per_row = key_padding if key_padding is not None else documents
    batch = None if per_row is None else per_row.shape[0]
    heads = None if ranges is None else plan.slopes.shape[0]  # per-head masks only when heads differ
    return create_block_mask(mask_mod, batch, heads, plan.query_length, plan.key_length, device=plan.slopes.device)


@dataclass(frozen=True, eq=False)
class FlexBlocks:
    """`flex_attention`: the forward's block mask (padding, documents), the same for every head; `compiled`:
    FlexAttention's fused kernel (`Route.compiled`)."""

    block_mask: object
    compiled: bool = False

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "FlexBlocks":
        return self


def prepare_flex_attention(plan, preparation) -> FlexBlocks:
    return FlexBlocks(flex_block_mask(plan), preparation.compiled)


def flex_alibi_attention(query, key, value, plan, scaling, layer=None):
    """FlexAttention with the analytic ALiBi `score_mod`: no bias tensor at all, masked blocks skipped. On CPU this
    runs FlexAttention's unfused path unless the model is under `torch.compile`; `compiled` (the payload's): the
    fused kernel, for a model that runs eagerly on a GPU (what transformers' flex integration does), whose skipped
    blocks are never read."""
    return flex_over_blocks(query, key, value, plan, scaling, plan.payload.block_mask, plan.payload.compiled)


def flex_over_blocks(query, key, value, plan, scaling, block_mask, compiled: bool):
    """((B, q, H, D), None): FlexAttention with the ALiBi `score_mod` over `block_mask`; `compiled`: the fused kernel."""
    attend = _flex_attention(compiled)
    if query.device.type == "cpu" and query.requires_grad:
        raise ValueError(
            "attn_implementation='flex_attention' has no backward pass on CPU in this torch version: train with "
            "'sdpa' on CPU, or run inference under torch.no_grad()"
        )
    slopes, query_offset = plan.slopes.to(query.device), plan.query_offset
    if query.device.type == "cpu":  # torch 2.13's CPU flex template lowers only inputs laid out as (B, H, L, D)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()

    if plan.scaled_from is not None and torch.compiler.is_compiling():  # not a tensor the compiled graph computed
        unscaled, divisor = plan.scaled_from[0].to(query.device), plan.scaled_from[1]

        def slope(h):
            return unscaled[h] / divisor  # fp32, as the plan's divided slopes

    else:

        def slope(h):
            return slopes[h]

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score - slope(h) * (q_idx + query_offset - kv_idx)

    def bidirectional_score(score, b, h, q_idx, kv_idx):
        return score - slope(h) * (q_idx - kv_idx).abs()  # an encoder's -m * |i - j| (no cache: offset 0)

    score_mod = alibi_score if plan.causal else bidirectional_score
    output = attend(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling)
    return output.transpose(1, 2), None  # (B, q, H, D)


def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex_attention() if compiled else flex_attention


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)
