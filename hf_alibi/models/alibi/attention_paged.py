"""ALiBi under transformers' continuous batching: one plan per forward over a flattened batch of requests.

`generate_batch()`, `init_continuous_batching()` and `transformers serve --continuous-batching` run the model on a
`PagedAttentionCache`: one row (1, T) that concatenates every scheduled request's new tokens (a prompt, a chunk of a
long prompt, or one decoding token), described by `cu_seq_lens_q` (T's request boundaries) and `cu_seq_lens_k` (the
boundaries of the keys that `cache.update` returns: each request's cached tokens then its new ones, in order). The
mask transformers builds for that call is block-diagonal and causal but carries no bias, so the model plans its own.

A request's distances are its own: request r has q_r new tokens and k_r keys, its queries sit at positions
k_r - q_r .. k_r - 1 of that request (bottom-right alignment, as with a dynamic cache) and its keys at 0 .. k_r - 1,
so attention within it is exactly a batch-1 cached forward with query offset k_r - q_r. The plan uses that:
- a request with several new tokens (a prompt or a prompt's chunk) is a `PagedSegment`: its rows, its key slice and
  an ordinary `AlibiAttentionPlan` for batch 1 (the split, the bias bank, certified skipping: whatever
  `plan_alibi_attention` chooses for that shape);
- the decoding rows that `choose_path` routes to a dense path (the rule `generate()`'s decoding step follows, asked
  per request: `"auto"` skips a long enough one) go to one batched call (`PagedDecode`): their keys gathered into
  (n, H, K_max, D) and one (n, H, 1, K_max) bias, so n decoding requests cost one kernel call over n * K_max keys
  rather than n calls (or one call over every request's keys, as a block-diagonal mask over the whole batch
  would). A decoding row that skips is a segment of its own, so that it skips its own far keys.
FlashAttention-2 needs none of this: its varlen and paged kernels take the boundaries and `alibi_slopes` directly.
With the length-dependent `alibi_scaling` each request's slopes are those of its own key count k_r, as alone (the
segments' plans, the decoding rows' bias, FlashAttention-2's per-sequence `alibi_slopes`).
The model's one planner plans it (`plan_alibi_attention(paged_kwargs=...)`): `paged_facts` checks the call, the
route's prepare (`prepare_paged`, `prepare_paged_flash`) plans each request through the `plan_row` it is handed, and
`paged_alibi_attention`, a composite route, runs each part through the dispatcher's `attend=`.
"""

from dataclasses import dataclass, replace

import torch

from .alibi_bias import length_scaled_slopes
from .attention_certified import skipping_pays
from .attention_plan import PAGED_PREFIX, AlibiAttentionPlan, choose_path, mask_in_dtype, plan_facts
from .attention_sdpa import BiasBank
from .cpu_flash_kernels import split_kernels_work
from .transformers_compat import PagedAttentionCache, check_continuous_batching

# What transformers' continuous batching hands the model beside `position_ids` (continuous_batching/input_outputs.py)
PAGED_KWARGS = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "read_index",
    "write_index",
    "block_table",
)
PAGED_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")


def is_paged_cache(cache) -> bool:
    """True for transformers' continuous-batching cache (it is not a `Cache`: no `get_seq_length`)."""
    return isinstance(cache, PagedAttentionCache)


@dataclass(frozen=True, eq=False)
class PagedSegment:
    """One request's new rows [row_start, row_end) of the flattened batch over its keys [key_start, key_end)."""

    row_start: int
    row_end: int
    key_start: int
    key_end: int
    plan: AlibiAttentionPlan  # batch 1, query offset = its cached tokens


@dataclass(frozen=True, eq=False)
class PagedDecode:
    """The decoding rows of n requests as one batched call: row `rows[i]` attends keys `key_index[i]` (padded)."""

    rows: torch.Tensor  # (n,) int64 rows of the flattened batch
    key_index: torch.Tensor  # (n * K_max,) int64 rows of the returned keys, each request's padded by its last key
    plan: AlibiAttentionPlan  # payload (n, H, 1, K_max): each request's per-key ALiBi bias, its padding masked


