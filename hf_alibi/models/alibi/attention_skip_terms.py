"""The certificate's sums over key blocks (Theorem 3 of `attention_skip`), in float64: where each group of query rows
may start reading keys, and the per-block terms every such bound shares.

`_grouped_starts` is the prefill's bound, vectorised over blocks of rows and linear in the length: each head sums
block by block only within its slope's reach (`_reach`) and bounds the blocks further back at once (`_tail_bound`;
the proof: `attention_skip`, "The far blocks at once"). `_passing_blocks` turns log-bounds into the prefix that stays
under eps; `_block_decay` and `_log_geometric` are the geometric decay over a block that the prefill and decoding
bounds share. Check: `HF_HUB_OFFLINE=1 python -m pytest -q tests/models/alibi/test_attention_skip_reach.py`
"""

import functools
import math

import torch
import torch.nn.functional as F

# Nats subtracted from log(eps) before comparing: float64 rounding of the bound's log-sum-exps (at most ~1e-12 nats at
# these sizes) must never turn a bound just above eps into one just below it.
_ROUNDING_MARGIN = 1e-9


def _passing_blocks(log_terms: torch.Tensor, eps: float) -> torch.Tensor:
    """How many leading blocks' bounds sum to at most eps (less the margin), along the last dim: int64 (...,).

    The sum is nondecreasing, so the blocks that pass form a prefix. Summed as exp(term - log eps): overflow to inf
    fails, as it should; underflow to 0 drops terms below 1e-308 of eps, which the margin covers; NaN (never on real
    rows) fails.
    """
    threshold = math.log(eps) - _ROUNDING_MARGIN
    return (torch.cumsum(torch.exp(log_terms - threshold), dim=-1) <= 1.0).sum(-1)


