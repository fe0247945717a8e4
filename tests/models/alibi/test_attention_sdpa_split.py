"""`sdpa_alibi_split` (the split SDPA path) against the ALiBi formula in float64: outputs and q/k/v gradients.

Reference (`alibi_reference.py`): softmax(q . k * scale - m_h * (i - j)) @ v over keys j <= i that are not
padding, query row r at absolute position offset + r. Rows with no visible key have no defined output: they are
left out of comparisons (their loss weight is 0, as for padding in a model) but must stay finite.
"""

import pytest
import torch

from alibi_reference import reference_attention
from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_certified import KeyRanges
from hf_alibi.models.alibi.attention_sdpa_split import (
    SPLIT_CHUNKS,
    SplitPlan,
    sdpa_alibi_split,
    split_kernels_work,
    split_plan,
)

HEADS, DIM = 12, 8
SCALE = DIM**-0.5
SLOPES = get_alibi_slopes(HEADS)


def reference(query, key, value, offset, key_padding=None, first_key=None):
    """`alibi_reference.reference_attention` with this file's slopes and scale: output (B, H, q, D), has_keys."""
    output, _, has_keys = reference_attention(
        query, key, value, SLOPES, scale=SCALE, offset=offset, key_padding=key_padding, first_key=first_key
    )
    return output, has_keys


def real(lengths, total, side):
    """(B, total) bool, True = real token: `lengths[b]` real tokens on the right (left padding) or on the left."""
    positions, lengths = torch.arange(total)[None], torch.tensor(lengths)[:, None]
    return positions >= total - lengths if side == "left" else positions < lengths


# (query length, key length, offset, key padding); lengths are not multiples of the test chunks
SCENARIOS = {
    "self": (37, 37, 0, None),
    "cache_offset": (5, 29, 24, None),
    "one_token_decode": (1, 20, 19, None),
    "left_padding": (37, 37, 0, real([37, 20, 3], 37, "left")),
    "right_padding": (37, 37, 0, real([37, 20, 3], 37, "right")),
    "left_padding_with_cache": (19, 40, 21, real([40, 33, 25], 40, "left")),
    "fully_padded_sequence": (21, 21, 0, real([21, 0, 5], 21, "left")),
    "static_cache_longer_than_keys": (6, 30, 17, None),  # keys 23..29 are unwritten cache slots
    "decode_with_padding": (1, 20, 19, real([20, 7, 1], 20, "left")),
}
CHUNKINGS = {"three_levels": (16, 8, 3), "one_level": (8,), "default": SPLIT_CHUNKS}


def qkv(batch, q_len, kv_len, dtype=torch.float32, model_layout=False):
    """(B, H, L, D) query, key, value; with `model_layout`, views of (B, L, H, D) tensors, as the model passes them."""
    if not model_layout:
        return [torch.randn(batch, HEADS, n, DIM, dtype=dtype).requires_grad_() for n in (q_len, kv_len, kv_len)]
    bases = [torch.randn(batch, n, HEADS, DIM, dtype=dtype).requires_grad_() for n in (q_len, kv_len, kv_len)]
    return [base.transpose(1, 2) for base in bases]  # (B, H, L, D), strided


def compare(scenario, chunks, dtype, atol, grad_atol, model_layout=False, single_row=False, key_ranges=None, near=None):
    """Outputs and gradients of the split against the float64 reference (`single_row`: batch 1, the padded row)."""
    q_len, kv_len, offset, key_padding = SCENARIOS[scenario]
    if single_row and key_padding is not None:
        key_padding = key_padding[1:2]
    batch = 1 if single_row else 2 if key_padding is None else key_padding.shape[0]
    query, key, value = qkv(batch, q_len, kv_len, dtype, model_layout)
    plan, first_key = None, None
    if key_ranges is not None:  # the split's internal ranges (what certified skipping cuts a plan to); (H, q)
        plan = split_plan(SLOPES, offset, q_len, key_padding, (key_ranges.rows,), batch, query.dtype)
        plan = plan.in_key_ranges(key_ranges.first_key, near=near)
        first_key = key_ranges.first_key[:, torch.arange(q_len) // key_ranges.rows]
    output = sdpa_alibi_split(query, key, value, SLOPES, offset, key_padding, SCALE, chunks, plan=plan)
    expected, has_keys = reference(query, key, value, offset, key_padding, first_key)
    assert output.shape == query.shape and output.dtype == dtype
    assert torch.isfinite(output).all(), "NaN or inf in the output (rows without keys must stay finite)"
    difference = (output.double() - expected).abs().masked_fill(~has_keys, 0).max().item()
    assert difference <= atol, f"largest output difference from the reference {difference:.3g} > {atol}"

    upstream = torch.randn(expected.shape, dtype=torch.float64).masked_fill(~has_keys, 0)  # (B, H, q, D)
    got = torch.autograd.grad((output.double() * upstream).sum(), (query, key, value))
    want = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), f"NaN or inf in the gradient of {name}"
        difference = (g.double() - w).abs().max().item()
        assert difference <= grad_atol, f"d{name}: largest difference from the reference {difference:.3g}"


