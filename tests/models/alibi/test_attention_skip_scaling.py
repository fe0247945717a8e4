"""Certified skipping under slope interpolation (`alibi_scaling.train_seq_len`): the certificate is computed from the
slopes the forward attends with, divided by max(1, K / n), never from the unscaled ones. For every drawn problem of
`test_attention_skip.problems` and every n, the exact float64 softmax mass, with `alibi_reference.interpolated_slopes`
written from the formula, of the keys each path's certificate drops is <= eps; and `"auto"`'s rule is asked with the
scaled slopes."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_attention_skip import CHECKS, dropped_mass, problems, real_rows

from alibi_reference import interpolated_slopes, reference_attention
from benchmarks.skip_research import certified_decode_start, certified_key_starts, kept_fraction, near_key_lse
from hf_alibi.models.alibi.attention_alibi import plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import certified_split, skipping_pays
from hf_alibi.models.alibi.attention_skip import key_block_norms


def filled(p):
    """`p` cut to its filled keys (a static cache's tail dropped): K = offset + q, as the model's plan counts them."""
    kv = p["offset"] + p["query"].shape[2]
    p = {**p, "key": p["key"][:, :, :kv], "value": p["value"][:, :, :kv]}
    p["key_padding"] = None if p["key_padding"] is None else p["key_padding"][:, :kv]
    return p


def scaled_plan(p, implementation: str, train_seq_len: int):
    batch, _, q_len, _ = p["query"].shape
    mask = None if p["key_padding"] is None else p["key_padding"].long()
    return plan_alibi_attention(
        implementation,
        p["slopes"],
        batch,
        q_len,
        p["key"].shape[2],
        query_offset=p["offset"],
        attention_mask=mask,
        skip_eps=p["eps"],
        train_seq_len=train_seq_len,
    )


def interpolated_weights(p, train_seq_len: int) -> torch.Tensor:
    """Float64 softmax weights (B, H, q, kv) with the slopes divided by max(1, K / n), K the problem's keys."""
    slopes = interpolated_slopes(p["slopes"], p["key"].shape[2], train_seq_len=train_seq_len)
    return reference_attention(
        p["query"], p["key"], p["value"], slopes, scale=p["scaling"], offset=p["offset"], key_padding=p["key_padding"]
    )[1]


def assert_drops_at_most_eps(p, train_seq_len, row_starts):
    weights = interpolated_weights(p, train_seq_len)  # (B, H, q, kv)
    mass = dropped_mass(weights, row_starts).masked_fill(~real_rows(p), 0.0)  # (B, H, q)
    assert float(mass.max()) <= p["eps"], f"largest dropped mass {float(mass.max()):.3e} > eps {p['eps']:.0e}"


@CHECKS
@given(problems(), st.integers(1, 64), st.integers(2, 16))
def test_the_splits_certificate_under_interpolation_drops_at_most_eps(p, train_seq_len, rows):
    """`certified_split` of a plan built with `train_seq_len`, in blocks small enough to skip at these lengths."""
    if p["documents"] is not None or p["query"].shape[2] < 2:
        return  # the split serves no packed rows and no one-row steps
    p = filled(p)
    plan = scaled_plan(p, "sdpa", train_seq_len)
    if plan.path != "sdpa_split_certified":
        return  # eps 0 or a failed probe
    with torch.no_grad():
        output, ranges = certified_split(
            p["query"], p["key"], p["value"], plan, p["scaling"], rows=rows, key_block=p["key_block"]
        )
    row_starts = ranges.first_key.repeat_interleave(rows, dim=1)[:, : p["query"].shape[2]]  # (H, q)
    assert_drops_at_most_eps(p, train_seq_len, row_starts)
    weights, value = interpolated_weights(p, train_seq_len), p["value"].double()
    difference = ((output.double() - weights @ value).abs() * real_rows(p)[..., None]).max()
    bound = (2 * p["eps"] + 1e-5) * float(value.abs().max())  # Theorem 1, and the fp32 kernel's rounding
    assert float(difference) <= bound, f"largest difference {float(difference):.3e} > {bound:.3e}"


@CHECKS
@given(problems(), st.integers(1, 64))
def test_the_prefill_certificate_from_a_plans_slopes_drops_at_most_eps(p, train_seq_len):
    """FlexAttention's certificate (`certified_key_starts` over the plan's slopes), in the drawn blocks."""
    if p["documents"] is not None:
        return  # packed rows reach the plan through position_ids: test_attention_skip covers their certificate
    p = filled(p)
    plan = scaled_plan(p, "flex_attention", train_seq_len)
    starts = certified_key_starts(
        p["query"],
        p["key"],
        plan.slopes,
        p["scaling"],
        p["offset"],
        p["eps"],
        p["row_block"],
        p["key_block"],
        plan.key_padding,
        p["near"],
        p["centroid"],
        row_group=p["row_group"],
    )
    row_starts = starts.repeat_interleave(p["row_block"], dim=1)[:, : p["query"].shape[2]]  # (H, q)
    assert_drops_at_most_eps(p, train_seq_len, row_starts)


@CHECKS
@given(problems(decode=True), st.integers(1, 64))
def test_the_decoding_certificate_from_a_plans_slopes_drops_at_most_eps(p, train_seq_len):
    """A decoding row's certificate (`certified_decode_start` over the plan's slopes at K = position + 1)."""
    p, position, block = filled(p), p["offset"], p["key_block"]
    plan = scaled_plan(p, "sdpa", train_seq_len)
    norms = key_block_norms(p["key"], block, p["key_padding"])  # (B, H, blocks)
    lse = near_key_lse(p["query"], p["key"], plan.slopes, p["scaling"], position, p["near"], p["key_padding"])
    start = certified_decode_start(p["query"], norms, plan.slopes, p["scaling"], position, p["eps"], block, lse)
    assert_drops_at_most_eps(p, train_seq_len, start[:, :, None])  # (B, H, 1): each row's own start


def test_interpolated_slopes_skip_fewer_keys_and_auto_asks_with_them():
    """Steep heads over 4096 keys: interpolation to a 256-token training length keeps more keys, and `"auto"`'s
    rule, given the scaled slopes, predicts no gain where the unscaled ones would pay."""
    generator = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 2.0**-4])
    query, key, value = (0.3 * torch.randn(1, 4, 4096, 8, generator=generator) for _ in range(3))
    kept = {}
    for train_seq_len in (None, 256):
        plan = plan_alibi_attention("sdpa", slopes, 1, 4096, 4096, skip_eps=1e-7, train_seq_len=train_seq_len)
        with torch.no_grad():
            _, ranges = certified_split(query, key, value, plan, 8**-0.5)
        kept[train_seq_len] = float(kept_fraction(ranges.first_key, 4096, ranges.rows).mean())
    assert kept[256] > kept[None], kept
    scaled = interpolated_slopes(slopes, 4096, train_seq_len=64).float()
    assert skipping_pays(slopes, 4096, 4096) and not skipping_pays(scaled, 4096, 4096)
    for train_seq_len, pays in ((None, True), (64, False)):
        plan = plan_alibi_attention("sdpa", slopes, 1, 4096, 4096, skip_eps="auto", train_seq_len=train_seq_len)
        assert (plan.path == "sdpa_split_certified") == pays, (train_seq_len, plan.path)


@pytest.mark.parametrize("train_seq_len", [1, 7, 100])
def test_the_plan_holds_the_slopes_of_its_key_count(train_seq_len):
    slopes = torch.tensor([0.5, 0.25, 2.0**-0.5])
    for q_len, kv in ((1, 1), (5, 5), (1, 60), (12, 60)):
        plan = plan_alibi_attention("eager", slopes, 1, q_len, kv, train_seq_len=train_seq_len)
        expected = interpolated_slopes(slopes, kv, train_seq_len=train_seq_len)
        torch.testing.assert_close(plan.slopes.double(), expected, atol=0, rtol=1e-7)
