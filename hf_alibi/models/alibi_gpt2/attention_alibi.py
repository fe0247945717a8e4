"""ALiBi attention on every backend: one function per path of the plan, one signature, one table.

`alibi_attention` is what a layer calls with its queries, keys, values and the forward's `AlibiAttentionPlan`
(`attention_plan.py`, which chose the path and built what it needs). Each function of `ALIBI_ATTENTION_FUNCTIONS`
takes `(query, key, value, plan, scaling)` with query (B, H, q, D) and key/value (B, H, kv, D) and returns
((B, q, H, D) output, (B, H, q, kv) weights or None); only reading the plan.
"""

import functools

import torch
import torch.nn.functional as F

from .attention_plan import AlibiAttentionPlan, _is_static, visible_keys
from .attention_sdpa_split import _flash, head_runs, sdpa_alibi_split, split_kernels_work
from .attention_skip_ranges import certified_plan, certified_split


def alibi_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: AlibiAttentionPlan,
    scaling: float,
    output_attentions: bool = False,
    heads: slice | None = None,
    layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ALiBi attention for `query` (B, H, q, D) over `key`/`value` (B, H, kv, D). Returns ((B, q, H, D), weights).

    `heads` names the global heads this call's query holds (a tensor-parallel rank's slice), None for all of them.
    With certified skipping on (`plan.skip_eps > 0`) the call first derives its key ranges from its own queries and
    keys; `layer` names the layer for the decoding summary of a cache's key norms.
    Weights (post-softmax, (B, H, q, buffer)) come only from a plan built for `"eager"`, the model's choice when
    `output_attentions` is asked for; a static cache's unwritten slots get weight 0.
    """
    if heads is not None and heads != plan.heads:  # (the model hands its layers the rank's plan already)
        if not isinstance(heads, slice) or len(range(plan.slopes.shape[0])[heads]) != query.shape[1]:
            raise ValueError(
                f"heads={heads!r} must be a slice of the {plan.slopes.shape[0]} global heads with as many heads as "
                f"the query holds ({query.shape[1]})"
            )
        plan = plan.for_heads(heads)
    if plan.slopes.shape[0] != query.shape[1]:
        raise ValueError(f"the plan holds {plan.slopes.shape[0]} heads (heads={plan.heads!r}) but the query "
                         f"{query.shape[1]}: pass heads= the global heads this call's query holds")  # fmt: skip
    if output_attentions and plan.path != "eager":
        raise ValueError(f"attention weights come from the eager path; this forward's plan is {plan.path!r}")
    buffer = key.shape[2]
    if plan.paged is None and _is_static(plan.key_length) and buffer > plan.key_length:  # a static buffer's filled part
        key, value = key[:, :, : plan.key_length], value[:, :, : plan.key_length]  # (B, H, kv, D) views: the one cut
    if plan.skip_eps > 0:
        plan = certified_plan(plan, query, key, scaling, layer)
    output, weights = ALIBI_ATTENTION_FUNCTIONS[plan.path](query, key, value, plan, scaling)
    if not output_attentions:
        return output, None
    if weights.shape[-1] < buffer:
        weights = F.pad(weights, (0, buffer - weights.shape[-1]))  # (B, H, q, buffer)
    return output, weights


def eager_alibi_attention(query, key, value, plan, scaling):
    """The reference: scores in fp32, plus the plan's fp32 relative bias (every mask folded in), softmax in fp32."""
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling  # (B, H, q, kv)
    weights = torch.softmax(scores + plan.bias, dim=-1).to(value.dtype)  # (B, H, q, kv)
    weights = F.dropout(weights, p=plan.dropout, training=plan.dropout > 0)
    output = torch.matmul(weights, value)  # (B, H, q, D)
    return output.transpose(1, 2), weights  # (B, q, H, D)


def sdpa_mask_attention(query, key, value, plan, scaling):
    """One SDPA call with the plan's whole (B|1, H, q, kv) mask."""
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=plan.bias_in(query.dtype), dropout_p=plan.dropout, scale=scaling
    )  # (B, H, q, D)
    return output.transpose(1, 2), None  # (B, q, H, D)