@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_split_matches_reference_formula_and_gradients_fp32(scenario, chunks):
    compare(scenario, chunks, torch.float32, atol=1e-5, grad_atol=1e-5, model_layout=True)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_split_is_exact_algebra_in_fp64(scenario):
    compare(scenario, CHUNKINGS["three_levels"], torch.float64, atol=1e-12, grad_atol=1e-12)


@pytest.mark.parametrize("scenario", ["self", "left_padding_with_cache", "fully_padded_sequence"])
def test_split_close_to_reference_in_bf16_under_autocast(scenario):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compare(scenario, CHUNKINGS["three_levels"], torch.bfloat16, atol=2e-2, grad_atol=5e-2)


def test_default_chunks_past_one_first_level_chunk_match_reference():
    """1100 tokens: two 1024-row chunks (the second partial), each cut into 256-row blocks."""
    query, key, value = (torch.randn(1, 2, 1100, 16).requires_grad_() for _ in range(3))
    slopes = get_alibi_slopes(2)
    output = sdpa_alibi_split(query, key, value, slopes, 0, None, 0.25)
    expected, _, _ = reference_attention(query, key, value, slopes, scale=0.25, offset=0)  # (1, H, q, D)
    assert (output.double() - expected).abs().max().item() <= 1e-5
    upstream = torch.randn(expected.shape, dtype=torch.float64)
    got = torch.autograd.grad((output.double() * upstream).sum(), (query, key, value))
    want = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    assert max((g.double() - w).abs().max().item() for g, w in zip(got, want)) <= 1e-5


@pytest.mark.parametrize("q_len, offset, chunks", [(37, 0, (16, 8, 3)), (19, 21, (8, 3)), (1100, 5, SPLIT_CHUNKS)])
def test_split_plan_covers_every_visible_key_exactly_once(q_len, offset, chunks):
    plan = SplitPlan(SLOPES, offset, q_len, None, chunks)
    count = torch.zeros(q_len, offset + q_len, dtype=torch.int64)
    for start, end, key_start, key_end, diagonal, head_start, head_end in plan.calls:
        assert (head_start, head_end) == (0, HEADS)
        block = torch.ones(end - start, key_end - key_start, dtype=torch.int64)
        count[start:end, key_start:key_end] += block.tril() if diagonal else block
    causal = torch.ones(q_len, offset + q_len, dtype=torch.int64).tril(offset)
    assert torch.equal(count, causal)


@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS.keys())
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_batch_of_one_runs_same_shape_blocks_as_one_call_and_matches_reference(scenario, chunks):
    """With batch 1, runs of same-shape calls go to the kernel as one call whose batch walks the sequence."""
    compare(scenario, chunks, torch.float32, atol=1e-5, grad_atol=1e-5, model_layout=True, single_row=True)


