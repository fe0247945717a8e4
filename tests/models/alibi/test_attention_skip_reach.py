"""The prefill certificate sums each head's bound block by block only within the slope's reach and bounds the blocks
further back at once (`attention_skip_terms._grouped_starts`): linear in the length. Held to Theorem 3 summed over every
block, written here row by row, and to the exact float64 softmax mass of the keys it drops."""

import math

import torch

from alibi_reference import reference_attention
from hf_alibi.models.alibi.attention_skip import certified_key_starts, diagonal_lse, key_block_norms, upper_norms
from hf_alibi.models.alibi.attention_skip_terms import _ROUNDING_MARGIN, _reach

SLOPES = torch.tensor([0.5, 2.0**-3, 2.0**-6, 0.0])  # steep to flat (no reach at all)


def rows(length: int, seed: int = 0, heads: int = 4, dim: int = 8):
    """Queries and keys (1, H, L, D) of a long row, with one huge key aligned with the queries early on."""
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(1, heads, 1, dim, generator=generator)
    query = torch.randn(1, heads, length, dim, generator=generator) + direction
    key = torch.randn(1, heads, length, dim, generator=generator)
    key[:, :, 5] = 30.0 * direction[:, :, 0]
    return query, key


def every_block_starts(query, key, slopes, scaling, eps, row_block, key_block) -> torch.Tensor:
    """Theorem 3 summed over every block before each row's block, row by row, with the diagonal logit as LB_i:
    the largest block boundary whose bound is <= eps, minimum over each block of rows: int64 (H, R)."""
    length = query.shape[2]
    a = upper_norms(query)[0] * abs(scaling)  # (H, L)
    norms = key_block_norms(key, key_block)[0]  # (H, nb)
    lse = diagonal_lse(query, key, scaling, 0)[0]  # (H, L)
    m = slopes.double()[:, None, None]  # (H, 1, 1)
    i = torch.arange(length, dtype=torch.float64)[None, :, None]  # (1, L, 1)
    ends = (torch.arange(norms.shape[-1], dtype=torch.float64) + 1) * key_block - 1  # (nb,) e_K
    geometric = torch.where(m > 0, (1 - torch.exp(-m * key_block)) / (1 - torch.exp(-m)), float(key_block))
    log_terms = a[..., None] * norms[:, None] - m * (i - ends) + torch.log(geometric) - lse[..., None]  # (H, L, nb)
    first_rows = torch.arange(length) // row_block * row_block  # (L,) each row's block's first position
    log_terms = log_terms.masked_fill(torch.arange(norms.shape[-1]) >= (first_rows // key_block)[:, None], math.inf)
    within = torch.cumsum(torch.exp(log_terms - (math.log(eps) - _ROUNDING_MARGIN)), -1) <= 1.0
    starts = within.sum(-1) * key_block  # (H, L)
    return starts.unflatten(1, (-1, row_block)).amin(-1)  # (H, R)


def test_long_rows_sum_only_the_slopes_reach_and_certify_what_summing_every_block_does():
    query, key = rows(2048)
    scaling, eps, row_block, key_block = 8**-0.5, 1e-7, 32, 8
    starts = certified_key_starts(query, key, SLOPES, scaling, 0, eps, row_block, key_block)  # (H, R)
    assert torch.equal(starts, every_block_starts(query, key, SLOPES, scaling, eps, row_block, key_block))
    assert starts[0, -1] > 1500 and starts[-1].max() == 0  # the steep head drops most keys; the flat one none
    weights = reference_attention(query, key, key, SLOPES, scale=scaling)[1]  # (1, H, L, L) float64
    dropped = torch.arange(2048) < starts.repeat_interleave(row_block, dim=1)[..., None]  # (H, L, L)
    assert float((weights[0] * dropped).sum(-1).max()) <= eps


def test_a_steep_heads_reach_is_the_same_at_every_length_and_a_flat_head_sums_every_block():
    scaling, eps, row_block, key_block = 8**-0.5, 1e-7, 32, 8
    reaches = {}
    for length in (2048, 8192):
        query, key = rows(length, seed=1)
        a = upper_norms(query) * scaling  # (1, H, L)
        c = -SLOPES.double()[:, None] * torch.arange(length) - diagonal_lse(query, key, scaling, 0)  # (1, H, L)
        blocks = a.unflatten(-1, (-1, row_block)), c.unflatten(-1, (-1, row_block))  # groups of one block each
        first_rows = torch.arange(0, length, row_block)
        reaches[length] = _reach(*blocks, key_block_norms(key, key_block), SLOPES.double(), first_rows, eps, key_block)
    short, long = reaches[2048], reaches[8192]
    # steep heads: the same reach at 4x the length (a few blocks more: the largest of 4x the query norms)
    assert all(s <= n <= 1.1 * s for s, n in zip(short[:2], long[:2])) and long[1] < 2048 // key_block, reaches
    assert short[2:] == [2048 // key_block] * 2 and long[2:] == [8192 // key_block] * 2  # 2^-6 reaches past 8k