def sdpa_split_attention(query, key, value, plan, scaling):
    """SDPA on the CPU flash kernels with no (q, kv) bias (`attention_sdpa_split`); certified skipping on, the
    split computes the diagonals, certifies the rest from their log-sum-exps, then reads only the kept keys."""
    if plan.skip_eps > 0:
        return certified_split(query, key, value, plan, scaling)[0].transpose(1, 2), None  # (B, q, H, D)
    output = sdpa_alibi_split(
        query, key, value, plan.slopes, plan.query_offset, plan.key_padding, scaling,
        chunks=plan.split_chunks, key_ranges=plan.key_ranges, plan=plan.split,
    )  # (B, H, q, D)  # fmt: skip
    return output.transpose(1, 2), None  # (B, q, H, D)


def sdpa_bank_attention(query, key, value, plan, scaling):
    """Public SDPA per query chunk; each chunk's mask is a view of the plan's bias bank.

    Rows [s, e) sit at absolute positions offset + s .. offset + e - 1 and see keys [0, offset + e). With
    E = offset + e and n = e - s, the bank row a' = a + chunk - n and column c = j + kv - E hold exactly
    -m * ((offset + s + a) - j), so the chunk's mask is bank[:, :, chunk - n:, kv - E:].
    """
    bank = plan.bias_in(query.dtype)  # (B|1, H, chunk, kv)
    if plan.key_ranges is not None and plan.query_length == 1:  # a decoding row: skipped keys are not read at all
        return _decode_in_key_ranges(query, key, value, plan, bank, scaling), None
    chunk, kv = bank.shape[2], plan.key_length
    q_len, offset = plan.query_length, plan.query_offset
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        n, visible = end - start, offset + end
        mask = bank[:, :, chunk - n :, kv - visible :]  # (B|1, H, n, visible), a view
        if not plan.bias_has_padding:
            keep = visible_keys(plan, slice(start, end), slice(0, visible))  # (B|1, 1|H, n|1, visible) or None
            if keep is not None:
                mask = mask.masked_fill(~keep, torch.finfo(mask.dtype).min)  # (B|1, H, n, visible)
        out = F.scaled_dot_product_attention(
            query[:, :, start:end], key[:, :, :visible], value[:, :, :visible],
            attn_mask=mask, dropout_p=plan.dropout, scale=scaling,
        )  # (B, H, n, D)  # fmt: skip
        outputs.append(out)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # (B, H, q, D)
    return output.transpose(1, 2), None  # (B, q, H, D)


def _decode_in_key_ranges(query, key, value, plan, bank, scaling):
    """One row per head run that shares a first key, over keys [first, kv) with the bank's per-key bias.

    A run's call over one query row cannot spread over threads (the kernel splits work by batch, heads and query
    rows), so on the CPU flash kernels, without dropout, a long run is cut into `DECODE_SEGMENT`-key segments that
    go to the kernel as one batch, and the segments' outputs merge exactly by their log-sum-exps, as in the split.
    """
    outputs = []
    segmented = query.device.type == "cpu" and plan.dropout == 0 and query.shape[0] == 1 and split_kernels_work()
    for head, end, first in head_runs(plan.key_ranges.first_key[:, 0].tolist()):
        heads = slice(head, end)
        if segmented and plan.key_length - first >= 2 * DECODE_SEGMENT:
            outputs.append(_segmented_row(query[:, heads], key[:, heads], value[:, heads], bank[:, heads], first,
                                          scaling).to(query.dtype))  # fmt: skip
        else:
            outputs.append(F.scaled_dot_product_attention(
                query[:, heads], key[:, heads, first:], value[:, heads, first:],
                attn_mask=bank[:, heads, :, first:], dropout_p=plan.dropout, scale=scaling,
            ))  # (B, h, 1, D)  # fmt: skip
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (B, H, 1, D)
    return output.transpose(1, 2)  # (B, 1, H, D)


DECODE_SEGMENT = 2048  # keys per segment of a decoding row's long key range


