"""ALiBi attention on every backend: one plan per forward, one function per path, one signature, one table.

`plan_alibi_attention` turns a forward's inputs into its `AlibiAttentionPlan` (`attention_plan.py`: the facts, and
`choose_path`, the only function that picks a path), then builds the path's payload with that path's
`prepare_<path>`. `alibi_attention` is what a layer calls with its queries, keys, values and the plan. Each
function of `ALIBI_ATTENTION_FUNCTIONS` takes `(query, key, value, plan, scaling, layer)` with query (B, H, q, D)
and key/value (B, H, kv, D), and returns ((B, q, H, D) output, (B, H, q, kv) weights or None), only reading the
plan; `layer` (the layer's index, as transformers' functions get the module) matters to certified decoding alone.
"""

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .alibi import length_scaled_slopes
from .attention_flash import (
    flash_alibi_attention,
    flash_varlen_alibi_attention,
    paged_flash_alibi_attention,
    prepare_flash_attention_2_varlen,
)
from .attention_packed import packed_alibi_attention, prepare_sdpa_packed
from .attention_plan import (
    PATHS,
    SDPA_QUERY_CHUNK,
    AlibiAttentionPlan,
    Preparation,
    BiasBank,
    FullBias,
    _is_static,
    bias_bank,
    choose_path,
    flex_block_mask,
    full_bias,
    mask_in_dtype,
    plan_facts,
    visible_keys,
    with_host_offset,
)
from .attention_sdpa_split import SPLIT_CHUNKS, _flash, head_runs, split_attention, split_kernels_work, split_plan
from .attention_skip_ranges import (
    certified_decode_ranges,
    certified_flex_ranges,
    certified_split,
    prepare_flex_attention_certified,
    prepare_sdpa_decode_certified,
    prepare_sdpa_split_certified,
    skipping_pays,
)


def plan_alibi_attention(
    implementation: str,
    slopes: torch.Tensor,
    batch: int,
    query_length: int,
    key_length: int,
    query_offset: int | torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    dropout: float = 0.0,
    sdpa_split: bool = True,
    query_chunk: int = SDPA_QUERY_CHUNK,
    skip_eps: float | str = 0.0,
    key_norms=None,
    output_attentions: bool = False,
    train_seq_len: int | None = None,
) -> AlibiAttentionPlan:
    """Validate one forward's inputs and build its plan for `implementation` (one of `SUPPORTED_ATTENTION`).

    `attention_mask` is the usual 2-D (B, kv) mask of 1 (real) and 0 (padding), or None. `query_offset` is the
    number of cached tokens (default `key_length - query_length`). Packed rows are described by `position_ids` that
    restart (read only without a mask and without cached tokens, as transformers' models do) or by flash-attention
    style `cu_seq_lens` of one flattened row. `dtype` is the layers' compute dtype (autocast's, else the weights'):
    SDPA masks are built in it once. `sdpa_split=False` sends the calls the split would serve to the bias bank,
    whose chunks have `query_chunk` rows (the config's `alibi_sdpa_split` and `alibi_sdpa_query_chunk`).
    `skip_eps` (the config's `alibi_skip_eps`: `"auto"` or a number) asks for certified key skipping
    (`choose_path` says where it applies); a decoding step that skips reads the running key-norm summary of its cache
    (`attention_skip_ranges.RunningKeyNorms`) from `key_norms`, a function called only then.
    `output_attentions` plans the eager path, the one that returns weights. `train_seq_len` (the config's
    length-dependent `alibi_scaling`) divides the slopes by max(1, K / n) here, once, K = cached + new keys (a static
    cache's filled part, not its buffer): every path, certified skipping and its rule read the scaled slopes; a
    packed row's documents keep the row's scale, as the source computes it from the forward's key count.
    """
    tracing = torch.compiler.is_compiling()  # the one place that asks: compiled graphs never branch on data
    if train_seq_len is not None:  # K: a 0-d tensor for a static cache (a tensor op: no host sync when compiled)
        filled = key_length if query_offset is None else query_offset + query_length
        slopes = length_scaled_slopes(slopes.float(), filled, train_seq_len)  # (H,)
    facts = plan_facts(slopes, batch, query_length, key_length, query_offset, attention_mask, position_ids,
                       cu_seq_lens, dropout, tracing=tracing)  # fmt: skip
    route = choose_path(
        implementation, facts, device=slopes.device.type, tracing=tracing, sdpa_split=sdpa_split,
        skip_eps=skip_eps, kernels_work=split_kernels_work, skip_pays=skipping_pays,
        output_attentions=output_attentions,
    )  # fmt: skip
    facts = with_host_offset(facts) if route.host_offset else facts

    def plan_part(length: int) -> AlibiAttentionPlan:  # one uncached row of its own (a packed row's document)
        return plan_alibi_attention(implementation, slopes, 1, length, length, dtype=dtype, sdpa_split=sdpa_split,
                                    query_chunk=query_chunk, skip_eps=skip_eps)  # fmt: skip

    preparation = Preparation(dtype, query_chunk, route.eps, key_norms, plan_part, route.segmented, route.compiled)
    return replace(facts, path=route.path, payload=PREPARE_PATHS[route.path](facts, preparation))


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
    `layer` names the layer (certified decoding keeps a key-norm summary per layer of a cache).
    Weights (post-softmax, (B, H, q, buffer)) come only from a plan built for `"eager"`, the model's choice when
    `output_attentions` is asked for; a static cache's unwritten slots get weight 0.
    The forward's inputs were validated once, when it was planned; what is checked here per call (heads, weights
    asked of a non-eager plan) are integer comparisons a direct caller can get wrong, and the paths check nothing.
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
    if not plan.path.startswith("paged") and _is_static(plan.key_length) and buffer > plan.key_length:
        key, value = key[:, :, : plan.key_length], value[:, :, : plan.key_length]  # (B, H, kv, D): the one cut
    output, weights = ALIBI_ATTENTION_FUNCTIONS[plan.path](query, key, value, plan, scaling, layer)
    if not output_attentions:
        return output, None
    if weights.shape[-1] < buffer:
        weights = F.pad(weights, (0, buffer - weights.shape[-1]))  # (B, H, q, buffer)
    return output, weights


