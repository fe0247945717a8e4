"""One ALiBi attention plan per forward: the facts every layer shares, the one function that chooses the route, and
the visibility every route's masks are built from (`visible_keys`).

The model plans once per forward (`attention_alibi.plan_alibi_attention`, continuous batching included):
`plan_facts` validates the raw inputs (the 2-D padding mask, packed-row `position_ids` or `cu_seq_lens`, the cache
length) and derives the masking facts; `choose_path`, a pure function of those facts, decides the whole `Route` (the
path, its variant, the eps it skips with, whether a static cache's count is read to the host, and the reason;
`output_attentions` and `"auto"` included); that route's `prepare` builds its small frozen payload (never sized by a
maximum length, never per layer, already in the layers' compute dtype). Every layer hands the frozen plan to
`alibi_attention`, which looks its route up in `attention_routes.ROUTES` (the one registry of routes: each route's
name, when `choose_path` picks it, its prepare and its call), the way transformers' `ALL_ATTENTION_FUNCTIONS` works.

Query row `r` sits at absolute position `query_offset + r`, where `query_offset` is the number of cached tokens (a
0-d tensor for static caches, so compiled decoding neither syncs nor recompiles). A key `j` is visible to query `i`
when `j <= i` (any `j` in a bidirectional plan, `AlibiAttentionPlan.causal` False: an encoder's `-m |i - j|`), it is
not padding, and it belongs to the same document (packed rows); the certified paths also leave
out, per head and block of query rows, the keys before the layer's own certified first key (and in a bidirectional
plan those from its certified end key on: `attention_skip.KeyRanges`). ALiBi
depends on `i - j` alone, so left padding needs no position shift and a packed document sees exactly the distances
it would see alone: masking is all it takes.
"""

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .packed_documents import document_lengths, documents_from_cu_seq_lens, packed_documents

# The attn_implementation names the model runs (the one list: the configs, `hf_alibi.serving` and the chooser read it)
SUPPORTED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2")
PAGED_PREFIX = "paged|"  # continuous batching's implementations (transformers names eager models "paged|eager")
# Rows per query chunk of the bias bank (the config's `alibi_sdpa_query_chunk`)
SDPA_QUERY_CHUNK = 256
# `alibi_skip_eps="auto"`'s eps where it skips (`attention_certified` says where that pays)
AUTO_EPS = 1e-7


@dataclass(frozen=True, eq=False)
class AlibiAttentionPlan:
    """What the layers of one forward share: the facts of its inputs, the chosen path, and that path's payload.

    Built once per forward (and once per tensor-parallel rank, `for_heads`) and never changed afterwards. The
    payload is the path's own frozen data (a bias, a bank, the split's calls, a block mask, varlen boundaries, the
    paged batch), built by its route's `prepare`; a route reads no other route's data.
    """

    path: str  # a key of `attention_routes.ROUTES`; "" for facts not yet given a route
    slopes: torch.Tensor  # (H,) fp32, the heads the layers' queries hold
    query_length: int
    key_length: int  # keys the layers read: a static cache's filled part outside compilation
    query_offset: int | torch.Tensor  # absolute position of the first query = cached tokens
    dropout: float = 0.0  # attention-probability dropout (the model's, in training)
    key_padding: torch.Tensor | None = None  # (B, kv) bool, True = real token; None = no padding
    documents: torch.Tensor | None = None  # (B, kv) document index of each token of packed rows; None = one each
    heads: slice | None = None  # the global heads `slopes` are (`for_heads`: a tensor-parallel rank's); None: all
    batch: int = 1
    causal: bool = True  # False: an encoder's bidirectional ALiBi, -m * |i - j| over every key (no cache)
    # `key_padding`'s source, the 2-D 0/1 mask as the caller gave it (when it covers the keys): FlexAttention's
    # mask_mod reads it, since torch 2.13's inductor cannot lower a mask_mod that reads a tensor computed inside the
    # compiled graph (`.bool()` of it included)
    attention_mask: torch.Tensor | None = None
    payload: object | None = None  # the path's data; `payload.for_heads(heads, plan)` slices it
    # `slopes` as (the model's slopes, a Python float divisor) when the length-dependent `alibi_scaling` divided them
    # by a number known at planning time: FlexAttention's score_mod reads those two inside a compiled model (inductor's
    # CPU flex template cannot lower a score_mod reading a tensor computed inside the graph, as the divided slopes
    # are there; outside one, flex's own compilation would make the number symbolic, which it refuses)
    scaled_from: tuple[torch.Tensor, float] | None = None
    route: "Route | None" = None  # what `choose_path` chose: `path`, its eps and variant, and why (`Route.reason`)

    def for_heads(self, heads: slice) -> "AlibiAttentionPlan":
        """The plan for the global heads `heads` only (a tensor-parallel rank's): slopes, ranges and the payload for
        those heads. The model builds it once per forward for all its layers (they hold the same heads)."""
        if not isinstance(heads, slice) or len(range(self.slopes.shape[0])[heads]) == 0:
            raise ValueError(f"heads={heads!r} must be a non-empty slice of the plan's {self.slopes.shape[0]} heads")
        if self.heads is not None:
            raise ValueError(f"this plan holds heads {self.heads!r} already; slice the forward's plan for {heads!r}")
        scaled_from = None if self.scaled_from is None else (self.scaled_from[0][heads], self.scaled_from[1])
        subset = replace(self, slopes=self.slopes[heads], heads=heads, payload=None, scaled_from=scaled_from)
        return subset if self.payload is None else replace(subset, payload=self.payload.for_heads(heads, subset))