def _grouped_starts(
    a, lse, norms, slopes, query_offset, eps, row_block, key_block, key_padding, row_group, terms: int = 1 << 22
):
    """`certified_key_starts` with Cauchy-Schwarz, vectorised over row blocks, for groups of `row_group` rows.

    Row i's bound is the sum over blocks K of exp(a_i N_K + b_K + c_i), with a_i = |s| |q_i|, b_K = m e_K + log G_K
    and c_i = -m i - LB_i (Theorem 3 rearranged). For a group of rows, a = max a_i and c = max c_i bound every
    member's terms from above (N_K >= 0), so a start certified for the group holds for each of its rows. Rows are
    sorted by a_i within a row block before grouping, so a group's rows have nearly the same query norm and the
    group's bound is nearly each row's.

    Linear in the length: each head sums block by block only the `_reach` blocks nearest each row block; the blocks
    before them are bounded at once by their tail (`_tail_bound`), which that reach makes < eps 2^-20. So the bound
    may exceed the all-blocks one by that much (a start is never later: still certified). `terms` bounds the
    float64 terms held at once.
    """
    batch, heads, q_len = a.shape
    device = a.device
    n_row_blocks, n_blocks = -(-q_len // row_block), norms.shape[-1]
    groups = -(-row_block // row_group)
    m = slopes.double().to(device)  # (H,)
    positions = query_offset + torch.arange(q_len, device=device)  # (q,)
    c = -m[:, None] * positions.double() - lse  # (B, H, q); -inf on padded rows (no real diagonal)
    if key_padding is not None:  # padded query rows never constrain the start
        c = c.masked_fill(~key_padding[:, None, query_offset : query_offset + q_len].bool(), -math.inf)
    pad_rows = n_row_blocks * row_block - q_len  # rows that constrain nothing: the last block's tail, and each
    pad_group = groups * row_group - row_block  # block's tail up to whole groups
    a, c = (
        F.pad(F.pad(t, (0, pad_rows), value=fill).unflatten(2, (n_row_blocks, row_block)), (0, pad_group), value=fill)
        for t, fill in ((a, 0.0), (c, -math.inf))
    )  # (B, H, R, groups * row_group) each
    order = a.argsort(dim=-1)  # (B, H, R, rows): each row block's rows by query norm
    a = a.gather(-1, order).unflatten(-1, (groups, row_group)).amax(-1)  # (B, H, R, groups)
    c = c.gather(-1, order).unflatten(-1, (groups, row_group)).amax(-1)  # (B, H, R, groups)
    b = _block_decay(tuple(slopes.tolist()), key_block, n_blocks, str(device))[1]  # (H, nb): m e_K + log G_K
    first_row = query_offset + torch.arange(n_row_blocks, device=device) * row_block  # (R,)
    ends = first_row // key_block  # (R,) blocks wholly before each row block: the only droppable ones
    reach = _reach(a, c, norms, m, first_row, eps, key_block)  # (H,) blocks summed one by one
    prefix = F.pad(norms.cummax(-1).values, (1, 0), value=-math.inf)  # (B, H, nb + 1): max N_K, K < index
    starts = torch.empty(batch, heads, n_row_blocks, groups, dtype=torch.long, device=device)
    for head, width in enumerate(reach):
        step = max(1, terms // (batch * groups * (width + 1)))  # row blocks at a time
        for first in range(0, n_row_blocks, step):
            part = slice(first, min(first + step, n_row_blocks))
            lo = (ends[part] - width).clamp(min=0)  # (r,) the first block summed one by one
            window = lo[:, None] + torch.arange(width, device=device)  # (r, w)
            index = window.clamp(max=max(n_blocks - 1, 0))
            near = norms[:, head, index]  # (B, r, w)
            log_terms = a[:, head, part, :, None] * near[:, :, None] + b[head, index][None, :, None]  # (B, r, g, w)
            log_terms = log_terms.masked_fill((near == -math.inf)[:, :, None], -math.inf)  # no real keys: no mass
            log_terms = log_terms + c[:, head, part, :, None]
            log_terms = log_terms.masked_fill((window >= ends[part, None])[None, :, None], math.inf)  # stop there
            tail = _tail_bound(a[:, head, part], c[:, head, part], prefix[:, head, lo], m[head], lo, key_block)
            passing = _passing_blocks(torch.cat([tail[..., None], log_terms], dim=-1), eps)  # (B, r, g)
            # the tail fails only if the reach was too short: then nothing is certified (dense is always valid)
            starts[:, head, part] = torch.where(passing > 0, lo[:, None] + passing - 1, 0) * key_block
    return starts.amin(dim=(0, 3))  # (H, R)


# Nats below log(eps) the tail of the blocks beyond a head's reach is held to: the bound exceeds the all-blocks one by
# at most eps 2^-20, which moves a start only where that bound is within a millionth of eps
_TAIL_NATS = 20 * math.log(2)


def _reach(a, c, norms, m, first_row, eps: float, key_block: int) -> list[int]:
    """Per head, how many blocks before each row block to sum one by one so that the blocks before those bound to
    < eps 2^-20 for every row group (`_tail_bound` with the largest key norm): the slope's reach, independent of the
    length once it is passed. All the blocks for a flat head (m = 0), which has no reach."""
    n_blocks = norms.shape[-1]
    largest = norms.amax(-1)[..., None, None]  # (B, H, 1, 1) N_K <= this for every block
    # a N + c + m first_row bounds a N_K - m (i - first_row) - LB_i for every row i of the group
    x = a * largest + c + m[:, None, None] * first_row[:, None].double()  # (B, H, R, g)
    x = x.masked_fill((largest == -math.inf) | (c == -math.inf), -math.inf).amax(dim=(0, 2, 3))  # (H,)
    reach = []
    for head_x, slope in zip(x.tolist(), m.tolist()):
        if head_x == -math.inf:  # no real key or row: no mass anywhere
            reach.append(min(1, n_blocks))
            continue
        if slope <= 0 or not math.isfinite(head_x):
            reach.append(n_blocks)
            continue
        # tail <= exp(x + log G + log(1 / (1 - e^{-m B})) - m (w B + 1)) over the blocks w and more blocks back
        log_g = float(_log_geometric(torch.tensor(slope, dtype=torch.float64), key_block))
        spread = log_g - math.log(-math.expm1(-slope * key_block))
        need = head_x + spread - math.log(eps) + _ROUNDING_MARGIN + _TAIL_NATS - slope
        reach.append(min(n_blocks, max(1, math.ceil(need / (slope * key_block)) + 1)))
    return reach


def _tail_bound(a, c, prefix, m, lo, key_block: int) -> torch.Tensor:
    """log of an upper bound on the sum of a head's terms over the blocks before `lo` (r,), for row groups `a`, `c`
    (B, r, g): every N_K <= `prefix` (B, r), their largest, and sum_K e^{m e_K} is geometric,
    e^{m e_{lo - 1}} sum_{k < lo} e^{-m B k}. -inf where there are no blocks or no real keys before `lo`."""
    count = lo.double()
    if float(m) > 0:
        spread = torch.log(-torch.expm1(-m * key_block * count)) - math.log(-math.expm1(-float(m) * key_block))
    else:
        spread = torch.log(count)  # -inf where lo = 0
    log_g = _log_geometric(m, key_block)
    ends = m * (count * key_block - 1) + spread + log_g  # (r,)
    tail = a * prefix[..., None] + c + ends[None, :, None]  # (B, r, g)
    return tail.masked_fill(((prefix == -math.inf)[..., None]) | (lo == 0)[None, :, None], -math.inf)


def _log_geometric(m: torch.Tensor, block: int) -> torch.Tensor:
    """log G of Theorem 3 for slopes `m` (float64, any shape): log sum_{d < block} e^{-m d}; log(block) where m = 0."""
    return torch.where(m > 0, torch.log(-torch.expm1(-m * block)) - torch.log(-torch.expm1(-m)), math.log(block))


@functools.lru_cache(maxsize=64)
def _block_decay(slopes: tuple, block: int, n: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """m (H, 1) and m e_K + log G (H, n) of Theorem 3 for the first n blocks: the per-block part of every bound that
    splits m (i - e_K) into per-row and per-block terms (grouped prefill rows, decoding steps)."""
    m = torch.tensor(slopes, dtype=torch.float64, device=device)[:, None]  # (H, 1)
    log_g = _log_geometric(m, block)  # (H, 1)
    ends = torch.arange(1, n + 1, device=device, dtype=torch.float64) * block - 1  # (n,) e_K
    return m, m * ends + log_g  # (H, 1), (H, n)
