"""The one registry of ALiBi attention routes: each route declared once, with when `choose_path` picks it, the
`prepare` that builds its payload once per forward, and the `call` every layer runs.

`attention_plan.choose_path` (a pure function of a forward's facts) names the route; the dispatcher
(`attention_alibi.py`) plans with its `prepare` and runs its `call`. Every call takes `(query, key, value, plan,
scaling, layer)` with query (B, H, q, D) and key/value (B, H, kv, D), and returns ((B, q, H, D) output,
(B, H, q, kv) weights or None), only reading the plan; `layer` (the layer's index, as transformers' functions get
the module) matters to certified decoding alone. A composite route (packed rows' documents, continuous batching's
requests) runs its parts on their own routes through the `attend=` argument the dispatcher passes down, so no route
imports the dispatcher.
"""

from collections.abc import Callable
from dataclasses import dataclass

from .attention_certified import (
    flex_certified_alibi_attention,
    prepare_flex_attention_certified,
    prepare_sdpa_decode_certified,
    prepare_sdpa_split_certified,
    sdpa_decode_certified_attention,
    sdpa_split_certified_attention,
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
from .attention_paged import paged_alibi_attention, prepare_paged, prepare_paged_flash
from .attention_sdpa import prepare_sdpa_bank, sdpa_bank_attention
from .attention_sdpa_split import prepare_sdpa_split, sdpa_split_attention


@dataclass(frozen=True)
class AttentionRoute:
    """One route: its name (the plan's `path`), when `choose_path` picks it, and what runs it."""

    name: str
    when: str  # when `choose_path` picks it (its variants in brackets)
    prepare: Callable | None  # `prepare(plan, preparation)` -> the route's payload; None: no payload
    call: Callable  # `call(query, key, value, plan, scaling, layer)` (+ `attend=` for a composite route)
    composite: bool = False  # runs parts on their own routes through the dispatcher's `attend=`


def _route(name: str, when: str, prepare, call, composite: bool = False) -> tuple[str, AttentionRoute]:
    return name, AttentionRoute(name, when, prepare, call, composite)


ROUTES: dict[str, AttentionRoute] = dict(
    (
        _route(
            "eager",
            "attn_implementation='eager' or output_attentions: the fp32 reference, the only route with weights",
            prepare_eager,
            eager_alibi_attention,
        ),
        _route(
            "sdpa_split",
            "sdpa on CPU, more than one query row ending at the last key, no dropout, no tracing, the kernels' "
            "probe passed: the bias-free split on PyTorch's CPU flash kernels",
            prepare_sdpa_split,
            sdpa_split_attention,
        ),
        _route(
            "sdpa_split_certified",
            "the split with certified key skipping (alibi_skip_eps a number, or 'auto' where it pays); encoders too",
            prepare_sdpa_split_certified,
            sdpa_split_certified_attention,
        ),
        _route(
            "sdpa_bank",
            "sdpa otherwise: decoding rows, dropout, GPUs, traced graphs, alibi_sdpa_split=False (a bias per chunk "
            "of query rows)",
            prepare_sdpa_bank,
            sdpa_bank_attention,
        ),
        _route(
            "sdpa_decode_certified",
            "one decoding row that skips (segmented: CPU, batch 1, no dropout, probe passed)",
            prepare_sdpa_decode_certified,
            sdpa_decode_certified_attention,
        ),
        _route(
            "sdpa_mask",
            "sdpa with queries not ending at the last key as plain ints (static cache compiled, export): one mask",
            prepare_sdpa_mask,
            sdpa_mask_attention,
        ),
        _route(
            "flex_attention",
            "flex_attention (compiled: the fused kernel, on a GPU outside tracing)",
            prepare_flex_attention,
            flex_alibi_attention,
        ),
        _route(
            "flex_attention_certified",
            "flex_attention with certified skipping, outside tracing (compiled as above)",
            prepare_flex_attention_certified,
            flex_certified_alibi_attention,
        ),
        _route(
            "flash_attention_2",
            "flash_attention_2 without padding or packed rows (flash-attn's alibi_slopes)",
            None,  # the kernel takes the slopes and causality itself
            flash_alibi_attention,
        ),
        _route(
            "flash_attention_2_varlen",
            "flash_attention_2 with padding or packed rows: the real tokens only",
            prepare_flash_attention_2_varlen,
            flash_varlen_alibi_attention,
        ),
        _route(
            "paged",
            "continuous batching (a PagedAttentionCache): each request through its own route, dense decoding rows "
            "in one batched call",
            prepare_paged,
            paged_alibi_attention,
            composite=True,
        ),
        _route(
            "paged_flash_attention_2",
            "continuous batching on flash_attention_2 (kvcache: transformers hands the block tables)",
            prepare_paged_flash,
            paged_flash_alibi_attention,
        ),
        _route(
            "sdpa_packed",
            "packed rows on the split: each document alone, on its own route (dense or certified)",
            prepare_sdpa_packed,
            packed_alibi_attention,
            composite=True,
        ),
    )
)
PATHS = tuple(ROUTES)  # the route names, in the registry's order