@dataclass(frozen=True)
class PlanOptions:
    """How a forward asks to be planned beside its inputs: the config's switches and the model's state
    (`attention_alibi.plan_alibi_attention` documents each)."""

    dtype: torch.dtype = torch.float32  # the layers' compute dtype (autocast's, else the weights')
    dropout: float = 0.0  # attention-probability dropout (the model's, in training)
    sdpa_split: bool = True  # the config's `alibi_sdpa_split`
    query_chunk: int = SDPA_QUERY_CHUNK  # the config's `alibi_sdpa_query_chunk`
    skip_eps: float | str = 0.0  # the config's `alibi_skip_eps`: a number or "auto"
    output_attentions: bool = False  # weights asked for: the eager route
    train_seq_len: int | None = None  # the length-dependent `alibi_scaling`
    causal: bool = True  # False: an encoder's bidirectional ALiBi


class Preparation(NamedTuple):
    """What a route's `prepare(plan, preparation)` may read beside the plan's facts."""

    dtype: torch.dtype = torch.float32  # the layers' compute dtype: SDPA masks are cast to it once
    query_chunk: int = SDPA_QUERY_CHUNK  # sdpa_bank: rows per chunk
    skip_eps: float = 0.0  # the certified paths' eps
    key_norms: object | None = None  # certified decoding: a zero-argument function giving the cache's summary
    # sdpa_packed, paged: `plan_row(query_length, key_length)` plans one batch-1 row alone (a packed row's document,
    # a continuous batch's request) with the forward's options, through the one planner (passed down by it)
    plan_row: object | None = None
    segmented: bool = False  # sdpa_decode_certified: long key runs in segments on the CPU flash kernel
    compiled: bool = False  # flex_attention(_certified): FlexAttention's fused kernel
    implementation: str = "sdpa"  # paged: the backend each request is planned on
    options: PlanOptions | None = None  # paged: the forward's options (its decoding rows' rule and bias)
    paged_kwargs: dict | None = None  # paged: what transformers' continuous batching passed with the paged cache
    position_ids: torch.Tensor | None = None  # paged: checked against the requests' boundaries


def plan_facts(
    slopes: torch.Tensor,
    batch: int,
    query_length: int,
    key_length: int,
    query_offset=None,
    attention_mask=None,
    position_ids=None,
    cu_seq_lens=None,
    dropout: float = 0.0,
    tracing: bool = False,
    causal: bool = True,
) -> AlibiAttentionPlan:
    """One forward's inputs validated once and turned into facts (`plan_alibi_attention` documents the arguments)."""
    slopes = slopes.float()
    if query_offset is None:
        query_offset = key_length - query_length
    if not causal and not (isinstance(query_offset, int) and query_offset == 0):
        raise ValueError(f"bidirectional attention reads no cache, got {query_offset} cached tokens")
    key_padding = _key_padding(attention_mask, batch, query_offset, query_length, key_length, tracing)
    documents = _documents(position_ids, cu_seq_lens, attention_mask, batch, query_offset, query_length, tracing)
    given = attention_mask if key_padding is not None else None
    facts = AlibiAttentionPlan(
        "",
        slopes,
        query_length,
        key_length,
        query_offset,
        float(dropout),
        key_padding,
        documents,
        batch=batch,
        causal=causal,
        attention_mask=given,
    )
    # A static cache hands every layer its whole buffer and counts its tokens in a 0-d tensor. Outside compilation a
    # prefill (or any multi-row step) reads that count once, so its keys are the filled ones only: the rest are
    # unwritten and causally hidden, and a bias over them would cost (q, max_cache_len) per head. One-row steps keep
    # the tensor (their bias is per key anyway, and reading the count would sync a device on every decoding step)
    # unless `choose_path` routes them where the host offset is needed (`Route.host_offset`).
    return with_host_offset(facts) if query_length > 1 and not tracing else _settled(facts)


