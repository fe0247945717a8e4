"""ALiBi attention on every backend: one plan per forward, one function per path, one signature, one table.

`plan_alibi_attention` turns a forward's inputs into its `AlibiAttentionPlan` (`attention_plan.py`: the facts, and
`choose_path`, the only function that picks a path), then builds the path's payload with that path's
`prepare_<path>`. `alibi_attention` is what a layer calls with its queries, keys, values and the plan. Each
function of `ALIBI_ATTENTION_FUNCTIONS` takes `(query, key, value, plan, scaling, layer)` with query (B, H, q, D)
and key/value (B, H, kv, D), and returns ((B, q, H, D) output, (B, H, q, kv) weights or None), only reading the
plan; `layer` (the layer's index, as transformers' functions get the module) matters to certified decoding alone.
"""

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from .alibi_bias import length_scaled_slopes
from .attention_certified import (
    flex_certified_alibi_attention,
    prepare_flex_attention_certified,
    prepare_sdpa_decode_certified,
    prepare_sdpa_split_certified,
    sdpa_decode_certified_attention,
    sdpa_split_certified_attention,
    skipping_pays,
)
from .attention_eager import eager_alibi_attention, prepare_eager, prepare_sdpa_mask, sdpa_mask_attention
from .attention_flash import (
    flash_alibi_attention,
    flash_varlen_alibi_attention,
    paged_flash_alibi_attention,
    prepare_flash_attention_2_varlen,
)
from .attention_flex import flex_alibi_attention, prepare_flex_attention
from .attention_packed import packed_alibi_attention, prepare_sdpa_packed
from .attention_paged import paged_alibi_attention, prepare_paged
from .attention_plan import (
    PATHS,
    SDPA_QUERY_CHUNK,
    AlibiAttentionPlan,
    Preparation,
    _is_static,
    choose_path,
    plan_facts,
    with_host_offset,
)
from .attention_sdpa import prepare_sdpa_bank, sdpa_bank_attention
from .attention_sdpa_split import prepare_sdpa_split, sdpa_split_attention, split_kernels_work
from .transformers_compat import SwitchableAttention


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
    causal: bool = True,
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
    (`attention_key_norms.RunningKeyNorms`) from `key_norms`, a function called only then.
    `output_attentions` plans the eager path, the one that returns weights. `train_seq_len` (the config's
    length-dependent `alibi_scaling`) divides the slopes by max(1, K / n) here, once, K = cached + new keys (a static
    cache's filled part, not its buffer): every path, certified skipping and its rule read the scaled slopes; a
    packed row's documents keep the row's scale, as the source computes it from the forward's key count.
    `causal=False` plans an encoder's bidirectional ALiBi, `-m * |i - j|` over every key (no cache).
    """
    tracing = torch.compiler.is_compiling()  # the one place that asks: compiled graphs never branch on data
    scaled_from = None
    if train_seq_len is not None:  # K: a 0-d tensor for a static cache (a tensor op: no host sync when compiled)
        filled = key_length if query_offset is None else query_offset + query_length
        unscaled, slopes = slopes.float(), length_scaled_slopes(slopes.float(), filled, train_seq_len)  # (H,)
        if isinstance(filled, int) and filled > train_seq_len:
            scaled_from = (unscaled, filled / train_seq_len)  # length_scaled_slopes' divisor, as a number
    facts = plan_facts(
        slopes,
        batch,
        query_length,
        key_length,
        query_offset,
        attention_mask,
        position_ids,
        cu_seq_lens,
        dropout,
        tracing=tracing,
        causal=causal,
    )
    route = choose_path(
        implementation,
        facts,
        device=slopes.device.type,
        tracing=tracing,
        sdpa_split=sdpa_split,
        skip_eps=skip_eps,
        kernels_work=split_kernels_work,
        skip_pays=skipping_pays,
        output_attentions=output_attentions,
    )
    facts = with_host_offset(facts) if route.host_offset else facts
    plan_part = partial(_plan_document, implementation, slopes, dtype, sdpa_split, query_chunk, skip_eps, causal)
    preparation = Preparation(dtype, query_chunk, route.eps, key_norms, plan_part, route.segmented, route.compiled)
    facts = replace(facts, scaled_from=scaled_from)
    return replace(facts, path=route.path, payload=PREPARE_PATHS[route.path](facts, preparation))


def _plan_document(
    implementation, slopes, dtype, sdpa_split, query_chunk, skip_eps, causal, length
) -> AlibiAttentionPlan:
    """The plan of one uncached row of its own, `length` tokens: a packed row's document (`Preparation.plan_part`)."""
    return plan_alibi_attention(
        implementation,
        slopes,
        1,
        length,
        length,
        dtype=dtype,
        sdpa_split=sdpa_split,
        query_chunk=query_chunk,
        skip_eps=skip_eps,
        causal=causal,
    )


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
        raise ValueError(
            f"the plan holds {plan.slopes.shape[0]} heads (heads={plan.heads!r}) but the query "
            f"{query.shape[1]}: pass heads= the global heads this call's query holds"
        )
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


def prepare_flash_attention_2(plan, preparation) -> None:
    return None  # the kernel takes the slopes and causality itself


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


class AlibiAttentionBackends(SwitchableAttention):
    """What transformers reads off a model class about its attention, the same for every model on this core (mixed
    in before `PreTrainedModel`): SDPA, flex and FlashAttention-2 (the one flash implementation with an
    `alibi_slopes` argument), and every forward reads `config._attn_implementation`, so `set_attn_implementation`
    may switch backends at any time (`SwitchableAttention`)."""

    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _compatible_flash_implementations = ["flash_attention_2"]