@dataclass(frozen=True, eq=False)
class FlexBlocks:
    """`flex_attention`: the forward's block mask (padding, documents), the same for every head; `compiled`:
    FlexAttention's fused kernel (`Route.compiled`)."""

    block_mask: object
    compiled: bool = False

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "FlexBlocks":
        return self


def prepare_eager(plan, preparation) -> FullBias:
    bias = full_bias(plan)  # (B|1, H, q, kv) fp32: the eager path scores in fp32
    return FullBias(bias, bias)


def prepare_sdpa_mask(plan, preparation) -> FullBias:
    bias = full_bias(plan)  # (B|1, H, q, kv)
    return FullBias(bias, mask_in_dtype(bias, preparation.dtype))


def prepare_sdpa_bank(plan, preparation) -> BiasBank:
    bank, folded = bias_bank(plan, preparation.query_chunk)  # (B|1, H, chunk, kv)
    return BiasBank(bank, mask_in_dtype(bank, preparation.dtype), folded)


def prepare_flex_attention(plan, preparation) -> FlexBlocks:
    return FlexBlocks(flex_block_mask(plan), preparation.compiled)


def prepare_flash_attention_2(plan, preparation) -> None:
    return None  # the kernel takes the slopes and causality itself


def prepare_sdpa_split(plan, preparation):
    return split_plan(plan.slopes, plan.query_offset, plan.query_length, plan.key_padding, SPLIT_CHUNKS, plan.batch,
                      dtype=preparation.dtype)  # fmt: skip


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


def sdpa_split_attention(query, key, value, plan, scaling, layer=None):
    """SDPA on the CPU flash kernels with no (q, kv) bias (`attention_sdpa_split`), the forward's calls planned (and
    its inputs validated) once: no per-layer checks."""
    return split_attention(query, key, value, plan.payload, scaling).transpose(1, 2), None  # (B, q, H, D)


def sdpa_split_certified_attention(query, key, value, plan, scaling, layer=None):
    """The split computes the diagonals, certifies the rest from their log-sum-exps, then reads only the kept keys
    (`attention_skip_ranges.certified_split`)."""
    return certified_split(query, key, value, plan, scaling)[0].transpose(1, 2), None  # (B, q, H, D)


