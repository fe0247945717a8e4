"""The split's floored bias (`attention_sdpa_split_floor.py`): no forward `exp` argument of a floored call below -87
(recomputed in float64 from each call's own inputs), outputs and gradients within fp32 rounding of the exact,
unfloored float64 formula (`alibi_reference.py`), and heads where no floor is provably exact left exactly as they were.

Steep slopes and long distances make the floor bite at test sizes; the adversarial inputs point every far key along
the queries and the last rows' own and near keys against them, where the floored keys' weights are largest.
"""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alibi_reference import reference_attention
from hf_alibi.models.alibi.attention_sdpa_split import sdpa_alibi_split, split_plan
from hf_alibi.models.alibi.attention_sdpa_split_floor import EXP_LIMIT, ROUNDING_NATS, backward_lse, bias_floors

DIM = 8
SCALE = DIM**-0.5
SLOPES = torch.tensor([2.0, 0.5, 0.125, 1 / 32])  # steep: distances past C / m fit in a few hundred tokens
CHUNKS = (64, 16)
PROPERTY = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FP32_ROUNDING = 2.0**-24


def inputs(length, offset, bound, adversarial, seed, dtype=torch.float64):
    """(1, H, length, D) query, (1, H, offset + length, D) key and value: norms sized so that max |q| max |k| * scale
    is `bound`; `adversarial`: every query along one direction, the last 16 keys (the last rows' own and nearest)
    against it and every other key along it."""
    generator = torch.Generator().manual_seed(seed)
    total, heads = offset + length, len(SLOPES)
    query = torch.randn(1, heads, length, DIM, generator=generator, dtype=torch.float64)
    key = torch.randn(1, heads, total, DIM, generator=generator, dtype=torch.float64)
    value = torch.randn(1, heads, total, DIM, generator=generator, dtype=torch.float64)
    if adversarial:
        direction = torch.randn(DIM, generator=generator, dtype=torch.float64)
        query = direction.expand_as(query).clone()
        near = torch.arange(total) >= total - 16  # (total,) the last keys, the rows' own among them
        key = torch.where(near[:, None], -direction, direction).expand_as(key).clone()
    norm = (bound / SCALE) ** 0.5
    query = query / query.norm(dim=-1, keepdim=True) * norm
    key = key / key.norm(dim=-1, keepdim=True) * norm
    return [t.to(dtype).requires_grad_() for t in (query, key, value)]


def split(query, key, value, offset, floor=True):
    return sdpa_alibi_split(query, key, value, SLOPES, offset, None, SCALE, CHUNKS, floor=floor)


def smallest_exp_arguments(plan, query, key):
    """Per head, the smallest forward `exp` argument over every call of `plan` (a layer call's, `with_floors`),
    recomputed in float64 from the call's own rows, keys and mask: logit minus the row's largest visible logit in that
    call (the kernel's online maximum is never larger, so its arguments are never smaller)."""
    smallest = torch.full((len(SLOPES),), math.inf, dtype=torch.float64)
    for group in plan.groups:
        mask, _, rows, keys = plan.views(group)
        logits = rows(query).detach().double() @ keys(key).detach().double().transpose(-1, -2) * SCALE
        logits = logits + mask.double()  # (count, h, n, keys)
        visible = mask > torch.finfo(mask.dtype).min / 2  # the causal upper triangle holds the dtype's minimum
        logits = logits.masked_fill(~visible, -math.inf)
        arguments = (logits - logits.amax(-1, keepdim=True)).masked_fill(~visible, math.inf)
        heads = slice(group.head_start, group.head_end)
        smallest[heads] = torch.minimum(smallest[heads], arguments.amin(dim=(0, 2, 3)))  # (h,)
    return smallest


