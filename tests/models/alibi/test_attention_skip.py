"""The skipping certificate (`hf_alibi.models.alibi.attention_skip`) against exact float64 softmax weights, never trusted.

For every drawn problem (random and adversarial: one huge far key aligned with the queries, tiny query norms, zero
and steep slopes, padding, packed documents, cache offsets, a static cache's unwritten tail) the softmax mass of the
keys before each returned start, computed exactly with `alibi_reference.reference_attention`, must be <= eps on every
real row, and attention over the kept keys must equal dense attention within 2 eps max|v| (Theorem 1). Packed rows
are certified without their document mask (the module docstring proves it safe) and checked per document.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alibi_reference import reference_attention

# the research bounds (centred, near keys), which fall back to the shipped ones, on the same inputs
from benchmarks.skip_research import (
    certified_decode_start,
    certified_key_starts,
    kept_fraction,
    key_block_spheres,
    near_key_lse,
)
from hf_alibi.models.alibi.attention_alibi import plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import certified_split
from hf_alibi.models.alibi.attention_skip import diagonal_lse, key_block_norms, upper_norms

SLOPES = (0.0, 2.0**-8, 2.0**-4, 0.5, 2.0)
CHECKS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, decode=False):
    """A dict of tensors and knobs; `decode`: one query row at the end of a cache."""
    batch, heads, dim = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 8]))
    packed = not decode and draw(st.booleans())
    q_len = 1 if decode else draw(st.integers(1, 48))
    offset = draw(st.integers(0, 60)) if decode else (0 if packed else draw(st.integers(0, 24)))
    kv = offset + q_len + (0 if packed else draw(st.integers(0, 3)))  # a static cache's unwritten tail
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    direction = torch.randn(1, heads, 1, dim, generator=generator)  # (1, H, 1, D): shared by queries and far key
    query = draw(st.sampled_from([1e-3, 0.3, 1.0, 3.0])) * (
        torch.randn(batch, heads, q_len, dim, generator=generator) + draw(st.sampled_from([0.0, 2.0])) * direction
    )  # (B, H, q, D)
    key = draw(st.sampled_from([0.3, 1.0, 3.0])) * torch.randn(batch, heads, kv, dim, generator=generator)
    if draw(st.booleans()):  # one huge far key, aligned with the queries: Cauchy-Schwarz is nearly tight on it
        far = draw(st.integers(0, max(offset + q_len - 1, 0) // 3))
        key[:, :, far] = draw(st.sampled_from([10.0, 40.0])) * direction[:, :, 0]
    padding = draw(st.sampled_from(["none", "left", "holes"]))
    key_padding = None
    if padding == "left":
        lengths = torch.tensor([draw(st.integers(1, kv)) for _ in range(batch)])
        key_padding = torch.arange(kv)[None] >= kv - lengths[:, None]  # (B, kv)
    elif padding == "holes":
        key_padding = torch.rand(batch, kv, generator=generator) > 0.3  # (B, kv)
    documents = None
    if packed:
        cuts = torch.rand(batch, kv, generator=generator) < draw(st.sampled_from([0.05, 0.2]))
        documents = cuts.long().cumsum(-1)  # (B, kv)
    return dict(
        query=query,
        key=key,
        value=torch.randn(batch, heads, kv, dim, generator=generator),
        slopes=torch.tensor([draw(st.sampled_from(SLOPES)) for _ in range(heads)]),
        scaling=draw(st.sampled_from([dim**-0.5, 1.0])),
        offset=offset,
        key_padding=key_padding,
        documents=documents,
        eps=draw(st.sampled_from([1e-7, 1e-5, 1e-2, 0.5])),
        row_block=draw(st.integers(1, 16)),
        key_block=draw(st.integers(1, 16)),
        near=draw(st.sampled_from([1, 3, 64])),
        centroid=draw(st.booleans()),
        row_group=draw(st.sampled_from([1, 2, 5])),
    )


def exact_weights(p) -> torch.Tensor:
    """Float64 softmax weights (B, H, q, kv) of the reference; packed rows: each document alone (same distances)."""
    if p["documents"] is None:
        return reference_attention(
            p["query"],
            p["key"],
            p["value"],
            p["slopes"],
            scale=p["scaling"],
            offset=p["offset"],
            key_padding=p["key_padding"],
        )[1]
    weights = torch.zeros(*p["query"].shape[:3], p["key"].shape[2], dtype=torch.float64)
    for b, row in enumerate(p["documents"]):
        for document in row.unique():
            span = (row == document).nonzero()[:, 0]  # packed documents are contiguous
            tokens = slice(int(span[0]), int(span[-1]) + 1)
            padding = None if p["key_padding"] is None else p["key_padding"][b : b + 1, tokens]
            weights[b : b + 1, :, tokens, tokens] = reference_attention(
                p["query"][b : b + 1, :, tokens],
                p["key"][b : b + 1, :, tokens],
                p["value"][b : b + 1, :, tokens],
                p["slopes"],
                scale=p["scaling"],
                key_padding=padding,
            )[1]
    return weights


def real_rows(p) -> torch.Tensor:
    """(B, 1, q) bool: query rows whose own token is real (padded rows' outputs are meaningless)."""
    batch, _, q_len, _ = p["query"].shape
    if p["key_padding"] is None:
        return torch.ones(batch, 1, q_len, dtype=torch.bool)
    return p["key_padding"][:, None, p["offset"] : p["offset"] + q_len]


def prefill_starts(p) -> torch.Tensor:
    """The certificate's start of every row, (H, q), after checking the block-level promises."""
    starts = certified_key_starts(
        p["query"],
        p["key"],
        p["slopes"],
        p["scaling"],
        p["offset"],
        p["eps"],
        p["row_block"],
        p["key_block"],
        p["key_padding"],
        p["near"],
        p["centroid"],
        row_group=p["row_group"],
    )
    first_rows = torch.arange(0, p["query"].shape[2], p["row_block"]) + p["offset"]  # (n_row_blocks,)
    assert bool((starts % p["key_block"] == 0).all()) and bool((starts <= first_rows).all()), starts
    return starts.repeat_interleave(p["row_block"], dim=1)[:, : p["query"].shape[2]]  # (H, q)


def dropped_mass(weights: torch.Tensor, row_starts: torch.Tensor) -> torch.Tensor:
    """Softmax mass of keys j < start of each row: (B, H, q) from weights (B, H, q, kv) and starts (H, q)."""
    dropped = torch.arange(weights.shape[-1]) < row_starts[..., None]  # (H, q, kv)
    return (weights * dropped).sum(-1)


@CHECKS
@given(problems())
def test_dropped_mass_never_exceeds_eps(p):
    mass = dropped_mass(exact_weights(p), prefill_starts(p)).masked_fill(~real_rows(p), 0.0)  # (B, H, q)
    assert float(mass.max()) <= p["eps"], f"largest dropped mass {float(mass.max()):.3e} > eps {p['eps']:.0e}"


@CHECKS
@given(problems())
def test_attention_over_kept_keys_matches_dense_within_2_eps_max_v(p):
    weights, row_starts = exact_weights(p), prefill_starts(p)
    kept = weights * (torch.arange(weights.shape[-1]) >= row_starts[..., None])  # (B, H, q, kv)
    value = p["value"].double()
    # Softmax over the kept keys alone = the dense weights renormalised over them (exact in float64)
    restricted = kept @ value / kept.sum(-1, keepdim=True).clamp(min=1e-300)  # (B, H, q, D)
    difference = ((restricted - weights @ value).abs() * real_rows(p)[..., None]).max()
    bound = 2 * p["eps"] * float(value.abs().max()) + 1e-12
    assert float(difference) <= bound, f"largest difference {float(difference):.3e} > 2 eps max|v| = {bound:.3e}"


@CHECKS
@given(problems(decode=True))
def test_decode_start_drops_at_most_eps(p):
    position, block = p["offset"], p["key_block"]
    cache = p["key"][:, :, : position + 1]  # (B, H, position + 1, D)
    padding = None if p["key_padding"] is None else p["key_padding"][:, : position + 1]
    norms = key_block_norms(cache, block, padding)  # (B, H, nb)
    centres, radii = key_block_spheres(cache, block, padding) if p["centroid"] else (None, None)
    lse = near_key_lse(p["query"], cache, p["slopes"], p["scaling"], position, p["near"], padding)  # (B, H, 1)
    start = certified_decode_start(
        p["query"], norms, p["slopes"], p["scaling"], position, p["eps"], block, lse, centres, radii
    )  # (B, H)
    assert bool((start % block == 0).all()) and bool((start <= position).all()), start
    weights = reference_attention(
        p["query"],
        cache,
        p["value"][:, :, : position + 1],
        p["slopes"],
        scale=p["scaling"],
        offset=position,
        key_padding=padding,
    )[1]
    # weights: (B, H, 1, position + 1)
    mass = (weights[:, :, 0] * (torch.arange(position + 1) < start[..., None])).sum(-1)  # (B, H)
    if padding is not None:
        mass = mass * padding[:, position, None]  # a padded current row has no meaningful output
    assert float(mass.max()) <= p["eps"], f"largest dropped mass {float(mass.max()):.3e} > eps {p['eps']:.0e}"


def split_problem(p):
    """`p` cut to the split's keys (a static cache's filled part) and its `sdpa` plan with `p["eps"]`, or (p, None)
    where the certified split does not serve it (packed documents, one row, eps 0, a failed probe)."""
    batch, _, q_len, _ = p["query"].shape
    if p["documents"] is not None or q_len < 2:  # the split serves no document masks and no one-row steps
        return p, None
    kv = p["offset"] + q_len
    p = {**p, "key": p["key"][:, :, :kv], "value": p["value"][:, :, :kv]}
    p["key_padding"] = None if p["key_padding"] is None else p["key_padding"][:, :kv]
    mask = None if p["key_padding"] is None else p["key_padding"].long()
    plan = plan_alibi_attention(
        "sdpa", p["slopes"], batch, q_len, kv, query_offset=p["offset"], attention_mask=mask, skip_eps=p["eps"]
    )
    return p, (plan if plan.path == "sdpa_split_certified" else None)


@CHECKS
@given(problems(), st.integers(2, 16))
def test_the_splits_certificate_from_its_kernels_diagonal_log_sum_exps_drops_at_most_eps(p, rows):
    """`certified_split`: Theorem 4's lower bound from the fp32 kernel's own diagonal blocks, then Theorem 3."""
    with torch.no_grad():
        p, plan = split_problem(p)
        if plan is None or plan.payload.eps != p["eps"]:
            return  # eps 0 or a plan without the split
        output, ranges = certified_split(
            p["query"], p["key"], p["value"], plan, p["scaling"], rows=rows, key_block=p["key_block"]
        )
    row_starts = ranges.first_key.repeat_interleave(rows, dim=1)[:, : p["query"].shape[2]]  # (H, q)
    weights = exact_weights(p)  # (B, H, q, kv)
    mass = dropped_mass(weights, row_starts).masked_fill(~real_rows(p), 0.0)  # (B, H, q)
    assert float(mass.max()) <= p["eps"], f"largest dropped mass {float(mass.max()):.3e} > eps {p['eps']:.0e}"
    value = p["value"].double()
    difference = ((output.double() - weights @ value).abs() * real_rows(p)[..., None]).max()
    bound = (2 * p["eps"] + 1e-5) * float(value.abs().max())  # Theorem 1, and the fp32 kernel's rounding
    assert float(difference) <= bound, f"largest difference {float(difference):.3e} > {bound:.3e}"


def test_steep_head_skips_far_keys_and_flat_head_keeps_all():
    generator = torch.Generator().manual_seed(0)
    query, key = (0.3 * torch.randn(1, 2, 512, 8, generator=generator) for _ in range(2))  # (1, 2, 512, 8) each
    slopes = torch.tensor([1.0, 0.0])
    starts = certified_key_starts(query, key, slopes, 8**-0.5, 0, 1e-7, 32, 32)  # (2, 16)
    first_rows = torch.arange(0, 512, 32)
    # Head 0: weights decay as e^-(i - j); ~17 nats take ~20 positions, so at most two blocks before the rows
    assert bool((starts[0] >= first_rows - 64).all()), f"steep head's starts {starts[0].tolist()}"
    assert bool((starts[1] == 0).all()), f"slope 0 can drop nothing at eps 1e-7, got {starts[1].tolist()}"
    fraction = kept_fraction(starts, 512, 32)
    assert float(fraction[0]) < 0.25 and float(fraction[1]) == 1.0, fraction


@pytest.mark.parametrize("centroid, row_group", [(True, 1), (False, 1), (False, 8)])
def test_packed_rows_certified_without_document_mask_even_when_another_document_dominates_the_near_keys(
    centroid, row_group
):
    # Document 0 ends with a key that every query of document 1 would love; it sits in their near window and inflates
    # the LSE lower bound, but it lies before any cut that could drop document 1's keys, so the certified sum pays it.
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(8, generator=generator)  # (D,)
    query = direction + 0.1 * torch.randn(1, 1, 80, 8, generator=generator)  # (1, 1, 80, 8)
    key = 0.1 * torch.randn(1, 1, 80, 8, generator=generator)
    key[0, 0, 39] = 10 * direction
    documents = (torch.arange(80) >= 40).long()[None]  # (1, 80)
    p = dict(
        query=query,
        key=key,
        value=torch.randn(1, 1, 80, 8, generator=generator),
        slopes=torch.tensor([0.0]),
        scaling=1.0,
        offset=0,
        key_padding=None,
        documents=documents,
        eps=1e-7,
        row_block=8,
        key_block=4,
        near=64,
        centroid=centroid,
        row_group=row_group,
    )
    mass = dropped_mass(exact_weights(p), prefill_starts(p))  # (1, 1, 80)
    assert float(mass.max()) <= p["eps"], f"largest dropped mass {float(mass.max()):.3e} > eps 1e-7"


def test_eps_zero_is_dense():
    query, key = torch.randn(1, 2, 40, 4), torch.randn(1, 2, 40, 4)
    starts = certified_key_starts(query, key, torch.tensor([2.0, 0.5]), 1.0, 0, 0.0, 8, 4)
    assert bool((starts == 0).all()), starts


def test_kept_fraction_counts_computed_keys_of_every_row():
    starts = torch.tensor([[0, 4, 8], [0, 0, 12]])  # (H, 3 row blocks of 5 rows), 12 rows at offset 7
    offset, rows = 7, 12
    causal = sum(offset + r + 1 for r in range(rows))
    for head in range(2):
        computed = sum(offset + r + 1 - int(starts[head, r // 5]) for r in range(rows))
        got = float(kept_fraction(starts, rows, 5, offset)[head])
        assert got == pytest.approx(computed / causal, abs=1e-15), (head, got, computed / causal)


def test_block_norms_extend_by_running_maximum():
    key = torch.randn(2, 3, 11, 4)  # 11 keys: blocks of 4 end in a partial one, as a cache does
    grown = key_block_norms(key[:, :, :10], 4)  # (2, 3, 3)
    grown[..., -1] = torch.maximum(grown[..., -1], upper_norms(key[:, :, 10]))
    assert torch.equal(grown, key_block_norms(key, 4)), (grown - key_block_norms(key, 4)).abs().max()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(eps=-0.1), "eps must lie in"),
        (dict(eps=1.0), "eps must lie in"),
        (dict(row_block=0), "row_block must be a positive integer, got 0"),
        (dict(key_block=-4), "key_block must be a positive integer, got -4"),
        (dict(key=torch.randn(1, 2, 10, 3)), r"key \(1, 2, 10, 3\) does not fit query"),
        (dict(slopes=torch.tensor([0.5, -0.1])), "slopes must be >= 0"),
        (dict(slopes=torch.tensor([0.5])), r"slopes must have shape \(2,\)"),
        (dict(query_offset=5), "query_offset=5 must lie in"),
        (dict(key_padding=torch.ones(1, 9, dtype=torch.bool)), r"key_padding must have shape \(1, 10\)"),
    ],
)
def test_bad_inputs_raise_naming_the_value(change, message):
    arguments = dict(
        query=torch.randn(1, 2, 6, 4),
        key=torch.randn(1, 2, 10, 4),
        slopes=torch.tensor([0.5, 0.1]),
        scaling=0.5,
        query_offset=4,
        eps=1e-7,
        row_block=2,
        key_block=2,
    )
    with pytest.raises(ValueError, match=message):
        certified_key_starts(**{**arguments, **change})


@pytest.mark.parametrize("q_len, kv, offset, near", [(37, 37, 0, 8), (5, 29, 24, 64), (1, 61, 60, 32), (19, 40, 21, 1)])
def test_near_key_lse_is_the_log_sum_exp_of_the_near_real_keys(q_len, kv, offset, near):
    generator = torch.Generator().manual_seed(0)
    query, key = (torch.randn(2, 3, n, 4, generator=generator) for n in (q_len, kv))
    slopes, padding = torch.tensor([0.0, 0.25, 2.0]), torch.rand(2, kv, generator=generator) > 0.2
    got = near_key_lse(query, key, slopes, 0.5, offset, near, padding)  # (B, H, q)
    i = torch.arange(offset, offset + q_len)[:, None]  # (q, 1)
    j = torch.arange(kv)[None]  # (1, kv)
    scores = query.double() @ key.double().transpose(-1, -2) * 0.5 - slopes.double()[:, None, None] * (i - j)
    window = (j <= i) & (i - j < near) & padding[:, None, None, :]  # (B, 1, q, kv)
    expected = torch.logsumexp(scores.masked_fill(~window, -torch.inf), dim=-1)  # (B, H, q)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    if near == 1:  # the shipped bound: the diagonal logit
        torch.testing.assert_close(diagonal_lse(query, key, 0.5, offset, padding), expected, rtol=0, atol=1e-12)