def sdpa_bank_attention(query, key, value, plan, scaling, layer=None):
    """Public SDPA per query chunk; each chunk's mask is a view of the plan's bias bank.

    Rows [s, e) sit at absolute positions offset + s .. offset + e - 1 and see keys [0, offset + e). With
    E = offset + e and n = e - s, the bank row a' = a + chunk - n and column c = j + kv - E hold exactly
    -m * ((offset + s + a) - j), so the chunk's mask is bank[:, :, chunk - n:, kv - E:].
    """
    bank = plan.payload.in_dtype(query.dtype)  # (B|1, H, chunk, kv)
    chunk, kv = bank.shape[2], plan.key_length
    q_len, offset = plan.query_length, plan.query_offset
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        n, visible = end - start, offset + end
        mask = bank[:, :, chunk - n :, kv - visible :]  # (B|1, H, n, visible), a view
        if not plan.payload.folded:
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


def sdpa_decode_certified_attention(query, key, value, plan, scaling, layer=None):
    """A decoding row over its layer's certified key ranges (`attention_skip_ranges.certified_decode_ranges`): one
    public call per run of heads that share a first key, over keys [first, kv) with the bank's per-key bias, so
    skipped keys are not read at all. `segmented` (the payload's): each run's keys cut into `DECODE_SEGMENT`-key
    segments that go to the CPU flash kernel as one batch (a call over one query row cannot spread over threads
    otherwise: the kernel splits work by batch, heads and query rows), merged exactly by their log-sum-exps."""
    ranges = certified_decode_ranges(plan, query, key, scaling, layer)
    attend_row = _segmented_row if plan.payload.segmented else _public_row
    return _decode_in_ranges(query, key, value, plan, plan.payload.bank, ranges, scaling, attend_row), None


def _decode_in_ranges(query, key, value, plan, bank, ranges, scaling, attend_row):
    """(B, 1, H, D): each run of heads sharing a first key attends keys [first, kv) through `attend_row`."""
    bias = bank.in_dtype(query.dtype)  # (B|1, H, 1, kv)
    outputs = []
    for head, end, first in head_runs(ranges.first_key[:, 0].tolist()):
        heads = slice(head, end)
        outputs.append(attend_row(query[:, heads], key[:, heads], value[:, heads], bias[:, heads], first,
                                  plan.dropout, scaling))  # (B, h, 1, D)  # fmt: skip
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)  # (B, H, 1, D)
    return output.transpose(1, 2)  # (B, 1, H, D)


def _public_row(query, key, value, bias, first, dropout, scaling):
    """(B, h, 1, D) over keys [first, kv): one public SDPA call."""
    return F.scaled_dot_product_attention(query, key[:, :, first:], value[:, :, first:], attn_mask=bias[..., first:],
                                          dropout_p=dropout, scale=scaling)  # fmt: skip


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


def flex_alibi_attention(query, key, value, plan, scaling, layer=None):
    """FlexAttention with the analytic ALiBi `score_mod`: no bias tensor at all, masked blocks skipped. On CPU this
    runs FlexAttention's unfused path unless the model is under `torch.compile`; `compiled` (the payload's): the
    fused kernel, for a model that runs eagerly on a GPU (what transformers' flex integration does), whose skipped
    blocks are never read."""
    return _flex(query, key, value, plan, scaling, plan.payload.block_mask, _flex_attention(plan.payload.compiled))


def flex_certified_alibi_attention(query, key, value, plan, scaling, layer=None):
    """FlexAttention over the layer's certified key ranges, as per-head block masks (`compiled` as above)."""
    block_mask = flex_block_mask(plan, certified_flex_ranges(plan, query, key, scaling))
    return _flex(query, key, value, plan, scaling, block_mask, _flex_attention(plan.payload.compiled))


def _flex(query, key, value, plan, scaling, block_mask, attend):
    if query.device.type == "cpu" and query.requires_grad:
        raise ValueError(
            "attn_implementation='flex_attention' has no backward pass on CPU in this torch version: train with "
            "'sdpa' on CPU, or run inference under torch.no_grad()"
        )
    slopes, offset = plan.slopes.to(query.device), plan.query_offset
    if query.device.type == "cpu":  # torch 2.13's CPU flex template lowers only inputs laid out as (B, H, L, D)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)

    output = attend(query, key, value, score_mod=alibi_score, block_mask=block_mask, scale=scaling)
    return output.transpose(1, 2), None  # (B, q, H, D)