@dataclass(frozen=True, eq=False)
class PagedPlan:
    """The flattened batch: what `cache.update` needs, and how its rows attend (module docstring)."""

    cache_kwargs: dict  # the continuous-batching kwargs `PagedAttentionCache.update` reads (copied per layer)
    total_rows: int
    segments: tuple[PagedSegment, ...] = ()
    decode: PagedDecode | None = None
    # flash_attention_2: the boundaries as tensors (no host sync), and the paged kernel's cache after `update_cache`
    cu_seq_lens_q: torch.Tensor | None = None
    max_length_q: int = 0
    kernel_cache: tuple | None = None  # (k_cache, v_cache, block_table, cu_seq_lens_k) of the decode fast path
    kvcache: bool = False  # paged_flash_attention_2's decode fast path (`Route.kvcache`): the kernel reads the blocks
    train_seq_len: int | None = None  # the length-dependent `alibi_scaling`: FlashAttention-2's slopes per request
    key_length: int | None = None  # `paged`: every request's keys together (the plan's key length)

    def update_cache(self, cache, key, value, layer_idx: int, plan: AlibiAttentionPlan):
        """Write this layer's new keys and values; return every request's keys (1, H', K, D) and the layer's plan.

        The paged cache rewrites the kwargs it is given (per layer), so each layer passes its own copy. On the
        FlashAttention-2 decode fast path the cache returns the new keys only and the kernel reads its blocks.
        """
        kwargs = dict(self.cache_kwargs)
        key, value = cache.update(key, value, layer_idx, kwargs)  # (1, H', K, D)
        if not self.kvcache:
            return key, value, plan
        fast = (kwargs["k_cache"], kwargs["v_cache"], kwargs["block_table"], kwargs["cu_seq_lens_k"])
        return key, value, replace(plan, payload=replace(self, kernel_cache=fast))

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan | None = None) -> "PagedPlan":
        """The payload for a tensor-parallel rank's global heads `heads`."""
        segments = tuple(replace(s, plan=s.plan.for_heads(heads)) for s in self.segments)
        decode = None if self.decode is None else replace(self.decode, plan=self.decode.plan.for_heads(heads))
        return replace(self, segments=segments, decode=decode)


def paged_facts(implementation: str, slopes: torch.Tensor, query_length: int, paged_kwargs: dict):
    """The backend each request runs on and the facts of one continuous-batching forward over `query_length`
    flattened tokens (module docstring), its arguments checked: `paged_kwargs` are the keyword arguments
    transformers passed with the paged cache (`PAGED_KWARGS`). `plan_alibi_attention(paged_kwargs=...)` plans it."""
    check_continuous_batching()
    implementation = implementation.removeprefix(PAGED_PREFIX)
    if implementation not in PAGED_IMPLEMENTATIONS:
        raise ValueError(
            f"continuous batching runs ALiBi GPT-2 on {PAGED_IMPLEMENTATIONS}, not attn_implementation="
            f"{implementation!r}: load the model with one of those"
        )
    _cache_kwargs(paged_kwargs)  # checked before anything is chosen
    return implementation, AlibiAttentionPlan("", slopes.float(), query_length, query_length, 0)  # one flattened row


def prepare_paged_flash(plan, preparation) -> "PagedPlan":
    """`paged_flash_attention_2`: FlashAttention-2 takes the boundaries as they are."""
    cache_kwargs, _ = _cache_kwargs(preparation.paged_kwargs)
    return PagedPlan(
        cache_kwargs,
        plan.query_length,
        cu_seq_lens_q=cache_kwargs["cu_seq_lens_q"],
        max_length_q=int(preparation.paged_kwargs.get("max_length_q") or plan.query_length),
        train_seq_len=preparation.options.train_seq_len,
        kvcache=preparation.paged_kwargs.get("block_table") is not None,
    )


@torch.compiler.disable  # host reads of the boundaries: kept out of compiled graphs, as transformers keeps its cache's
def prepare_paged(plan, preparation) -> "PagedPlan":
    """`paged`: each request's own batch-1 plan (through `preparation.plan_row`, the one planner) or its place in
    the batched decoding call. `position_ids` (1, T), each request's positions, are checked against the boundaries
    they must agree with. With the length-dependent `alibi_scaling` each request's slopes are scaled by its own key
    count, as if it ran alone; the flattened plan keeps the unscaled slopes."""
    cache_kwargs, cu_k = _cache_kwargs(preparation.paged_kwargs)
    cu_q_list, cu_k_list = cache_kwargs["cu_seq_lens_q"].tolist(), cu_k.tolist()  # one host read per forward
    _check_boundaries(cu_q_list, cu_k_list, plan.query_length, preparation.position_ids)
    base = "eager" if preparation.implementation == "eager" else "sdpa"
    options = preparation.options
    segments, decoding = _request_plans(base, plan.slopes, cu_q_list, cu_k_list, options, preparation.plan_row)
    decode = _decode_group(base, plan.slopes, decoding, options.dtype, options.train_seq_len) if decoding else None
    return PagedPlan(cache_kwargs, plan.query_length, tuple(segments), decode, key_length=cu_k_list[-1])