def with_host_offset(plan: AlibiAttentionPlan) -> AlibiAttentionPlan:
    """`plan` with a static cache's 0-d count read to the host and its keys cut to the filled ones."""
    if isinstance(plan.query_offset, torch.Tensor):
        plan = replace(plan, query_offset=int(plan.query_offset))
    return _settled(plan)


def _settled(plan: AlibiAttentionPlan) -> AlibiAttentionPlan:
    """Keys cut to a static cache's filled part where the offset is a plain int; the given mask kept where it covers
    the keys (FlexAttention's mask_mod reads it)."""
    filled = plan.query_offset + plan.query_length if isinstance(plan.query_offset, int) else plan.key_length
    if _is_static(filled) and _is_static(plan.key_length) and filled < plan.key_length:
        padding = None if plan.key_padding is None else plan.key_padding[:, :filled]
        plan = replace(plan, key_length=filled, key_padding=padding)  # `alibi_attention` reads keys [0, filled)
    given = plan.attention_mask
    if given is not None and (plan.key_padding is None or given.shape[-1] != plan.key_length):
        plan = replace(plan, attention_mask=None)
    return plan


@dataclass(frozen=True)
class Route:
    """Everything `choose_path` decides for one forward (or one request, one document): the path, the eps it skips
    with, whether the plan needs a static cache's 0-d count on the host first (`with_host_offset`), the path's
    variant (its payload carries it; the path's one function reads it), and why it was chosen (`reason`, not part of
    a route's identity)."""

    path: str  # a key of `attention_routes.ROUTES`
    eps: float = 0.0  # certified skipping's eps; 0.0 on every path that does not skip
    host_offset: bool = False
    segmented: bool = False  # sdpa_decode_certified: one row of batch 1 spread over threads in key segments
    compiled: bool = False  # flex_attention(_certified): FlexAttention's fused kernel (an eager model on a GPU)
    kvcache: bool = False  # paged_flash_attention_2: the paged kernel reads the cache's blocks (decode fast path)
    reason: str = field(default="", compare=False)


def choose_path(
    implementation: str,
    plan: AlibiAttentionPlan,
    device: str,
    tracing: bool,
    sdpa_split: bool = True,
    skip_eps: float | str = 0.0,
    kernels_work=None,
    paged: bool = False,
    block_table: bool = False,
    skip_pays=None,
    output_attentions: bool = False,
) -> Route:
    """The route for a backend and a plan's facts (module docstring): the only function that chooses one, and a pure
    one (it reads its arguments alone).

    `skip_eps > 0` (the config's `alibi_skip_eps`) asks for certified key skipping; it applies outside tracing, on
    the split (training too), on packed rows (each document alone), on FlexAttention and on one-row plain-int steps. `"auto"` skips on the `sdpa` backend on CPU where `skip_pays(slopes, query_length, key_length)` (the
    measured rule, `attention_certified.skipping_pays`) says so for this shape, in training as at inference; a
    packed row's shape is each document's. The same rule holds for a decoding row under `generate()` and for each
    request of a continuous batch (`attention_paged.py` asks per request). `kernels_work` (the split's probe) is
    called only when it matters; None (no probe) and `skip_pays` None (no rule) mean "not applicable": no split,
    `"auto"` never skips. `paged`: continuous batching's flattened row of requests; `block_table`:
    transformers hands the paged kernel its block tables (the FlashAttention-2 decode fast path).
    `output_attentions`: weights come from the eager path alone. A bidirectional plan (`plan.causal` False: an
    encoder) refuses continuous batching, and skips on the split alone (each document of packed rows too), with a
    window of keys on both sides of each block (`attention_certified.certified_split`; `"auto"` by its own measured
    rule, `skip_pays(slopes, q, kv, False)`); FlexAttention runs it dense.
    """
    if not plan.causal and paged:
        raise ValueError("continuous batching (a paged cache) serves causal decoders; this plan is bidirectional")
    if paged:
        if implementation != "flash_attention_2":
            return Route("paged", reason="continuous batching (a paged cache): each request through its own route")
        fast = " with the block tables (decode fast path)" if block_table else ""
        return Route(
            "paged_flash_attention_2", kvcache=block_table, reason=f"continuous batching on FlashAttention-2{fast}"
        )
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported by ALiBi GPT-2; choose one of "
            f"{SUPPORTED_ATTENTION}"
        )
    if output_attentions:
        implementation = "eager"
    eps = _skip_eps(implementation, plan, device, tracing, skip_eps, skip_pays)
    host = (
        isinstance(plan.query_offset, torch.Tensor)
        and not tracing
        and (eps > 0 or implementation == "flash_attention_2")
    )
    if host:
        plan = with_host_offset(plan)
    path, reason = _path(implementation, plan, device, tracing, sdpa_split, eps > 0, kernels_work)
    if output_attentions:
        reason = "output_attentions: weights come from the eager path alone"
    skipping = "certified" in path or path == "sdpa_packed"
    compiled = path.startswith("flex_attention") and device == "cuda" and not tracing
    # one row of batch 1 cannot spread over threads (the kernel splits work by batch, heads and query rows)
    segmented = (
        path == "sdpa_decode_certified"
        and device == "cpu"
        and plan.dropout == 0.0
        and plan.batch == 1
        and kernels_work is not None
        and (kernels_work())
    )
    if skipping and eps > 0:  # the reason names the eps (and "auto": the measured rule said it pays)
        reason += f" (skip eps {eps:g}{', alibi_skip_eps=auto: the rule says it pays' if skip_eps == 'auto' else ''})"
    host_offset = host and isinstance(plan.query_offset, int)
    return Route(path, eps if skipping else 0.0, host_offset, segmented, compiled, reason=reason)


