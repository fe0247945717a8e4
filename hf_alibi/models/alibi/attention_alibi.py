"""ALiBi attention on every backend: one planner, one chooser, one registry of routes, one dispatcher.

`plan_alibi_attention` turns a forward's inputs into its `AlibiAttentionPlan` (`attention_plan.py`: the facts, and
`choose_path`, the pure function that picks a route and says why), then builds the route's payload with that route's
`prepare` (`attention_routes.ROUTES`, the one registry). `alibi_attention` is what a layer calls with its queries,
keys, values and the plan: it runs the route's `call`, and hands a composite route (packed rows' documents,
continuous batching's requests) `attend=`, itself, for the parts. Continuous batching is planned by the same planner
(`paged_kwargs=`); `paged_attention` writes a layer's keys to the paged cache, then attends.
"""

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from .alibi_bias import length_scaled_slopes
from .attention_certified import skipping_pays
from .attention_paged import PagedPlan, paged_facts
from .attention_plan import (
    AlibiAttentionPlan,
    PlanOptions,
    Preparation,
    _is_static,
    choose_path,
    plan_facts,
    with_host_offset,
)
from .attention_routes import ROUTES
from .cpu_flash_kernels import split_kernels_work
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
    options: PlanOptions | None = None,
    *,
    key_norms=None,
    paged_kwargs: dict | None = None,
    prepare: bool = True,
    **option_values,
) -> AlibiAttentionPlan:
    """Validate one forward's inputs and build its plan for `implementation` (one of `SUPPORTED_ATTENTION`).

    `attention_mask` is the usual 2-D (B, kv) mask of 1 (real) and 0 (padding), or None. `query_offset` is the
    number of cached tokens (default `key_length - query_length`). Packed rows are described by `position_ids` that
    restart (read only without a mask and without cached tokens, as transformers' models do) or by flash-attention
    style `cu_seq_lens` of one flattened row. `options` (`PlanOptions`, or its fields as keywords, `option_values`,
    which override it) hold the rest: `dtype` is the layers' compute dtype (autocast's, else the weights'): SDPA
    masks are built in it once; `dropout` the attention-probability dropout; `sdpa_split=False` sends the calls the split would serve to the bias bank,
    whose chunks have `query_chunk` rows (the config's `alibi_sdpa_split` and `alibi_sdpa_query_chunk`).
    `skip_eps` (the config's `alibi_skip_eps`: `"auto"` or a number) asks for certified key skipping
    (`choose_path` says where it applies); a decoding step that skips reads the running key-norm summary of its cache
    (`attention_key_norms.RunningKeyNorms`) from `key_norms`, a function called only then.
    `output_attentions` plans the eager path, the one that returns weights. `train_seq_len` (the config's
    length-dependent `alibi_scaling`) divides the slopes by max(1, K / n) here, once, K = cached + new keys (a static
    cache's filled part, not its buffer): every path, certified skipping and its rule read the scaled slopes; a
    packed row's documents keep the row's scale, as the source computes it from the forward's key count.
    `causal=False` plans an encoder's bidirectional ALiBi, `-m * |i - j|` over every key (no cache).
    `paged_kwargs` (what transformers' continuous batching passes with a `PagedAttentionCache`,
    `attention_paged.PAGED_KWARGS`) plans one flattened row of `query_length` tokens of requests, `position_ids`
    each request's positions (`attention_paged.py`). `prepare=False` stops at the route (the plan's `path` and
    `route` with its reason, no payload but a composite route's list of parts, each route-only): what
    `hf_alibi.attention_route` reads.
    """
    options = replace(options or PlanOptions(), **option_values)
    if paged_kwargs is not None:
        return _plan_paged(implementation, slopes, query_length, position_ids, paged_kwargs, options, prepare)

    tracing = torch.compiler.is_compiling()  # the one place that asks: compiled graphs never branch on data
    slopes, scaled_from = _scaled_slopes(slopes, key_length, query_offset, query_length, options.train_seq_len)
    facts = plan_facts(
        slopes,
        batch,
        query_length,
        key_length,
        query_offset,
        attention_mask,
        position_ids,
        cu_seq_lens,
        options.dropout,
        tracing=tracing,
        causal=options.causal,
    )
    route = choose_path(
        implementation,
        facts,
        device=slopes.device.type,
        tracing=tracing,
        sdpa_split=options.sdpa_split,
        skip_eps=options.skip_eps,
        kernels_work=split_kernels_work,
        skip_pays=skipping_pays,
        output_attentions=options.output_attentions,
    )
    facts = with_host_offset(facts) if route.host_offset else facts
    # a packed row's documents: uncached rows of their own at the row's (scaled) slopes, with the row's switches
    part = replace(options, dropout=0.0, output_attentions=False, train_seq_len=None)
    plan_row = partial(_plan_row, slopes, part, prepare)
    preparation = Preparation(
        options.dtype,
        options.query_chunk,
        route.eps,
        key_norms,
        plan_row,
        route.segmented,
        route.compiled,
        implementation,
    )
    return _routed(replace(facts, scaled_from=scaled_from), route, preparation, prepare)