def _cache_kwargs(paged_kwargs: dict) -> tuple[dict, torch.Tensor]:
    """The kwargs `PagedAttentionCache.update` reads, checked, and the keys' boundaries `cu_seq_lens_k`."""
    missing = [
        name for name in ("cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index") if name not in paged_kwargs
    ]
    if missing:
        raise ValueError(f"a PagedAttentionCache forward needs the continuous-batching arguments {missing}")
    cache_kwargs = {name: paged_kwargs.get(name) for name in PAGED_KWARGS}
    cu_k = cache_kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):
        if set(cu_k) != {"full_attention"}:
            raise ValueError(f"ALiBi GPT-2 has full-attention layers only, got cache layer types {sorted(cu_k)}")
        cu_k = cu_k["full_attention"]
    return cache_kwargs, cu_k


def _request_plans(base, slopes, cu_q_list, cu_k_list, options, plan_row):
    """Each request's own batch-1 plan (`PagedSegment`), except dense decoding rows, returned as (row, (key start,
    key end)) for one batched call (`_decode_group`)."""
    segments, decoding = [], []
    for request in range(len(cu_q_list) - 1):
        rows = (cu_q_list[request], cu_q_list[request + 1])
        keys = (cu_k_list[request], cu_k_list[request + 1])
        q_len, k_len = rows[1] - rows[0], keys[1] - keys[0]
        if q_len == 0:  # a padding entry (static shapes): no rows
            continue
        request_slopes = length_scaled_slopes(slopes, k_len, options.train_seq_len)  # (H,): its own K, as alone
        if q_len == 1 and _decodes_dense(base, request_slopes, k_len, options.sdpa_split, options.skip_eps):
            decoding.append((rows[0], keys))  # dense decoding rows share one batched call
            continue
        segments.append(PagedSegment(*rows, *keys, plan_row(base, q_len, k_len)))
    return segments, decoding


def _decodes_dense(implementation: str, slopes, key_length: int, sdpa_split: bool, skip_eps) -> bool:
    """Whether `choose_path` routes a request's decoding row over `key_length` keys to a dense path, as it would
    that row under `generate()` (a batch-1 step of a dynamic cache): the same rule, asked per request."""
    facts = plan_facts(slopes, 1, 1, key_length, key_length - 1)
    route = choose_path(
        implementation,
        facts,
        slopes.device.type,
        tracing=False,
        sdpa_split=sdpa_split,
        skip_eps=skip_eps,
        kernels_work=split_kernels_work,
        skip_pays=skipping_pays,
    )
    return route.eps == 0.0


def _check_boundaries(cu_q: list[int], cu_k: list[int], query_length: int, position_ids) -> None:
    """Each request has at least as many keys as new tokens, and its new tokens sit at its last positions."""
    if len(cu_q) != len(cu_k) or cu_q[0] != 0 or cu_k[0] != 0 or cu_q[-1] > query_length:
        raise ValueError(
            f"inconsistent continuous-batching boundaries cu_seq_lens_q={cu_q}, cu_seq_lens_k={cu_k} "
            f"for {query_length} tokens"
        )
    for request in range(len(cu_q) - 1):
        q_len, k_len = cu_q[request + 1] - cu_q[request], cu_k[request + 1] - cu_k[request]
        if q_len < 0 or k_len < q_len:
            raise ValueError(
                f"request {request} has {q_len} new tokens but {k_len} keys (cu_seq_lens_q={cu_q}, "
                f"cu_seq_lens_k={cu_k})"
            )
    if position_ids is None or cu_q[-1] == 0:
        return
    lengths = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])])  # (R,)
    offsets = torch.tensor([(kb - ka) - (qb - qa) for qa, qb, ka, kb in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])])
    starts = torch.tensor(cu_q[:-1])
    expected = torch.arange(cu_q[-1]) - torch.repeat_interleave(starts - offsets, lengths)  # (T',)
    given = position_ids.reshape(-1)[: cu_q[-1]].cpu().long()
    if not torch.equal(given, expected):
        raise ValueError(
            "position_ids disagree with the continuous-batching boundaries: each request's new tokens must sit at "
            f"its last positions ({expected.tolist()[:16]}... expected, got {given.tolist()[:16]}...)"
        )