def _segmented_row(query, key, value, bank, first, scaling):
    """Batch 1, one row (1, h, 1, D) over keys [first, kv): equal segments as one kernel batch, the rest after."""
    kv = key.shape[2]
    count = (kv - first) // DECODE_SEGMENT
    split = first + count * DECODE_SEGMENT

    def segments(tensor):  # keys [first, split) of (1, h, kv, D) as (count, h, S, D), a view
        return tensor[0, :, first:split].unflatten(1, (count, DECODE_SEGMENT)).transpose(0, 1)

    mask = bank[0, :, :, first:split].unflatten(2, (count, DECODE_SEGMENT)).permute(2, 0, 1, 3)  # (count, h, 1, S)
    rows = query.expand(count, -1, -1, -1)  # (count, h, 1, D)
    out, lse = _flash(rows, segments(key), segments(value), mask, scaling)  # (count, h, 1, D), (count, h, 1)
    if split < kv:
        tail_out, tail_lse = _flash(query, key[:, :, split:], value[:, :, split:], bank[:, :, :, split:], scaling)
        out, lse = torch.cat([out, tail_out]), torch.cat([lse, tail_lse])  # (count + 1, ...)
    weights = torch.softmax(lse.float(), dim=0)[..., None]  # (segments, h, 1, 1): each segment's share of the mass
    return (weights * out.float()).sum(0, keepdim=True)  # (1, h, 1, D)


def flex_alibi_attention(query, key, value, plan, scaling):
    """FlexAttention with the analytic ALiBi `score_mod`: no bias tensor at all, masked blocks skipped.

    On CPU this runs FlexAttention's unfused path unless the model is under `torch.compile`.
    """
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type == "cpu" and query.requires_grad:
        raise ValueError(
            "attn_implementation='flex_attention' has no backward pass on CPU in this torch version: train with "
            "'sdpa' on CPU, or run inference under torch.no_grad()"
        )
    slopes, offset = plan.slopes.to(query.device), plan.query_offset

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)

    attend = _compiled_flex_attention() if plan.flex_compiled else flex_attention
    output = attend(query, key, value, score_mod=alibi_score, block_mask=plan.block_mask, scale=scaling)
    return output.transpose(1, 2), None  # (B, q, H, D)


@functools.cache
def _compiled_flex_attention():
    """FlexAttention's fused kernel for a model that runs eagerly on a GPU (what transformers' flex integration
    does): the per-head block masks of certified skipping are then skipped by the kernel, not just masked."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _varlen_boundaries(segments: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths (int32, with a leading 0) and the longest run of the kept tokens of `segments` (B, L)."""
    row_ids = segments + torch.arange(segments.shape[0], device=segments.device)[:, None] * (segments.shape[1] + 1)
    counts = torch.unique_consecutive(row_ids[keep], return_counts=True)[1]  # one count per (row, segment)
    return F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)), int(counts.max())


def flash_alibi_attention(query, key, value, plan, scaling):
    """FlashAttention-2 with its own `alibi_slopes` (the stock transformers integration drops them).

    flash-attn's causal mask is bottom-right aligned and its bias is -m * |i + kv - q - j|, i.e. ALiBi's. Padded
    batches and packed rows go through the varlen kernel on the real tokens only, one segment per document.
    """
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError("attn_implementation='flash_attention_2' needs the flash-attn package") from error
    if not query.is_cuda:
        raise ValueError("attn_implementation='flash_attention_2' needs CUDA tensors; use 'sdpa' on CPU")
    key_padding, q_len, dropout = plan.key_padding, plan.query_length, plan.dropout
    visible = int(plan.query_offset) + q_len  # a static cache returns its whole buffer: keep the filled part
    if visible != key.shape[2]:
        key, value = key[:, :, :visible], value[:, :, :visible]
        key_padding = None if key_padding is None else key_padding[:, :visible]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D)
    slopes = plan.slopes.to(device=query.device, dtype=torch.float32)
    if key_padding is None and plan.documents is None:
        return flash_attn_func(q, k, v, dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes), None
    batch = q.shape[0]
    key_keep = key_padding if key_padding is not None else q.new_ones(batch, visible, dtype=torch.bool)  # (B, kv)
    query_keep = key_keep[:, visible - q_len :]  # (B, q)
    segments = plan.documents if plan.documents is not None else torch.zeros_like(key_keep, dtype=torch.long)
    cu_k, max_k = _varlen_boundaries(segments, key_keep)
    cu_q, max_q = _varlen_boundaries(segments[:, visible - q_len :], query_keep)
    out = flash_attn_varlen_func(
        q[query_keep], k[key_keep], v[key_keep], cu_q, cu_k, max_q, max_k,
        dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes,
    )  # (real queries, H, D)  # fmt: skip
    output = q.new_zeros(batch, q_len, *q.shape[2:])  # (B, q, H, D); padded queries stay zero
    output[query_keep] = out
    return output, None