@PROPERTY
@given(
    st.integers(40, 300),
    st.sampled_from([0, 23]),
    st.floats(0.5, 12.0),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_floored_calls_have_no_exp_argument_below_the_limit(length, offset, bound, adversarial, seed):
    query, key, _ = inputs(length, offset, bound, adversarial, seed, torch.float32)
    plan = split_plan(SLOPES, offset, length, None, CHUNKS, 1, query.dtype).with_floors(query, key, SCALE)
    assert plan.floors is not None and plan.floors.isfinite().all(), f"not every head floored at B = {bound}"
    smallest = smallest_exp_arguments(plan, query, key)
    assert smallest.min() >= -EXP_LIMIT - 1e-3 > -87, f"exp arguments down to {smallest.tolist()}"


def test_without_the_floor_the_same_calls_reach_the_denormal_band():
    """The guard above is not vacuous: with the exact bias these inputs put exp arguments below -87."""
    query, key, _ = inputs(300, 0, 4.0, False, 0, torch.float32)
    plan = split_plan(SLOPES, 0, 300, None, CHUNKS, 1, torch.float32, floor=False)
    assert plan.with_floors(query, key, SCALE) is plan
    assert smallest_exp_arguments(plan, query, key).min() < -87


@PROPERTY
@given(
    st.integers(40, 260),
    st.sampled_from([0, 23]),
    st.floats(0.5, 12.0),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_floored_split_matches_the_exact_float64_formula_within_fp32_rounding(length, offset, bound, adversarial, seed):
    """In float64 the split is exact algebra, so what remains is the floor's own change: outputs within
    2 e^-18 max|v| (the proof's bound, < 2^-24 max|v|), gradients within the module's bounds: each row's logit
    gradients move by at most 8 e^-18 G (G = max|dO_i| max|v|), dq by that times max|k| * scale, dk by that times
    max|q| * scale summed over the rows, dv by 3 e^-18 max|dO_i| summed over the rows."""
    query, key, value = inputs(length, offset, bound, adversarial, seed)
    floors = bias_floors(query, key, SCALE, offset, offset + length)
    assert floors is not None and floors.isfinite().any()
    output = split(query, key, value, offset)
    expected, _, _ = reference_attention(query, key, value, SLOPES, scale=SCALE, offset=offset)
    largest_value = value.detach().abs().max().item()
    difference = (output - expected).abs().max().item()
    assert difference <= 2 * math.exp(-ROUNDING_NATS) * largest_value + 1e-12 < FP32_ROUNDING * largest_value
    upstream = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    got = torch.autograd.grad((output * upstream).sum(), (query, key, value))
    want = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    largest = {name: t.detach().norm(dim=-1).max().item() for name, t in zip("qkvo", (query, key, value, upstream))}
    logits = 8 * math.exp(-ROUNDING_NATS) * largest["o"] * largest["v"]  # per row: sum_j |moved dS_ij|
    bounds = {
        "q": logits * largest["k"] * SCALE,
        "k": logits * largest["q"] * SCALE * length,
        "v": 3 * math.exp(-ROUNDING_NATS) * largest["o"] * length,
    }
    for name, g, w in zip("qkv", got, want):
        difference = (g - w).abs().max().item()
        assert difference <= bounds[name] + 1e-12, f"d{name} moved by {difference:.3g} > {bounds[name]:.3g}"


def test_floored_split_in_fp32_matches_the_float64_formula_like_the_exact_one():
    """fp32 inputs: the floored split (its backward's negligible rows at +inf) is as close to the float64 formula as
    the unfloored one, outputs and gradients (what remains is the kernel's fp32 rounding)."""
    query, key, value = inputs(300, 23, 6.0, True, 1, torch.float32)
    expected, _, _ = reference_attention(query, key, value, SLOPES, scale=SCALE, offset=23)
    upstream = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    errors = {}
    for floor in (True, False):
        output = split(query, key, value, 23, floor).double()
        got = torch.autograd.grad((output * upstream).sum(), (query, key, value))
        errors[floor] = [(output - expected).abs().max().item()]
        errors[floor] += [(g.double() - w).abs().max().item() for g, w in zip(got, want)]
        assert all(math.isfinite(e) for e in errors[floor]), f"floor={floor}: NaN or inf in {errors[floor]}"
    for name, floored, exact in zip(["output", "dq", "dk", "dv"], errors[True], errors[False]):
        assert floored <= 2 * max(exact, 1e-6), f"{name}: floored {floored:.3g}, exact {exact:.3g}"


def test_floored_backward_calls_meet_no_exp_argument_in_the_denormal_band():
    """The backward's `exp(s - l)` is not bounded by the floor's proof (its l is the row's final log-sum-exp); with
    the negligible rows of per-key calls at l = +inf (`backward_lse`), none of these inputs' arguments falls in
    (-103.97, -87.34), where the exact bias puts many."""
    query, key, value = inputs(300, 0, 6.0, False, 4, torch.float32)
    expected, _, _ = reference_attention(query, key, value, SLOPES, scale=SCALE, offset=0)
    counts = {}
    for floor in (True, False):
        plan = split_plan(SLOPES, 0, 300, None, CHUNKS, 1, torch.float32, floor).with_floors(query, key, SCALE)
        lse = exact_lse(query, key)
        counts[floor] = 0
        for group in plan.groups:
            mask, shift, rows, keys = plan.views(group)
            logits = rows(query).detach().double() @ keys(key).detach().double().transpose(-1, -2) * SCALE + mask
            call_lse = rows(lse) if shift is None else rows(lse) + shift.double()
            if shift is not None and plan.floors is not None:
                call_lse = backward_lse(call_lse, rows(query).detach(), keys(key).detach(), mask, SCALE, 300)
            arguments = logits - call_lse[..., None]
            counts[floor] += int(((arguments > -103.97) & (arguments < -87.34) & (mask > -1e30)).sum())
    assert counts[True] == 0 < counts[False], counts


def exact_lse(query, key):
    """(1, H, q) float64 log-sum-exp of every row's exact causal ALiBi logits (no cache)."""
    length = query.shape[2]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    logits = query.detach().double() @ key.detach().double().transpose(-1, -2) * SCALE
    logits = (logits - SLOPES.double()[:, None, None] * (i - j)).masked_fill(j > i, -math.inf)
    return torch.logsumexp(logits, -1)


def test_a_head_whose_floor_is_not_provably_exact_keeps_its_bias_unchanged():
    """B too large for any exact floor above -EXP_LIMIT: no floor at all (None), the plan and its masks unchanged."""
    query, key, value = inputs(200, 0, 30.0, False, 2, torch.float32)
    assert bias_floors(query, key, SCALE, 0, 200) is None
    plan = split_plan(SLOPES, 0, 200, None, CHUNKS, 1, torch.float32)
    assert plan.with_floors(query, key, SCALE) is plan
    output = split(query, key, value, 0)
    assert torch.equal(output, split(query, key, value, 0, floor=False))


def test_mixed_heads_floor_only_the_feasible_ones():
    """One head with a large bound keeps its exact masks in every call; the others are floored."""
    query, key, _ = inputs(200, 0, 4.0, False, 3, torch.float32)
    with torch.no_grad():
        query[:, 0] *= 4.0
        key[:, 0] *= 4.0  # head 0: B = 64
    plan = split_plan(SLOPES, 0, 200, None, CHUNKS, 1, torch.float32)
    floored = plan.with_floors(query, key, SCALE)
    assert floored.floors[0].isinf() and floored.floors[1:].isfinite().all()
    for group in plan.groups:
        exact, raised = plan.views(group)[0], floored.views(group)[0]
        head = 0 - group.head_start
        if group.head_start == 0:
            assert torch.equal(exact[:, head], raised[:, head])
