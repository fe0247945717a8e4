"""The kernel calls the CPU split makes (`attention_sdpa_split.SplitPlan`): which rows of which heads over which keys,
and how calls of one shape that repeat at a stride group into one kernel call.

Check: `HF_HUB_OFFLINE=1 python -m pytest -q tests/models/alibi/test_attention_sdpa_split.py`
"""

import itertools
from typing import NamedTuple

import torch
import torch.nn.functional as F


class SplitCall(NamedTuple):
    """One kernel call of the split: query rows [start, end) of heads [head_start, head_end) over keys
    [key_start, key_end); `diagonal` for a block's own square (Toeplitz mask), else keys left (or right) of it."""

    start: int
    end: int
    key_start: int
    key_end: int
    diagonal: bool
    head_start: int
    head_end: int


# `count` calls of one shape, the first one's `SplitCall` fields after them, repeating every `stride` rows and keys:
# one kernel call whose batch dimension walks the blocks (`SplitPlan.groups`)
CallGroup = NamedTuple("CallGroup", [("count", int), ("stride", int), *SplitCall.__annotations__.items()])


def _cover(calls, query_offset, first, last, key_start, chunks, heads, level=0, key_end=None, gap=0):
    """`calls` with the calls for rows [first, last) of heads [heads[0], heads[1]) over keys [key_start, query_offset +
    last) appended: per chunk of `chunks[level]` rows, the keys left of it, then the chunk cut by the next level.
    Bidirectional (`key_end`, the end of the keys these rows see): each chunk's keys right of it, up to `key_end`,
    in one call too (the mirror image of the keys left of it). `gap`: the `gap` keys right before each block of
    `chunks[-1]` rows are read by calls of their own (`near_calls`), so the keys left of a chunk end `gap` before it,
    and each block reads from there to `gap` before itself."""
    if last - first <= chunks[-1]:
        if query_offset + first - gap > key_start:
            calls.append(SplitCall(first, last, key_start, query_offset + first - gap, False, *heads))
        calls.append(SplitCall(first, last, query_offset + first, query_offset + last, True, *heads))
        if key_end is not None and query_offset + last < key_end:
            calls.append(SplitCall(first, last, query_offset + last, key_end, False, *heads))
        return calls
    for start in range(first, last, chunks[level]):
        end = min(start + chunks[level], last)
        left_end = query_offset + start - gap
        if left_end > key_start:
            calls.append(SplitCall(start, end, key_start, left_end, False, *heads))
        inner_end = None if key_end is None else query_offset + end
        inner_start = max(key_start, left_end)
        _cover(calls, query_offset, start, end, inner_start, chunks, heads, level + 1, inner_end, gap)
        if key_end is not None and query_offset + end < key_end:
            calls.append(SplitCall(start, end, query_offset + end, key_end, False, *heads))
    return calls


def near_calls(query_offset: int, q_len: int, rows: int, near) -> list[SplitCall]:
    """Per run of heads with the same `near` width w > 0 ((H,) ints) and per block of `rows` query rows, one call over
    the w keys right before the block (fewer at the start): what certified skipping computes before it certifies."""
    calls = []
    for head, end, width in head_runs(near):
        for start in range(0, q_len, rows) if width > 0 else ():
            position = query_offset + start
            if position > 0:
                calls.append(
                    SplitCall(start, min(start + rows, q_len), max(0, position - width), position, False, head, end)
                )
    return calls


def _in_key_ranges(call, first_keys, rows, last_keys=None, query_offset=0, near=None):
    """A call cut to the key ranges of its block: one call per run of heads with the same first key (keys left of the
    rows) or, given `last_keys`, the same end key (keys right of them: a bidirectional plan), if any keys remain.
    `near` ((H,) ints): each head's keys left of the rows end that many keys before them (`near_calls` reads those)."""
    start, end, key_start, key_end, diagonal, _, heads = call
    if diagonal:  # a block's own diagonal is always kept (first keys never pass a block's first query)
        return [call]
    if key_start >= query_offset + end:  # keys right of the rows
        if last_keys is None:
            return [call]
        runs = head_runs([last_keys[head][start // rows] for head in range(heads)])
        return [
            SplitCall(start, end, key_start, min(key_end, last), False, head, run_end)
            for head, run_end, last in runs
            if key_start < min(key_end, last)
        ]
    near = (0,) * heads if near is None else near
    runs = head_runs([(first_keys[head][start // rows], key_end - near[head]) for head in range(heads)])
    return [
        SplitCall(start, end, max(key_start, first), last, False, head, run_end)
        for head, run_end, (first, last) in runs
        if max(key_start, first) < last
    ]


# Blocks that share one window (`shared_key_windows`): 16 blocks of 256 rows are 4,096 rows a call
WINDOW_BLOCKS = 16


def shared_key_windows(first_key: torch.Tensor, block_starts: torch.Tensor, segment: int = WINDOW_BLOCKS):
    """First keys (H, blocks) no later than `first_key`'s, each head reading one window of keys left of every block
    of each run of `segment` blocks.

    Certified skipping may keep more keys than it certified (each dropped set only shrinks). A head keeps, left of
    each block starting at `block_starts` (blocks,), the longest reach any block of its run needs; every block of the
    run then has the same shape at the same stride, and `_group` runs them as one kernel call instead of one per
    block. The per-block calls are what lost under load: each is a parallel region whose threads wait for the
    slowest, and a preempted one holds them all. Runs of a fixed number of blocks keep the calls few at any length
    while the widening stays local: one reach for the whole sequence would be the largest of ever more blocks as
    the input grows, and the work with it.
    """
    blocks = first_key.shape[1]
    reach = F.pad(block_starts[None] - first_key, (0, -blocks % segment))  # (H, runs * segment) keys left of a block
    reach = reach.unflatten(1, (-1, segment)).amax(-1).repeat_interleave(segment, dim=1)[:, :blocks]  # (H, blocks)
    return (block_starts[None] - reach).clamp(min=0)  # (H, blocks)


def head_runs(first_keys) -> list[tuple[int, int, int]]:
    """(first head, end head, first key) of each run of consecutive heads that share a first key: one call each."""
    runs, head = [], 0
    for first, members in itertools.groupby(first_keys):
        count = len(list(members))
        runs.append((head, head + count, first))
        head += count
    return runs


def _group(calls):
    """Runs of same-shape calls at a fixed stride: (count, stride, *call) each.

    The stride is at least the rows of one call, so a run's query blocks never overlap. Keys may: a run of calls over
    the same window of keys left of each block (`shared_key_windows`) reads overlapping keys, which the forward only
    reads and the backward adds into in pieces of `stride` keys (`SplitPlan.add_keys`).
    """
    buckets = {}
    for call in calls:
        start, end, key_start, key_end, diagonal, head_start, head_end = call
        shape = (end - start, key_end - key_start, key_start - start, diagonal, head_start, head_end)
        buckets.setdefault(shape, []).append(call)
    runs = []
    for (rows, _keys, *_), members in buckets.items():
        members.sort()
        runs.append([members[0]])
        for call in members[1:]:
            run = runs[-1]
            stride = call.start - run[-1].start
            if stride >= rows and (len(run) == 1 or stride == run[1].start - run[0].start):
                run.append(call)
            else:
                runs.append([call])
    return [CallGroup(len(run), run[1].start - run[0].start if len(run) > 1 else 0, *run[0]) for run in runs]