@pytest.mark.parametrize("q_len, offset, chunks", [(37, 0, (16, 8, 3)), (19, 21, (8, 3)), (1100, 5, SPLIT_CHUNKS)])
def test_grouped_calls_are_exactly_the_plans_calls(q_len, offset, chunks):
    plan = SplitPlan(SLOPES, offset, q_len, None, chunks, batch=1)
    expanded = [
        (start + i * stride, end + i * stride, key_start + i * stride, key_end + i * stride, diagonal, *heads)
        for count, stride, start, end, key_start, key_end, diagonal, *heads in plan.groups
        for i in range(count)
    ]
    assert sorted(expanded) == sorted(plan.calls)
    assert len(plan.groups) < len(plan.calls)  # the diagonal blocks, at least, share one call
    first_prefix = next(i for i, group in enumerate(plan.groups) if not group[6])
    assert all(group[6] for group in plan.groups[:first_prefix])  # diagonal groups write the running result first
    assert not any(group[6] for group in plan.groups[first_prefix:])


def key_ranges_for(scenario, rows, seed=0):
    """Random first keys per (head, block of `rows` query rows), from 0 up to the block's first query position."""
    q_len, _, offset, _ = SCENARIOS[scenario]
    blocks = -(-q_len // rows)
    limit = offset + torch.arange(blocks) * rows  # (blocks,) each block's first query position
    generator = torch.Generator().manual_seed(seed)
    first = (torch.rand(HEADS, blocks, generator=generator) * (limit + 1)).long()  # (H, blocks)
    first[: HEADS // 3] = first[0]  # a run of heads sharing first keys: one call for the run
    first[-1] = 0  # a dense head
    return KeyRanges(rows, first)


@pytest.mark.parametrize("single_row", [False, True], ids=["batch", "batch_of_one"])
@pytest.mark.parametrize(
    "scenario", ["self", "cache_offset", "left_padding_with_cache", "static_cache_longer_than_keys"]
)
def test_key_ranges_leave_out_exactly_the_keys_before_each_blocks_first_key(scenario, single_row):
    """Per (head, query block) key ranges against the reference with those keys masked: outputs and gradients."""
    ranges = key_ranges_for(scenario, rows=8)
    compare(scenario, (64,), torch.float32, 1e-5, 1e-5, model_layout=True, single_row=single_row, key_ranges=ranges)


def test_key_ranges_never_read_the_skipped_keys():
    q_len, kv_len, offset, _ = SCENARIOS["self"]
    ranges = key_ranges_for("self", rows=8, seed=1)
    plan = SplitPlan(SLOPES, offset, q_len, None, (8,), 2).in_key_ranges(ranges.first_key)
    for start, _end, key_start, _key_end, diagonal, head_start, head_end in plan.calls:
        if not diagonal:
            assert (ranges.first_key[head_start:head_end, start // 8] <= key_start).all()


def test_probe_accepts_todays_kernels_even_from_inference_mode():
    split_kernels_work.cache_clear()
    try:
        with torch.inference_mode():
            assert split_kernels_work()
    finally:
        split_kernels_work.cache_clear()


def test_probe_rejects_a_kernel_whose_log_sum_exp_changed_meaning(monkeypatch):
    real_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def base_two_lse(*args, **kwargs):  # e.g. a future kernel returning log2 of the normaliser
        output, lse = real_op(*args, **kwargs)
        return output, lse * 1.4426950408889634

    split_kernels_work.cache_clear()
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", base_two_lse)
    try:
        assert not split_kernels_work()
    finally:
        split_kernels_work.cache_clear()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(query_offset=30), "query_offset=30"),
        (dict(query_offset=-1), "query_offset=-1"),
        (dict(slopes=torch.ones(3)), "slopes must have shape"),
        (dict(key_padding=torch.ones(2, 5, dtype=torch.bool)), "key_padding must have shape"),
        (dict(chunks=(8, 16)), "chunks must be decreasing"),
        (dict(chunks=()), "chunks must be decreasing"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, message):
    query, key, value = qkv(2, 5, 29)
    arguments = dict(slopes=SLOPES, query_offset=24, key_padding=None, scaling=SCALE, chunks=(8, 3)) | change
    with pytest.raises(ValueError, match=message):
        sdpa_alibi_split(query, key, value, **arguments)


def test_no_query_rows_give_an_empty_output():
    query, key, value = qkv(2, 0, 7)
    assert sdpa_alibi_split(query, key, value, SLOPES, 7, None, SCALE).shape == (2, HEADS, 0, DIM)


def test_rows_without_keys_keep_gradients_finite_even_when_the_loss_reads_them():
    q_len, kv_len, offset, key_padding = SCENARIOS["fully_padded_sequence"]
    query, key, value = qkv(key_padding.shape[0], q_len, kv_len)
    output = sdpa_alibi_split(query, key, value, SLOPES, offset, key_padding, SCALE, chunks=(8, 3))
    for name, grad in zip("qkv", torch.autograd.grad(output.sum(), (query, key, value))):
        assert torch.isfinite(grad).all(), f"NaN or inf in the gradient of {name}"


@pytest.mark.parametrize("callers_mode", [False, True])
def test_backward_keeps_the_callers_denormal_mode_and_gives_float64_gradients_either_way(callers_mode):
    """Far calls' probabilities exp(S - l) underflow to denormals in the backward: the split computes them in whatever
    mode the caller set (it never changes a thread's mode; `hf_alibi/native_flush.py` is the caller's opt-in), and
    the gradients equal float64's to fp32 rounding with denormals kept or flushed."""

    def flushing():
        return float(torch.tensor([1e-39]) * 2.0) == 0.0

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 600, 8, generator=generator).requires_grad_() for _ in range(3))
    slopes, grad = torch.tensor([0.5, 2.0**-6]), torch.randn(1, 2, 600, 8, generator=generator)
    try:
        torch.set_flush_denormal(callers_mode)
        output = sdpa_alibi_split(query, key, value, slopes, 0, None, 8**-0.5, chunks=(256, 64))
        flushed = torch.autograd.grad(output, (query, key, value), grad)
        assert flushing() == callers_mode, "the split changed the caller's denormal mode"
    finally:
        torch.set_flush_denormal(False)
    exact = [t.detach().double().requires_grad_() for t in (query, key, value)]
    positions = torch.arange(600)
    distance = (positions[:, None] - positions[None, :]).double()  # (q, kv)
    scores = exact[0] @ exact[1].transpose(-1, -2) * 8**-0.5 - slopes.double()[:, None, None] * distance
    scores = scores.masked_fill(distance < 0, -torch.inf)
    expected = torch.autograd.grad(torch.softmax(scores, -1) @ exact[2], exact, grad.double())
    for got, want in zip(flushed, expected):
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("threads", [2, 3])
def test_a_one_head_calls_backward_cut_into_row_parts_for_the_threads_is_the_kernels_own(threads):
    """`_flash_backward` cuts a one-head call's rows into parts stacked on the batch dimension (the kernel spreads
    its backward over batch x heads only); the gradients are the uncut kernel's, to fp32 rounding."""
    from hf_alibi.models.alibi.cpu_flash_kernels import _flash, _flash_backward

    if not split_kernels_work():
        pytest.skip("the CPU flash kernels are not usable here")
    torch.manual_seed(0)
    query, key, value = torch.randn(1, 1, 384, 16), torch.randn(1, 1, 700, 16), torch.randn(1, 1, 700, 16)
    mask = -(torch.arange(700).flip(0).float() / 64)[None, None, None, :]  # (1, 1, 1, keys): a per-key ALiBi ramp
    output, lse = _flash(query, key, value, mask, 0.25)
    grad = torch.randn_like(output)
    whole = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, output, lse, 0.0, False, attn_mask=mask, scale=0.25
    )
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        parts = _flash_backward(grad, query, key, value, output, lse, mask, 0.25)
    finally:
        torch.set_num_threads(before)
    for name, got, want in zip(("dq", "dk", "dv"), parts, whole):
        assert got.shape == want.shape, f"{name}: {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.allclose(got, want, atol=1e-5), f"{name}: largest difference {(got - want).abs().max():.3g}"


def test_a_split_plan_is_read_only_like_the_other_payloads():
    """Every layer of a forward (and its backward) shares the plan: neither it nor a plan cut to key ranges changes."""
    import dataclasses

    plan = split_plan(SLOPES, 0, 16, None, (8,), 1)
    ranged = plan.in_key_ranges(torch.zeros(HEADS, 2, dtype=torch.long))
    for shared in (plan, ranged):
        with pytest.raises(dataclasses.FrozenInstanceError):
            shared.calls = ()
        assert isinstance(shared.calls, tuple) and isinstance(shared.groups, tuple)
    assert plan.first_keys is None and ranged.first_keys == ((0, 0),) * HEADS
