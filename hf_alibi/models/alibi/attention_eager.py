"""The reference path and the one-mask path: `eager` (scores, bias and softmax in fp32; the only path that returns
attention weights) and `sdpa_mask` (one SDPA call with the whole (B|1, H, q, kv) mask: a static cache's compiled
steps, symbolic lengths under torch.export). Both read one `FullBias`, every mask folded in, built once per forward.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .alibi_bias import alibi_bidirectional_bias, alibi_causal_bias
from .attention_plan import AlibiAttentionPlan, mask_in_dtype, visible_keys


@dataclass(frozen=True, eq=False)
class FullBias:
    """`eager` and `sdpa_mask`: one fp32 (B|1, H, q, kv) bias with every mask folded in, and its cast."""

    bias: torch.Tensor  # fp32
    cast: torch.Tensor  # `bias` in the layers' compute dtype, cast once (`bias` itself if fp32)

    def in_dtype(self, dtype: torch.dtype) -> torch.Tensor:
        """The bias in `dtype`: the one cast at planning time, or (a layer in another dtype) a cast of fp32."""
        return self.cast if self.cast.dtype == dtype else mask_in_dtype(self.bias, dtype)

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "FullBias":
        return replace(self, bias=self.bias[:, heads], cast=self.cast[:, heads])


def full_bias(plan: AlibiAttentionPlan) -> torch.Tensor:
    """One fp32 (B|1, H, q, kv) bias with every mask folded in: eager's, and sdpa_mask's before its cast."""
    alibi_bias = alibi_causal_bias if plan.causal else alibi_bidirectional_bias
    bias = alibi_bias(plan.slopes, plan.query_length, plan.key_length, plan.query_offset)[None]  # (1, H, q, kv)
    keep = visible_keys(plan)
    return bias if keep is None else bias.masked_fill(~keep, torch.finfo(torch.float32).min)  # (B|1, H, q, kv)


def prepare_eager(plan, preparation) -> FullBias:
    bias = full_bias(plan)  # (B|1, H, q, kv) fp32: the eager path scores in fp32
    return FullBias(bias, bias)


def prepare_sdpa_mask(plan, preparation) -> FullBias:
    bias = full_bias(plan)  # (B|1, H, q, kv)
    return FullBias(bias, mask_in_dtype(bias, preparation.dtype))


def eager_alibi_attention(query, key, value, plan, scaling, layer=None):
    """The reference: scores in fp32, plus the plan's fp32 relative bias (every mask folded in), softmax in fp32."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling  # (B, H, q, kv)
    weights = torch.softmax(scores + plan.payload.bias, dim=-1).to(value.dtype)  # (B, H, q, kv)
    weights = F.dropout(weights, p=plan.dropout, training=plan.dropout > 0)
    output = torch.matmul(weights, value)  # (B, H, q, D)
    return output.transpose(1, 2), weights  # (B, q, H, D)


def sdpa_mask_attention(query, key, value, plan, scaling, layer=None):
    """One SDPA call with the plan's whole (B|1, H, q, kv) mask."""
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=plan.payload.in_dtype(query.dtype), dropout_p=plan.dropout, scale=scaling
    )  # (B, H, q, D)
    return output.transpose(1, 2), None  # (B, q, H, D)
