"""FlashAttention-2 with its own `alibi_slopes` (CUDA): the plain, varlen and paged kernels (the stock transformers
integration drops the slopes).

flash-attn's causal mask is bottom-right aligned and its bias is -m * |i + kv - q - j|, i.e. ALiBi's. Padded batches
and packed rows (`flash_attention_2_varlen`) go through the varlen kernel on the real tokens only, one segment per
document: the boundaries are worked out once per forward (`prepare_flash_attention_2_varlen`). Continuous batching
(`paged_flash_attention_2`) hands the request boundaries to the varlen kernel, or (`PagedPlan.kvcache`, transformers'
decode fast path) its paged kernel reads and writes the cache's blocks itself; with the length-dependent `alibi_scaling`,
its `alibi_slopes` are per request, (R, H), each scaled by that request's key count.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .alibi_bias import length_scaled_slopes
from .attention_plan import AlibiAttentionPlan, Preparation


def _flash_attn():
    try:
        import flash_attn
    except ImportError as error:
        raise ImportError("attn_implementation='flash_attention_2' needs the flash-attn package") from error
    return flash_attn


def _check_cuda(query: torch.Tensor) -> None:
    if not query.is_cuda:
        raise ValueError("attn_implementation='flash_attention_2' needs CUDA tensors; use 'sdpa' on CPU")


@dataclass(frozen=True, eq=False)
class FlashVarlen:
    """`flash_attention_2_varlen`: which tokens are real, and the kernel's cumulative lengths and longest runs."""

    query_keep: torch.Tensor  # (B, q) bool
    key_keep: torch.Tensor  # (B, kv) bool
    cu_q: torch.Tensor  # (segments + 1,) int32
    cu_k: torch.Tensor  # (segments + 1,) int32
    max_q: int
    max_k: int

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "FlashVarlen":
        return self  # boundaries are the same for every head


def _varlen_boundaries(segments: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths (int32, with a leading 0) and the longest run of the kept tokens of `segments` (B, L)."""
    row_ids = segments + torch.arange(segments.shape[0], device=segments.device)[:, None] * (segments.shape[1] + 1)
    counts = torch.unique_consecutive(row_ids[keep], return_counts=True)[1]  # one count per (row, segment)
    return F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)), int(counts.max())


def prepare_flash_attention_2_varlen(plan: AlibiAttentionPlan, preparation: Preparation) -> FlashVarlen:
    q_len, kv = plan.query_length, plan.key_length
    device = plan.slopes.device
    key_keep = plan.key_padding
    if key_keep is None:
        key_keep = torch.ones(plan.documents.shape[0], kv, dtype=torch.bool, device=device)  # (B, kv)
    segments = plan.documents if plan.documents is not None else torch.zeros_like(key_keep, dtype=torch.long)
    query_keep = key_keep[:, kv - q_len :]  # (B, q)
    cu_k, max_k = _varlen_boundaries(segments, key_keep)
    cu_q, max_q = _varlen_boundaries(segments[:, kv - q_len :], query_keep)
    return FlashVarlen(query_keep, key_keep, cu_q, cu_k, max_q, max_k)


def flash_alibi_attention(query, key, value, plan, scaling, layer=None):
    """The dense kernel with the heads' slopes: causal, or (bidirectional plans) not, whose bias is -m * |i - j|."""
    flash_attn = _flash_attn()
    _check_cuda(query)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D)
    slopes = plan.slopes.to(device=query.device, dtype=torch.float32)
    return flash_attn.flash_attn_func(
        q, k, v, plan.dropout, softmax_scale=scaling, causal=plan.causal, alibi_slopes=slopes
    ), None


def flash_varlen_alibi_attention(query, key, value, plan, scaling, layer=None):
    """The varlen kernel over the real tokens of each row (and each document of packed rows); padded queries get 0."""
    flash_attn = _flash_attn()
    _check_cuda(query)
    varlen = plan.payload
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D)
    slopes = plan.slopes.to(device=query.device, dtype=torch.float32)
    out = flash_attn.flash_attn_varlen_func(
        q[varlen.query_keep],
        k[varlen.key_keep],
        v[varlen.key_keep],
        varlen.cu_q,
        varlen.cu_k,
        varlen.max_q,
        varlen.max_k,
        plan.dropout,
        softmax_scale=scaling,
        causal=plan.causal,
        alibi_slopes=slopes,
    )  # (real queries, H, D)
    output = q.new_zeros(q.shape[0], plan.query_length, *q.shape[2:])  # (B, q, H, D); padded queries stay zero
    output[varlen.query_keep] = out
    return output, None


def paged_flash_alibi_attention(query, key, value, plan, scaling, layer=None):
    """Continuous batching's flattened row: the varlen kernel over the request boundaries (bottom-right causality
    within each request), or the paged kernel on the decode fast path (`PagedPlan.kvcache`)."""
    if plan.payload.kvcache:
        return _paged_flash_kvcache(query, key, value, plan, scaling)
    flash_attn = _flash_attn()
    paged = plan.payload
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D), (K, H, D)
    cu_k = paged.cache_kwargs["cu_seq_lens_k"]
    cu_k = cu_k["full_attention"] if isinstance(cu_k, dict) else cu_k
    slopes = _paged_slopes(plan, cu_k, query.device)  # (H,) or (R, H)
    max_k = paged.cache_kwargs["max_length_k"]
    max_k = max_k["full_attention"] if isinstance(max_k, dict) else max_k
    out = flash_attn.flash_attn_varlen_func(
        q,
        k,
        v,
        paged.cu_seq_lens_q.to(torch.int32),
        cu_k.to(torch.int32),
        paged.max_length_q,
        int(max_k),
        softmax_scale=scaling,
        causal=True,
        alibi_slopes=slopes,
    )  # (T, H, D)
    return out[None], None  # (1, T, H, D)


def _paged_flash_kvcache(query, key, value, plan, scaling):
    """The decode fast path (one row per request): `cache.update` returned only the new keys, and the paged kernel
    reads and writes the cache's blocks (`PagedPlan.update_cache` gives the layer's blocks)."""
    flash_attn = _flash_attn()
    paged = plan.payload
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D)
    k_cache, v_cache, block_table, cu_k = paged.kernel_cache
    requests = q.shape[0]
    slopes = _paged_slopes(plan, cu_k[: requests + 1], query.device)  # (H,) or (T, H)
    cache_seqlens = (cu_k[1 : requests + 1] - cu_k[:requests] - 1).to(torch.int32)  # cached tokens per request
    out = flash_attn.flash_attn_with_kvcache(
        q[:, None],
        k_cache,
        v_cache,
        k[:, None],
        v[:, None],
        cache_seqlens=cache_seqlens,
        block_table=block_table,
        softmax_scale=scaling,
        causal=True,
        alibi_slopes=slopes,
    )  # (T, 1, H, D)
    return out.reshape(1, -1, *out.shape[-2:]), None  # (1, T, H, D)


def _paged_slopes(plan: AlibiAttentionPlan, cu_k: torch.Tensor, device) -> torch.Tensor:
    """The kernel's `alibi_slopes`: the heads' (H,), or per request (R, H) under the length-dependent
    `alibi_scaling`, each request's scaled by its own key count (its slice of `cu_k`), without a host read."""
    slopes = plan.slopes.to(device=device, dtype=torch.float32)  # (H,)
    if plan.payload.train_seq_len is None:
        return slopes
    lengths = (cu_k[1:] - cu_k[:-1])[:, None]  # (R, 1) keys per request: cached + new
    return length_scaled_slopes(slopes, lengths, plan.payload.train_seq_len).contiguous()  # (R, H)