def _skip_eps(implementation, plan, device, tracing, skip_eps, skip_pays) -> float:
    """The eps a route may skip with: the config's number, or for `"auto"` `AUTO_EPS` where the rule says it pays."""
    if tracing:
        return 0.0
    if skip_eps != "auto":
        return float(skip_eps)
    if implementation != "sdpa" or device != "cpu" or skip_pays is None:
        return 0.0
    rule = skip_pays if plan.causal else lambda slopes, q, kv: skip_pays(slopes, q, kv, False)
    if plan.documents is not None:  # packed rows: each document is a row of its own
        lengths = [n for row in document_lengths(plan.documents) for n in row]
        pays = any(rule(plan.slopes, n, n) for n in lengths)
    else:
        key_length = plan.key_length
        if isinstance(plan.query_offset, torch.Tensor):  # a static cache's step: its filled keys
            key_length = int(plan.query_offset) + plan.query_length
        pays = rule(plan.slopes, plan.query_length, key_length)
    return AUTO_EPS if pays else 0.0


def _path(implementation, plan, device, tracing, sdpa_split, skip, kernels_work) -> tuple[str, str]:
    """The path, and why."""
    if implementation == "eager":
        return "eager", "attn_implementation='eager': the fp32 reference"
    if implementation == "flash_attention_2":
        if plan.key_padding is None and plan.documents is None:
            return "flash_attention_2", "flash_attention_2 without padding or packed rows"
        return "flash_attention_2_varlen", "flash_attention_2 with padding or packed rows: the real tokens only"
    if implementation == "flex_attention":
        if tracing and device == "cpu" and plan.documents is not None:
            # torch 2.13's CPU inductor lowers a mask_mod over document indices the graph computed itself, but on
            # AVX2 (AMD EPYC) the fused kernel it builds returns wrong rows; a compiled packed row takes the one mask
            return "sdpa_mask", "flex_attention on packed rows in a compiled CPU graph: the one mask"
        if skip and plan.causal:
            return "flex_attention_certified", "flex_attention with certified skipping"
        return "flex_attention", "attn_implementation='flex_attention'"
    bottom_right = (  # plain ints and queries that end at the last key: no cache, dynamic, static outside compile
        isinstance(plan.query_offset, int)
        and _is_static(plan.query_length)
        and _is_static(plan.key_length)
        and plan.query_offset + plan.query_length == plan.key_length
    )
    if not bottom_right:
        return "sdpa_mask", "sdpa with queries that do not end at the last key as plain ints (static cache, export)"
    if plan.query_length == 1:  # a decoding row: its bank row is already a per-key bias, one public call
        if skip:
            return "sdpa_decode_certified", "sdpa, one decoding row with certified skipping"
        return "sdpa_bank", "sdpa, one decoding row: its per-key bias in one call"
    no_split = [why for why, bar in _NO_SPLIT if bar(plan, device, tracing, sdpa_split)]
    if no_split:
        return "sdpa_bank", f"sdpa, several rows, {no_split[0]}: the bias bank"
    if not (kernels_work is not None and kernels_work()):
        return "sdpa_bank", "sdpa, several rows, the CPU flash kernels' probe failed: the bias bank"
    if plan.documents is not None:  # packed rows: each document alone (its keys only, not a mask over the whole row)
        return "sdpa_packed", "sdpa on CPU, packed rows: each document alone on its own route"
    if skip:
        return "sdpa_split_certified", "sdpa on CPU, several rows ending at the last key, with certified skipping"
    return "sdpa_split", "sdpa on CPU, several rows ending at the last key, no dropout: the bias-free split"


