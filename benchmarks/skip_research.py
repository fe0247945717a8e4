"""Research variants of certified key skipping, kept out of the shipped model folder: what was measured against the
bounds `hf_alibi/models/alibi/attention_skip.py` ships (its module docstring has the theorems).

- the centred upper bound of Theorem 3 (`key_block_spheres`, `certified_key_starts(..., centroid=True)`): about any
  centre c_K, s q.k_j <= s q_i.c_K + |s| |q_i| r_K, r_K = max_j |k_j - c_K|; tighter than Cauchy-Schwarz when a
  block's keys share a large common component (on the byte-level checkpoints of results/skip/kept_fraction.md it
  changes little: ~0.001 less kept work at 8k);
- Theorem 2 over the `near` nearest keys (`near_key_lse`; production uses the diagonal logit, near = 1: on the demo
  checkpoint at 8k, 32 near keys certified 0.352 of causal work against 0.381, but their float64 products cost more
  than they save);
- `kept_fraction`, the measurement `measure_kept_fraction`, `compare_lse_bounds` and `bench_skip` report, and
  `recorded_key_ranges`, the key ranges a real forward's certified splits read.

`certified_key_starts` and `certified_decode_start` here take the research options and fall back to the shipped
functions when they are off, so a test can compare the two on the same inputs.
"""

import contextlib
import math

import torch

from hf_alibi.experiments.length.kept_context import kept_fraction  # noqa: F401  (the measurement, re-exported)
from hf_alibi.models.alibi import attention_skip as shipped
from hf_alibi.models.alibi.attention_skip import (
    _blocked,
    _check_eps,
    _check_positive,
    _check_slopes,
    _real_keys,
    key_block_norms,
)
from hf_alibi.models.alibi.attention_skip_terms import _log_geometric, _passing_blocks