def _decode_group(implementation: str, slopes, decoding: list, dtype, train_seq_len=None) -> PagedDecode:
    """One batched call for n decoding rows: keys gathered and padded to the longest, per-key bias, padding masked;
    each request's slopes scaled by its own key count (`train_seq_len`)."""
    device = slopes.device
    rows = torch.tensor([row for row, _ in decoding], device=device)  # (n,)
    starts = torch.tensor([keys[0] for _, keys in decoding], device=device)  # (n,)
    lengths = torch.tensor([keys[1] - keys[0] for _, keys in decoding], device=device)  # (n,)
    longest = int(lengths.max())
    offset = torch.arange(longest, device=device)  # (K_max,)
    key_index = starts[:, None] + torch.minimum(offset[None, :], lengths[:, None] - 1)  # (n, K_max)
    distance = (lengths - 1)[:, None] - offset[None, :]  # (n, K_max): i - j, negative past the request's keys
    per_request = length_scaled_slopes(slopes[None], lengths[:, None], train_seq_len)  # (1|n, H): each its own K
    bias = -per_request[:, :, None, None] * distance[:, None, None, :].float()  # (n, H, 1, K_max)
    bias = bias.masked_fill((distance < 0)[:, None, None, :], torch.finfo(torch.float32).min)
    # n rows of batch n, each at the end of its (padded) keys: a decoding row's path. Its payload is each request's
    # own bias rather than one over the padded length, which would differ from it by a per-row constant (softmax
    # ignores it, but fp32 would round larger logits).
    facts = plan_facts(slopes, len(decoding), 1, longest, longest - 1)
    path = choose_path(implementation, facts, slopes.device.type, tracing=False).path  # eager, or the one-row bank
    plan = replace(facts, path=path, payload=BiasBank(bias, mask_in_dtype(bias, dtype), folded=True))
    return PagedDecode(rows, key_index.reshape(-1), plan)


def paged_alibi_attention(query, key, value, plan, scaling, layer=None, *, attend):
    """A continuous-batching forward: query (1, H, T, D) holds every request's new rows, key
    and value (1, H, K, D) every request's keys. Each prefill segment attends its own key slice through its own
    batch-1 plan; the decoding rows attend their gathered keys in one batched call. A composite route:
    `attend(query, key, value, plan, scaling, layer)` (the dispatcher's, passed down by it) runs each part."""

    paged = plan.payload
    batch, heads, _, head_dim = query.shape
    output = query.new_zeros(batch, paged.total_rows, heads, head_dim)  # (1, T, H, D): padding rows stay zero
    for segment in paged.segments:
        rows, keys = slice(segment.row_start, segment.row_end), slice(segment.key_start, segment.key_end)
        output[:, rows] = attend(query[:, :, rows], key[:, :, keys], value[:, :, keys], segment.plan, scaling, layer)[
            0
        ]  # (1, q_r, H, D)
    decode = paged.decode
    if decode is not None:
        n, longest = decode.rows.shape[0], decode.plan.key_length
        rows = query[0].index_select(1, decode.rows).transpose(0, 1)[:, :, None]  # (n, H, 1, D)
        # The cache returns keys as (1, H, K, D) views of (K, H, D): gather whole (H, D) rows, then view per request
        gathered = [t[0].transpose(0, 1).index_select(0, decode.key_index) for t in (key, value)]  # 2 x (n K_max, H, D)
        k, v = (t.view(n, longest, heads, head_dim).transpose(1, 2) for t in gathered)  # 2 x (n, H, K_max, D)
        out = attend(rows, k, v, decode.plan, scaling, layer)[0]  # (n, 1, H, D)
        output[0].index_copy_(0, decode.rows, out[:, 0])
    return output, None