# What keeps a multi-row sdpa step off the split (the CPU flash kernel has no dropout; traced graphs keep to public ops)
_NO_SPLIT = (
    ("alibi_sdpa_split=False", lambda plan, device, tracing, sdpa_split: not sdpa_split),
    ("dropout", lambda plan, device, tracing, sdpa_split: plan.dropout != 0.0),
    ("not on CPU", lambda plan, device, tracing, sdpa_split: device != "cpu"),
    ("a traced graph", lambda plan, device, tracing, sdpa_split: tracing),
)


def _is_static(length) -> bool:
    """True for a plain int; False for a symbolic length (torch.export / dynamic-shape compile)."""
    return isinstance(length, int) and not isinstance(length, torch.SymInt)


def mask_in_dtype(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float mask in `dtype`; clamped first, since fp32's minimum becomes -inf in fp16 (a row of -inf is NaN)."""
    if mask.dtype == dtype:
        return mask
    return mask.clamp(min=torch.finfo(dtype).min).to(dtype) if dtype.itemsize < 4 else mask.to(dtype)


def _key_padding(attention_mask, batch, query_offset, query_length, key_length, tracing):
    """The 2-D 0/1 mask, validated once, as (B, kv) bool; None when nothing is padded (checked only in eager mode)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (batch, keys) of 0/1, got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[0] != batch:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but the input has batch {batch}")
    # Cached plus new tokens; a static cache also takes a mask as long as its buffer (generate pads it so).
    length = attention_mask.shape[1]
    if isinstance(query_offset, int) and length not in (query_offset + query_length, key_length):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}: it must cover the {query_offset} cached and "
            f"{query_length} new tokens ({query_offset + query_length} positions)"
        )
    if length > key_length:
        raise ValueError(f"attention_mask covers {length} positions but there are only {key_length} keys")
    if length < key_length:  # a static cache longer than the mask: causality hides the rest
        attention_mask = F.pad(attention_mask, (0, key_length - length), value=1)
    # An all-ones mask (what Trainer sends) costs nothing to drop in eager mode; a compiled graph keeps it.
    if not tracing and bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def _documents(position_ids, cu_seq_lens, attention_mask, batch, query_offset, query_length, tracing):
    """(B, q) document index of packed rows, from `cu_seq_lens` or restarting `position_ids`; None: one each."""
    uncached = isinstance(query_offset, int) and query_offset == 0
    if cu_seq_lens is not None:
        if batch != 1 or not uncached:
            raise ValueError(f"cu_seq_lens_q describes one flattened row without a cache, got batch {batch}")
        return documents_from_cu_seq_lens(cu_seq_lens, query_length, tracing)
    if position_ids is None or attention_mask is not None or not uncached:
        return None
    if position_ids.shape[-1] != query_length:
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)} but the input has {query_length} tokens")
    return packed_documents(position_ids, batch)


def visible_keys(plan: AlibiAttentionPlan, rows: slice = slice(None), keys: slice = slice(None)):
    """Padding and document visibility for query `rows` and `keys`: bool (B|1, 1|q'|1, kv'), or None.

    Causality is not included: the bias carries it.
    """
    keep = None
    if plan.key_padding is not None:
        keep = plan.key_padding[:, None, None, keys]  # (B, 1, 1, kv')
    if plan.documents is not None:
        same = plan.documents[:, None, rows, None] == plan.documents[:, None, None, keys]  # (B, 1, q', kv')
        keep = same if keep is None else keep & same
    return keep