def key_block_spheres(
    key: torch.Tensor, block: int, key_padding: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Centre c_K (mean of the real keys) and radius r_K = max |k_j - c_K| of each `block` of `key` (B, H, kv, D).

    Returns float64 (B, H, nb, D) and (B, H, nb); the radius is -inf for a block without real keys. Any centre makes
    Theorem 3 valid; the mean keeps the radius small.
    """
    _check_positive("block", block)
    real = _real_keys(key, key_padding).expand(key.shape[0], key.shape[1], -1)  # (B, H, kv)
    keys = _blocked(key.double() * real[..., None], block, 0.0)  # (B, H, nb, block, D), padded keys zeroed
    counts = _blocked(real.double(), block, 0.0).sum(-1)  # (B, H, nb)
    centres = keys.sum(-2) / counts.clamp(min=1)[..., None]  # (B, H, nb, D)
    distances = (keys - centres[..., None, :]).norm(dim=-1)  # (B, H, nb, block)
    distances = distances.masked_fill(~_blocked(real, block, False), -math.inf)
    return centres, distances.amax(-1)


def near_key_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    slopes: torch.Tensor,
    scaling: float,
    query_offset: int,
    near: int,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """LB_i: the exact float64 log-sum-exp of each row's real keys among i - near < j <= i (Theorem 2).

    `query` (B, H, q, D) row r at absolute position `query_offset + r`; `key` (B, H, kv, D); `key_padding` (B, kv)
    True = real. Packed documents are deliberately not masked (see the module docstring). Returns (B, H, q); -inf on
    padded rows (no real key). `near=1` is the diagonal logit. One distance t = i - j at a time, for every row at
    once: `near` row-wise products, O(q near D) work and O(q D) memory, no (q, kv) score block.
    """
    _check_positive("near", near)
    batch, heads, q_len, _ = query.shape
    _check_slopes(slopes, heads)
    real = _real_keys(key, key_padding)[:, 0]  # (B|1, kv)
    m = slopes.double().to(query.device)[:, None]  # (H, 1)
    scaled = query.double() * scaling  # (B, H, q, D)
    lse = torch.full((batch, heads, q_len), -math.inf, dtype=torch.float64, device=query.device)
    for t in range(min(near, query_offset + q_len)):  # key j = i - t, for the rows that have one (j >= 0)
        first = max(0, t - query_offset)
        keys = slice(query_offset + first - t, query_offset + q_len - t)
        logits = (scaled[:, :, first:] * key[:, :, keys].double()).sum(-1) - m * t  # (B, H, q - first)
        logits = logits.masked_fill(~real[:, None, keys], -math.inf)
        lse[:, :, first:] = torch.logaddexp(lse[:, :, first:], logits)
    return lse  # (B, H, q)


def _kept_start(query, lse_lower, first_position, slopes, scaling, block, eps, n, norms, centres, radii):
    """The first key each row of `query` (B, H, rows, D) must keep (`first_kept_key` over the first `n` key blocks,
    from the log of Theorem 3's bound on each block's softmax mass): int64 (B, H, rows).

    Row r sits at absolute position `first_position + r`; `lse_lower` (B, H, rows) lower bounds on LSE_i; `norms`
    (B|1, H, >= n) from `key_block_norms`; `centres` (B|1, H, >= n, D) and `radii` (B|1, H, >= n) from
    `key_block_spheres`, or None. Block k holds keys [k block, (k + 1) block), all of them before every row.
    """
    positions = first_position + torch.arange(query.shape[2], device=query.device)  # (rows,)
    if n * block > first_position + 1:
        raise ValueError(f"{n} blocks of {block} keys do not all lie at or before position {first_position}")
    query, norms = query.double(), norms[..., :n]
    q_norm = query.norm(dim=-1, keepdim=True) * abs(scaling)  # (B, H, rows, 1): |s| |q_i|
    upper = q_norm * norms[:, :, None, :]  # (B, H, rows, n): Cauchy-Schwarz
    if centres is not None:
        centres, radii = centres[:, :, :n], radii[..., :n]
        centred = (query @ centres.transpose(-1, -2)) * scaling + q_norm * radii[:, :, None, :]  # (B, H, rows, n)
        upper = torch.minimum(upper, centred)
    # A block without real keys has norm -inf; 0 * -inf (a zero query) would be NaN, and its mass is 0 anyway
    upper = upper.masked_fill((norms == -math.inf)[:, :, None, :], -math.inf)
    m = slopes.double().to(query.device)  # (H,)
    ends = torch.arange(1, n + 1, device=query.device, dtype=torch.float64) * block - 1  # (n,) e_K
    distance = positions.double()[:, None] - ends[None, :]  # (rows, n): i - e_K >= 0
    log_g = _log_geometric(m, block)  # (H,)
    log_bounds = upper - m[:, None, None] * distance + (log_g[:, None, None] - lse_lower[..., None])  # (B, H, rows, n)
    return first_kept_key(log_bounds, eps, block)


def first_kept_key(log_bounds: torch.Tensor, eps: float, block: int) -> torch.Tensor:
    """The largest block boundary t with sum_{blocks before t} bound <= eps, per row: int64 (...,) from (..., nb)."""
    _check_eps(eps)
    if log_bounds.shape[-1] == 0 or eps == 0.0:
        return torch.zeros(log_bounds.shape[:-1], dtype=torch.long, device=log_bounds.device)
    return _passing_blocks(log_bounds, eps) * block  # (...,)


def certified_key_starts(
    query, key, slopes, scaling, query_offset, eps, row_block, key_block, key_padding=None, near=64, centroid=True, **kw
) -> torch.Tensor:
    """`attention_skip.certified_key_starts` (the same inputs, starts and guarantee) with the research options.

    `near` sets Theorem 2's window where `lse_lower` is None (near = 1: the shipped diagonal logit). `centroid` adds
    Theorem 3's centred bound to Cauchy-Schwarz, row by row (`row_group` applies without it: the shipped grouping).
    `kw`: the shipped function's `row_group`, `lse_lower`, `query_norms`, `key_norms`.
    """
    row_group, lse_lower = kw.get("row_group", 1), kw.get("lse_lower")
    query_norms, key_norms = kw.get("query_norms"), kw.get("key_norms")
    if set(kw) - {"row_group", "lse_lower", "query_norms", "key_norms"}:
        raise TypeError(f"certified_key_starts got unexpected keyword arguments {sorted(kw)}")
    n_row_blocks, usable = shipped.key_starts_inputs(
        query, key, slopes, query_offset, eps, row_block, key_block, row_group, key_padding, lse_lower
    )
    if lse_lower is None and (centroid or near > 1):  # Theorem 2 over the `near` nearest keys
        lse_lower = near_key_lse(query, key, slopes, scaling, query_offset, near, key_padding)  # (B, H, q)
    if not centroid:  # the shipped certificate
        return shipped.certified_key_starts(
            query,
            key,
            slopes,
            scaling,
            query_offset,
            eps,
            row_block,
            key_block,
            key_padding,
            row_group,
            lse_lower,
            query_norms,
            key_norms,
        )
    q_len = query.shape[2]
    starts = torch.zeros(query.shape[1], n_row_blocks, dtype=torch.long, device=query.device)
    if eps == 0.0 or usable == 0:
        return starts
    norms, centres, radii = _droppable_blocks(key[:, :, : usable * key_block], key_block, key_padding, key_norms)
    real_rows = None if key_padding is None else key_padding[:, query_offset : query_offset + q_len].bool()  # (B, q)
    for index, first in enumerate(range(0, q_len, row_block)):
        last = min(first + row_block, q_len)
        n = (query_offset + first) // key_block  # blocks wholly before this row block
        if n == 0:
            continue
        rows, lse = slice(first, last), lse_lower[:, :, first:last].double()  # (B, H, n_rows)
        blocks = (n, norms, centres, radii)
        row_starts = _kept_start(query[:, :, rows], lse, query_offset + first, slopes, scaling, key_block, eps, *blocks)
        if real_rows is not None:  # padded rows do not constrain the start
            row_starts = row_starts.masked_fill(~real_rows[:, None, rows], n * key_block)
        starts[:, index] = row_starts.amin(dim=(0, 2))
    return starts


def _droppable_blocks(droppable, key_block, key_padding, key_norms):
    """Per block of `key_block` keys of `droppable` (the keys a certificate may drop): the norm bound of
    `key_block_norms`, and the centre and radius of `key_block_spheres` (B, H, nb), (B, H, nb, D), (B, H, nb)."""
    padding = None if key_padding is None else key_padding[:, : droppable.shape[2]]
    return key_block_norms(droppable, key_block, padding, key_norms), *key_block_spheres(droppable, key_block, padding)


def certified_decode_start(
    query, block_norms, slopes, scaling, query_offset, eps, block, lse_lower, centres=None, radii=None
) -> torch.Tensor:
    """First key one decoding step must compute, per batch element and head: int64 (B, H); `.amin(0)` per head.

    `query` (B, H, D) or (B, H, 1, D) at absolute position `query_offset`; `block_norms` (B, H, nb) from
    `key_block_norms` of the cache (a running maximum for the block being filled); `lse_lower` (B, H) or (B, H, 1) a
    lower bound on the row's LSE: `near_key_lse(query, cache_keys, ..., query_offset=query_offset, near=...)`
    (near=1: the diagonal logit); optional `centres`/`radii` of the cache's full blocks. The start is a multiple of
    `block` and <= `query_offset`.
    """
    if centres is None:  # Cauchy-Schwarz alone: the shipped step
        return shipped.certified_decode_start(query, block_norms, slopes, scaling, query_offset, eps, block, lse_lower)
    query, lse_lower, n = shipped.decode_inputs(query, block_norms, slopes, query_offset, eps, block, lse_lower)
    if eps == 0.0 or n == 0:
        return torch.zeros(query.shape[:2], dtype=torch.long, device=query.device)
    blocks = (n, block_norms, centres, radii)
    return _kept_start(query, lse_lower, query_offset, slopes, scaling, block, eps, *blocks)[..., 0]  # (B, H)


@contextlib.contextmanager
def recorded_key_ranges():
    """Within it, every `attention_certified.certified_split` the model runs appends its `KeyRanges` (the keys each
    head and block of rows really reads) to the yielded list; the module's function is put back on exit."""
    from hf_alibi.models.alibi import attention_certified

    ranges, certified_split = [], attention_certified.certified_split

    def recording(*args, **kwargs):
        output, key_ranges = certified_split(*args, **kwargs)
        ranges.append(key_ranges)
        return output, key_ranges

    attention_certified.certified_split = recording
    try:
        yield ranges
    finally:
        attention_certified.certified_split = certified_split