def _flex_attention(compiled: bool):
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex_attention() if compiled else flex_attention


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def paged_alibi_attention(query, key, value, plan, scaling, layer=None):
    """A continuous-batching forward (`attention_paged.py`): query (1, H, T, D) holds every request's new rows, key
    and value (1, H, K, D) every request's keys. Each prefill segment attends its own key slice through its own
    batch-1 plan; the decoding rows attend their gathered keys in one batched call."""
    paged = plan.payload
    batch, heads, _, head_dim = query.shape
    output = query.new_zeros(batch, paged.total_rows, heads, head_dim)  # (1, T, H, D): padding rows stay zero
    for segment in paged.segments:
        rows, keys = slice(segment.row_start, segment.row_end), slice(segment.key_start, segment.key_end)
        output[:, rows] = alibi_attention(query[:, :, rows], key[:, :, keys], value[:, :, keys], segment.plan,
                                          scaling, layer=layer)[0]  # (1, q_r, H, D)  # fmt: skip
    decode = paged.decode
    if decode is not None:
        n, longest = decode.rows.shape[0], decode.plan.key_length
        rows = query[0].index_select(1, decode.rows).transpose(0, 1)[:, :, None]  # (n, H, 1, D)
        # The cache returns keys as (1, H, K, D) views of (K, H, D): gather whole (H, D) rows, then view per request
        gathered = [t[0].transpose(0, 1).index_select(0, decode.key_index) for t in (key, value)]  # 2 x (n K_max, H, D)
        k, v = (t.view(n, longest, heads, head_dim).transpose(1, 2) for t in gathered)  # 2 x (n, H, K_max, D)
        out = ALIBI_ATTENTION_FUNCTIONS[decode.plan.path](rows, k, v, decode.plan, scaling, layer)[0]  # (n, 1, H, D)
        output[0].index_copy_(0, decode.rows, out[:, 0])
    return output, None


def prepare_paged(plan, preparation):
    raise ValueError(f"the paged paths ({plan.path!r}) are planned by attention_paged.plan_paged_attention")


# The plan's path -> its function (`attention_plan.py` says why each path exists)
ALIBI_ATTENTION_FUNCTIONS = {
    "eager": eager_alibi_attention,
    "sdpa_split": sdpa_split_attention,
    "sdpa_split_certified": sdpa_split_certified_attention,
    "sdpa_bank": sdpa_bank_attention,
    "sdpa_decode_certified": sdpa_decode_certified_attention,
    "sdpa_mask": sdpa_mask_attention,
    "flex_attention": flex_alibi_attention,
    "flex_attention_certified": flex_certified_alibi_attention,
    "flash_attention_2": flash_alibi_attention,
    "flash_attention_2_varlen": flash_varlen_alibi_attention,
    "paged": paged_alibi_attention,
    "paged_flash_attention_2": paged_flash_alibi_attention,
    "sdpa_packed": packed_alibi_attention,
}

# The plan's path -> the function that builds its payload once per forward (the route's variant goes into it)
PREPARE_PATHS = {
    "eager": prepare_eager,
    "sdpa_split": prepare_sdpa_split,
    "sdpa_split_certified": prepare_sdpa_split_certified,
    "sdpa_bank": prepare_sdpa_bank,
    "sdpa_decode_certified": prepare_sdpa_decode_certified,
    "sdpa_mask": prepare_sdpa_mask,
    "flex_attention": prepare_flex_attention,
    "flex_attention_certified": prepare_flex_attention_certified,
    "flash_attention_2": prepare_flash_attention_2,
    "flash_attention_2_varlen": prepare_flash_attention_2_varlen,
    "paged": prepare_paged,
    "paged_flash_attention_2": prepare_paged,
    "sdpa_packed": prepare_sdpa_packed,
}
assert tuple(ALIBI_ATTENTION_FUNCTIONS) == PATHS == tuple(PREPARE_PATHS), "every path has one function and one prepare"