def paged_alibi_attention(query, key, value, plan, scaling):
    """A continuous-batching forward (`attention_paged.py`): query (1, H, T, D) holds every request's new rows, key
    and value (1, H, K, D) every request's keys. Each prefill segment attends its own key slice through its own
    batch-1 plan; the decoding rows attend their gathered keys in one batched call."""
    paged = plan.paged
    batch, heads, _, head_dim = query.shape
    output = query.new_zeros(batch, paged.total_rows, heads, head_dim)  # (1, T, H, D): padding rows stay zero
    for segment in paged.segments:
        rows, keys = slice(segment.row_start, segment.row_end), slice(segment.key_start, segment.key_end)
        output[:, rows] = alibi_attention(query[:, :, rows], key[:, :, keys], value[:, :, keys], segment.plan,
                                          scaling)[0]  # (1, q_r, H, D)  # fmt: skip
    decode = paged.decode
    if decode is not None:
        n, longest = decode.rows.shape[0], decode.plan.key_length
        rows = query[0].index_select(1, decode.rows).transpose(0, 1)[:, :, None]  # (n, H, 1, D)
        # The cache returns keys as (1, H, K, D) views of (K, H, D): gather whole (H, D) rows, then view per request
        gathered = [t[0].transpose(0, 1).index_select(0, decode.key_index) for t in (key, value)]  # 2 x (n K_max, H, D)
        k, v = (t.view(n, longest, heads, head_dim).transpose(1, 2) for t in gathered)  # 2 x (n, H, K_max, D)
        out = ALIBI_ATTENTION_FUNCTIONS[decode.plan.path](rows, k, v, decode.plan, scaling)[0]  # (n, 1, H, D)
        output[0].index_copy_(0, decode.rows, out[:, 0])
    return output, None


def paged_flash_alibi_attention(query, key, value, plan, scaling):
    """Continuous batching on FlashAttention-2 (CUDA): its varlen kernel over the request boundaries, or its paged
    kernel over the cache's blocks on the decode fast path, both with `alibi_slopes` and bottom-right causality."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as error:
        raise ImportError("attn_implementation='flash_attention_2' needs the flash-attn package") from error
    paged = plan.paged
    slopes = plan.slopes.to(device=query.device, dtype=torch.float32)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D), (K, H, D)
    if paged.kernel_cache is not None:  # one decoding row per request: the kernel reads and writes the blocks
        k_cache, v_cache, block_table, cu_k = paged.kernel_cache
        requests = q.shape[0]
        cache_seqlens = (cu_k[1 : requests + 1] - cu_k[:requests] - 1).to(torch.int32)  # cached tokens per request
        out = flash_attn_with_kvcache(
            q[:, None], k_cache, v_cache, k[:, None], v[:, None], cache_seqlens=cache_seqlens,
            block_table=block_table, softmax_scale=scaling, causal=True, alibi_slopes=slopes,
        )  # (T, 1, H, D)  # fmt: skip
        return out.reshape(1, -1, *out.shape[-2:]), None  # (1, T, H, D)
    cu_k = paged.cache_kwargs["cu_seq_lens_k"]
    cu_k = cu_k["full_attention"] if isinstance(cu_k, dict) else cu_k
    max_k = paged.cache_kwargs["max_length_k"]
    max_k = max_k["full_attention"] if isinstance(max_k, dict) else max_k
    out = flash_attn_varlen_func(
        q, k, v, paged.cu_seq_lens_q.to(torch.int32), cu_k.to(torch.int32), paged.max_length_q, int(max_k),
        softmax_scale=scaling, causal=True, alibi_slopes=slopes,
    )  # (T, H, D)  # fmt: skip
    return out[None], None  # (1, T, H, D)


# The plan's path -> its function (`attention_plan.py` says why each path exists)
ALIBI_ATTENTION_FUNCTIONS = {
    "eager": eager_alibi_attention,
    "sdpa_split": sdpa_split_attention,
    "sdpa_bank": sdpa_bank_attention,
    "sdpa_mask": sdpa_mask_attention,
    "flex_attention": flex_alibi_attention,
    "flash_attention_2": flash_alibi_attention,
    "paged": paged_alibi_attention,
    "paged_flash_attention_2": paged_flash_alibi_attention,
}
