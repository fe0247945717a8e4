"""How certified skipping runs its calls (`shared_key_windows`, `SplitPlan._ranged_calls`): with batch 1 each head
reads one window of keys left of every block of a run of 16, and its leading blocks that read every key are covered as the dense
split covers rows, so a layer makes a few kernel calls instead of one per (head, block). The grouped calls read
exactly the keys of their ranges, and give the float64 reference's outputs and gradients over those keys (the windows
overlap in keys: the backward adds them in pieces)."""

import pytest
import torch
from test_attention_sdpa_split import CHUNKINGS, HEADS, SCENARIOS, SLOPES, compare

from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import KEY_BLOCK, ROWS, KeyRanges, certified_split
from hf_alibi.models.alibi.attention_sdpa_split import (
    SPLIT_CHUNKS,
    SplitPlan,
    sdpa_alibi_split,
    split_plan,
)
from hf_alibi.models.alibi.attention_sdpa_split_calls import WINDOW_BLOCKS, shared_key_windows


def certified_like_starts(slopes, offset, q_len, rows, reach_per_slope, seed=0):
    """First keys as the certificate gives them: about `rows + reach_per_slope / slope` keys back from each block,
    in whole key blocks, varying from block to block (H, blocks)."""
    blocks = offset + torch.arange(0, q_len, rows)  # (blocks,)
    generator = torch.Generator().manual_seed(seed)
    reach = rows + reach_per_slope / slopes[:, None]  # (H, 1)
    jitter = torch.randint(-2, 3, (len(slopes), len(blocks)), generator=generator) * KEY_BLOCK * rows // ROWS
    starts = (blocks[None] - reach + jitter).clamp(min=0)  # (H, blocks)
    return (starts // (KEY_BLOCK * rows // ROWS) * (KEY_BLOCK * rows // ROWS)).long().clamp(max=blocks), blocks


def expanded(plan):
    return [
        (start + i * stride, end + i * stride, key_start + i * stride, key_end + i * stride, diagonal, *heads)
        for count, stride, start, end, key_start, key_end, diagonal, *heads in plan.groups
        for i in range(count)
    ]


def assert_reads_exactly_the_ranges(plan, first_keys):
    """Expanded to single calls, `plan`'s groups cover every (row, key) from the row's block's first key
    (`first_keys` (H, blocks)) to the row exactly once."""
    offset, q_len, rows = plan.query_offset, plan.q_len, plan.chunks[0]
    count = torch.zeros(HEADS, q_len, offset + q_len, dtype=torch.int64)
    for start, end, key_start, key_end, diagonal, head_start, head_end in expanded(plan):
        block = torch.ones(end - start, key_end - key_start, dtype=torch.int64)
        count[head_start:head_end, start:end, key_start:key_end] += block.tril() if diagonal else block
    positions, keys = offset + torch.arange(q_len)[:, None], torch.arange(offset + q_len)[None]  # (q, 1), (1, kv)
    first = first_keys[:, torch.arange(q_len) // rows]  # (H, q)
    expected = ((keys <= positions)[None] & (keys[None] >= first[:, :, None])).long()  # (H, q, kv)
    assert torch.equal(count, expected)


def test_shared_windows_keep_more_keys_and_one_reach_per_head():
    starts, blocks = certified_like_starts(get_alibi_slopes(4), 0, 4096, ROWS, 24.0)
    windows = shared_key_windows(starts, blocks)  # (H, blocks)
    assert (windows <= starts).all() and (windows >= 0).all(), "a window may only keep more keys, never fewer"
    reach = blocks[None] - windows  # keys read left of each block
    for head in range(4):
        inside = windows[head] > 0  # past the leading blocks that read every key left of them
        assert reach[head, inside].unique().numel() <= 1, f"head {head} reads {reach[head].tolist()}"
        assert reach[head].max() == (blocks - starts[head]).max(), "the window is the head's longest certified reach"


def test_windows_are_shared_within_runs_of_blocks_so_one_far_reaching_block_widens_only_its_own_run():
    starts, blocks = certified_like_starts(get_alibi_slopes(4), 0, 64 * 1024, ROWS, 24.0)  # 256 blocks, 16 runs
    starts[:, 200] = 0  # one block of run 12 reads every key left of it
    windows = shared_key_windows(starts, blocks)
    assert (windows <= starts).all() and (windows >= 0).all(), "a window may only keep more keys, never fewer"
    longest = (blocks[None] - starts).unflatten(1, (-1, WINDOW_BLOCKS)).amax(-1)  # (H, runs) each run's reach
    expected = (blocks[None] - longest.repeat_interleave(WINDOW_BLOCKS, dim=1)).clamp(min=0)
    assert torch.equal(windows, expected), "each run of blocks reads its own longest reach"
    assert (longest[:, 12] == blocks[200]).all() and (longest[:, 13] < blocks[200] // 4).all(), "run 13 keeps its own"


@pytest.mark.parametrize("offset", [0, 300])
def test_grouped_calls_of_windowed_ranges_read_exactly_the_ranges_keys(offset):
    """Expanded to single calls, the groups cover every (row, key) from the row's block's first key to the row once."""
    q_len, rows = 1000, 16
    starts, blocks = certified_like_starts(SLOPES, offset, q_len, rows, 8.0)
    windows = shared_key_windows(starts, blocks)
    plan = SplitPlan(SLOPES.double(), offset, q_len, None, (rows,), 1).in_key_ranges(windows)
    assert_reads_exactly_the_ranges(plan, windows)


def test_a_layer_at_8k_on_the_demos_slopes_makes_a_few_calls_not_one_per_head_and_block():
    """8192 rows, slopes 1/4 .. 1/256, reach as `AUTO_REACH` predicts: one call per run of heads and block makes 61
    calls a layer for these starts (80 on the trained demo checkpoint); shared windows and the dense cover of the
    leading blocks make 21 (19 there), the dense split 11."""
    slopes = get_alibi_slopes(4)
    starts, blocks = certified_like_starts(slopes, 0, 8192, ROWS, 24.0)
    base = split_plan(slopes, 0, 8192, None, (ROWS,), 1)
    per_block = base.in_key_ranges(starts)
    windowed = base.in_key_ranges(shared_key_windows(starts, blocks))
    dense = split_plan(slopes, 0, 8192, None, SPLIT_CHUNKS, 1)
    calls = (len(per_block.groups), len(windowed.groups), len(dense.groups))
    assert 2 * calls[1] <= calls[0] and calls[1] <= 2 * calls[2], f"per block, windowed, dense: {calls}"


def windowed_ranges(scenario, rows, seed=0):
    q_len, _, offset, _ = SCENARIOS[scenario]
    starts, blocks = certified_like_starts(SLOPES, offset, q_len, rows, 4.0, seed)
    return KeyRanges(rows, shared_key_windows(starts, blocks))


@pytest.mark.parametrize(
    "scenario", ["self", "cache_offset", "left_padding_with_cache", "static_cache_longer_than_keys"]
)
def test_windowed_ranges_run_as_grouped_calls_match_the_reference_and_its_gradients(scenario):
    """Batch 1: each head's blocks run as one strided call over overlapping key windows; fp32 and exact in fp64."""
    ranges = windowed_ranges(scenario, rows=4)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        compare(scenario, (4,), dtype, tolerance, tolerance, model_layout=True, single_row=True, key_ranges=ranges)


def test_certified_split_of_one_row_reads_shared_windows_and_stays_within_the_bound():
    generator = torch.Generator().manual_seed(0)
    slopes = get_alibi_slopes(4)
    query, key, value = (torch.randn(1, 4, 2048, 16, generator=generator) for _ in range(3))
    with torch.no_grad():
        plan = plan_alibi_attention("sdpa", slopes, 1, 2048, 2048, skip_eps=1e-7)
        output, ranges = certified_split(query, key, value, plan, 0.25)
        dense = split_plan(slopes, 0, 2048, None, CHUNKINGS["default"], 1)
        reference = sdpa_alibi_split(query, key, value, slopes, 0, None, 0.25, plan=dense)
    blocks = torch.arange(0, 2048, ROWS)
    assert torch.equal(ranges.first_key, shared_key_windows(ranges.first_key, blocks)), "the ranges read are windows"
    assert (ranges.first_key[0, 1:] > 0).all(), "the steepest head still skips"
    bound = 2 * 1e-7 * float(value.abs().max()) + 1e-5  # Theorem 1, and fp32 rounding
    assert float((output - reference).abs().max()) <= bound


@pytest.mark.parametrize("offset", [0, 300])
def test_near_calls_and_the_rest_read_exactly_the_ranges_keys_and_the_near_calls_come_first(offset):
    """With `near` widths, each head's keys right before a block are read by calls of their own, started with the
    diagonals (`started`); with the other calls they still cover every (row, key) of the ranges once."""
    q_len, rows = 1000, 16
    starts, blocks = certified_like_starts(SLOPES, offset, q_len, rows, 8.0)
    near = tuple(rows if head % 2 else 0 for head in range(HEADS))  # some heads with near calls, some without
    widths = torch.tensor(near)[:, None]
    starts = torch.minimum(shared_key_windows(starts, blocks), (blocks[None] - widths).clamp(min=0))
    plan = SplitPlan(SLOPES.double(), offset, q_len, None, (rows,), 1).in_key_ranges(starts, near=near)
    assert_reads_exactly_the_ranges(plan, starts)
    done = plan.groups[: plan.started]
    near_groups = [group for group in done if not group.diagonal]
    assert near_groups and all(group.diagonal for group in plan.groups[: len(done) - len(near_groups)])
    for group in near_groups:
        start, key_start, key_end, head_start, head_end = (
            group.start,
            group.key_start,
            group.key_end,
            group.head_start,
            group.head_end,
        )
        assert {near[head] for head in range(head_start, head_end)} == {rows}, "near calls only for near heads"
        assert key_end == offset + start and key_end - key_start == min(rows, offset + start)
    assert not any(group.diagonal for group in plan.groups[plan.started :])


def test_near_widths_of_a_wrong_length_or_sign_or_on_a_bidirectional_plan_are_refused():
    plan = SplitPlan(SLOPES.double(), 0, 64, None, (16,), 1)
    first = torch.zeros(HEADS, 4, dtype=torch.long)
    for near in [(16,) * (HEADS - 1), (-16,) + (0,) * (HEADS - 1)]:
        with pytest.raises(ValueError, match="near must be"):
            plan.in_key_ranges(first, near=near)
    bidirectional = SplitPlan(SLOPES.double(), 0, 64, None, (16,), 1, causal=False)
    with pytest.raises(ValueError, match="near must be"):
        bidirectional.in_key_ranges(first, torch.full((HEADS, 4), 64), near=(16,) * HEADS)


@pytest.mark.parametrize("scenario", ["self", "cache_offset", "left_padding_with_cache"])
def test_ranges_with_near_calls_match_the_reference_and_its_gradients(scenario):
    """The near calls and the calls over the keys before them, each in the block's frame: fp32, and exact in fp64."""
    q_len, _, offset, _ = SCENARIOS[scenario]
    rows = 4
    starts, blocks = certified_like_starts(SLOPES, offset, q_len, rows, 4.0)
    near = tuple(rows if head % 2 == 0 else 0 for head in range(HEADS))
    starts = torch.minimum(starts, (blocks[None] - torch.tensor(near)[:, None]).clamp(min=0))
    ranges = KeyRanges(rows, starts)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        compare(scenario, (rows,), dtype, tolerance, tolerance, key_ranges=ranges, near=near)