def _scaled_slopes(slopes, key_length, query_offset, query_length, train_seq_len):
    """The slopes every route reads, divided by max(1, K / n) for the length-dependent `alibi_scaling` (K: a 0-d
    tensor for a static cache, a tensor op: no host sync when compiled), and `scaled_from` (`AlibiAttentionPlan`)."""
    if train_seq_len is None:
        return slopes, None
    filled = key_length if query_offset is None else query_offset + query_length  # K: cached + new keys
    unscaled, scaled = slopes.float(), length_scaled_slopes(slopes.float(), filled, train_seq_len)  # (H,)
    if isinstance(filled, int) and filled > train_seq_len:
        return scaled, (unscaled, filled / train_seq_len)  # length_scaled_slopes' divisor, as a number
    return scaled, None


@torch.compiler.disable  # host reads of the boundaries: kept out of compiled graphs, as transformers keeps its cache's
def _plan_paged(implementation, slopes, query_length, position_ids, paged_kwargs, options, prepare):
    """A continuous-batching forward's plan: each request planned as a batch-1 cached row of its own (`plan_row`),
    with its own key count's slopes (`train_seq_len`); the flattened plan keeps the unscaled slopes."""
    implementation, facts = paged_facts(implementation, slopes, query_length, paged_kwargs)
    block_table = paged_kwargs.get("block_table") is not None
    route = choose_path(
        implementation, facts, facts.slopes.device.type, tracing=False, paged=True, block_table=block_table
    )
    part = replace(options, dropout=0.0, output_attentions=False, causal=True)  # each request: a cached decoder row
    plan_row = partial(_plan_row, facts.slopes, part, prepare)
    preparation = Preparation(
        part.dtype,
        part.query_chunk,
        plan_row=plan_row,
        implementation=implementation,
        options=part,
        paged_kwargs=paged_kwargs,
        position_ids=position_ids,
    )
    return _routed(facts, route, preparation, prepare)


def _routed(facts, route, preparation, prepare: bool) -> AlibiAttentionPlan:
    """The plan on `route`: its path and route, and (`prepare`) the payload its registry entry prepares; without
    `prepare`, a composite route's payload still lists its parts, each with its route-only plan."""
    entry = ROUTES[route.path]
    build = entry.prepare is not None and (prepare or entry.composite)  # a composite's parts: route-only plans
    plan = replace(facts, path=route.path, route=route, payload=entry.prepare(facts, preparation) if build else None)
    payload = plan.payload
    if isinstance(payload, PagedPlan) and payload.key_length is not None:
        plan = replace(plan, key_length=payload.key_length)  # every request's keys
    return plan


def _plan_row(slopes, options, prepare, implementation, query_length, key_length) -> AlibiAttentionPlan:
    """The plan of one batch-1 row of its own, `query_length` new tokens over `key_length` keys (its cached tokens
    first): a packed row's document or a continuous batch's request (`Preparation.plan_row`)."""
    return plan_alibi_attention(
        implementation, slopes, 1, query_length, key_length, key_length - query_length, options=options, prepare=prepare
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
    The output is a tensor of the call's own, never a view of its inputs: a layer may overwrite it.

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
    route = ROUTES[plan.path]
    if route.composite:  # its parts on their own routes, through this function
        output, weights = route.call(query, key, value, plan, scaling, layer, attend=_attend)
    else:
        output, weights = route.call(query, key, value, plan, scaling, layer)
    if not output_attentions:
        return output, None
    if weights.shape[-1] < buffer:
        weights = F.pad(weights, (0, buffer - weights.shape[-1]))  # (B, H, q, buffer)
    return output, weights


def _attend(query, key, value, plan, scaling, layer):
    """What a composite route runs each part through (`attend=`): the dispatcher itself."""
    return alibi_attention(query, key, value, plan, scaling, layer=layer)


@torch.compiler.disable  # the plan's per-request host ints and the cache's views run eagerly (transformers' own
def paged_attention(cache, query, key, value, plan: AlibiAttentionPlan, scaling: float, layer: int, heads=None):
    """One layer under continuous batching: write its new keys and values to the paged cache, then attend every
    request's rows to its own keys. Returns ((1, T, H', D) output, None).

    Like transformers' `PagedAttentionCache.update` (`torch.compiler.disable`), it runs outside compiled graphs:
    the plan it carries out holds each request's boundaries as host ints, which a graph would bake in.
    """
    key, value, plan = plan.payload.update_cache(cache, key, value, layer, plan)  # (1, H', K, D)
    return alibi_attention(query, key, value, plan, scaling, heads=heads, layer=layer)


class AlibiAttentionBackends(SwitchableAttention):
    """What transformers reads off a model class about its attention, the same for every model on this core (mixed
    in before `PreTrainedModel`): SDPA, flex and FlashAttention-2 (the one flash implementation with an
    `alibi_slopes` argument), and every forward reads `config._attn_implementation`, so `set_attn_implementation`
    may switch backends at any time (`SwitchableAttention`)."""

    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_flash_attn = True
    _compatible_flash_implementations = ["flash_attention_2"]
