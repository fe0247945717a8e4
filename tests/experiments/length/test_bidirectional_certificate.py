"""The bidirectional certificate (`kept_context.certified_key_windows`) against exact float64 softmax weights.

For every drawn problem (random and adversarial: a huge key aligned with the queries far on either side, tiny query
norms, zero and steep slopes, padding holes) the softmax mass of the visible keys outside each row's window,
computed exactly from `-m |i - j|`, must be <= eps on every real row, and attention over the kept keys must equal
dense attention within 2 eps max|v| (Theorem 1 of `attention_skip`).
"""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_alibi.experiments.length.kept_context import bidirectional_kept_fraction, certified_key_windows

CHECKS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def exact_weights(query, key, value, slopes, scaling, visible):
    """Float64 bidirectional softmax weights (B, H, L, L) and outputs (B, H, L, D); `visible` (B, H|1, L, L)."""
    positions = torch.arange(query.shape[2], dtype=torch.float64)
    distance = (positions[:, None] - positions[None, :]).abs()  # (L, L)
    scores = query.double() @ key.double().transpose(-1, -2) * scaling - slopes.double()[:, None, None] * distance
    weights = torch.softmax(scores.masked_fill(~visible, -torch.inf), dim=-1).nan_to_num(0.0)
    return weights, weights @ value.double()


@st.composite
def problems(draw):
    batch, heads, dim = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 8]))
    length = draw(st.integers(1, 64))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    direction = torch.randn(1, heads, 1, dim, generator=generator)
    query = draw(st.sampled_from([1e-3, 0.3, 1.0, 3.0])) * (
        torch.randn(batch, heads, length, dim, generator=generator) + draw(st.sampled_from([0.0, 2.0])) * direction
    )  # (B, H, L, D)
    key = draw(st.sampled_from([0.3, 1.0, 3.0])) * torch.randn(batch, heads, length, dim, generator=generator)
    for _ in range(draw(st.integers(0, 2))):  # huge keys aligned with the queries, anywhere (far left or right)
        key[:, :, draw(st.integers(0, length - 1))] = draw(st.sampled_from([10.0, 40.0])) * direction[:, :, 0]
    padding = None
    if draw(st.booleans()):
        padding = torch.rand(batch, length, generator=generator) > 0.3  # (B, L) holes
    return dict(
        query=query,
        key=key,
        value=torch.randn(batch, heads, length, dim, generator=generator),
        slopes=torch.tensor([draw(st.sampled_from([0.0, 2.0**-8, 2.0**-4, 0.5, 2.0])) for _ in range(heads)]),
        scaling=draw(st.sampled_from([dim**-0.5, 1.0])),
        padding=padding,
        eps=draw(st.sampled_from([1e-7, 1e-5, 1e-2, 0.5])),
        row_block=draw(st.integers(1, 16)),
        key_block=draw(st.integers(1, 16)),
        row_group=draw(st.sampled_from([1, 2, 5])),
    )


@CHECKS
@given(problems())
def test_keys_outside_the_windows_carry_at_most_eps_and_outputs_move_within_the_bound(p):
    query, key, value, padding = p["query"], p["key"], p["value"], p["padding"]
    batch, heads, length, _ = query.shape
    starts, ends = certified_key_windows(
        query, key, p["slopes"], p["scaling"], p["eps"], p["row_block"], p["key_block"], padding, p["row_group"]
    )
    rows = torch.arange(length)
    first, last = (t.repeat_interleave(p["row_block"], dim=1)[:, :length] for t in (starts, ends))  # (H, L)
    assert bool((first <= rows).all()) and bool((last > rows).all()), "a row's own key must stay in its window"
    real = torch.ones(batch, length, dtype=torch.bool) if padding is None else padding  # (B, L)
    visible = real[:, None, None, :].expand(batch, 1, length, length)  # (B, 1, L, L)
    weights, dense = exact_weights(query, key, value, p["slopes"], p["scaling"], visible)
    inside = (rows[None, None, :] >= first[:, :, None]) & (rows[None, None, :] < last[:, :, None])  # (H, L, L)
    dropped = (weights * ~inside[None]).sum(-1)  # (B, H, L)
    worst = dropped[real[:, None, :].expand_as(dropped)].max().item() if bool(real.any()) else 0.0
    assert worst <= p["eps"], f"dropped mass {worst:.3e} > eps {p['eps']}"
    _, kept = exact_weights(query, key, value, p["slopes"], p["scaling"], visible & inside[None])
    has_keys = (visible & inside[None]).any(-1, keepdim=True) & real[:, None, :, None]  # (B, H, L, 1)
    error = ((kept - dense).abs() * has_keys).max().item()
    bound = 2 * p["eps"] * value.abs().max().item()
    assert error <= bound + 1e-12, f"output moved {error:.3e} > 2 eps max|v| = {bound:.3e}"


def test_steep_heads_keep_a_narrow_band_and_flat_heads_everything():
    """Slope 2 with unit-scale logits keeps a few keys each side; slope 0 (no decay) can drop nothing certified."""
    generator = torch.Generator().manual_seed(0)
    query, key = (0.3 * torch.randn(1, 2, 512, 16, generator=generator) for _ in range(2))
    starts, ends = certified_key_windows(query, key, torch.tensor([2.0, 0.0]), 16**-0.5, 1e-7, 64, 16)
    kept = bidirectional_kept_fraction(starts, ends, 512, 64)  # (H,)
    assert kept[0] < 0.3 and kept[1] == 1.0, kept.tolist()
