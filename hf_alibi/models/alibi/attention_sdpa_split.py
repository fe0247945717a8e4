"""Causal ALiBi attention through SDPA kernels with no (q, kv) bias: per query chunk, one call over the keys left of
the chunk with a per-key bias, one over the chunk's diagonal block, merged exactly with their log-sum-exps.

Why it is exact. Row i's logit for a visible key j <= i is q_i . k_j * scale - m * (i - j). For the rows of a chunk
starting at absolute position p (row a sits at i = p + a), split -m * (i - j) = m * (j - p) - m * a. The last term
is a per-row constant, which softmax ignores; so over the keys j < p every row of the chunk shares the bias
m * (j - p): a (B|1, H, 1, p) mask that the fused kernel broadcasts over rows. The chunk's own diagonal block is
split the same way with smaller chunks (`SPLIT_CHUNKS`), down to small blocks with a per-row causal Toeplitz mask
-m * (a - b), built once per call. Each call returns its partial softmax output o_c and log-sum-exp l_c (l_c - m * a
in the true logits' frame for a per-key call); rows merge them as o = sum_c e^(l_c - l) o_c, l = logsumexp_c l_c,
which is the full softmax output. Both biases are smallest on the keys nearest the rows, so fp32 stays precise where
the probability mass is (unlike the +m * j shortcut); large values only ever scale exponentially small terms.

Why the backward is exact (the trick ring attention uses): flash attention's backward over any block of keys needs
only the row's final output and log-sum-exp (P = exp(S - l), dS = P * (dP - rowsum(dO * o))), so each call is
differentiated with the merged o and l, and the gradients are summed. The kernel's log-sum-exp output has no
autograd, hence the `autograd.Function`.

The kernels are PyTorch's private CPU flash ops (`aten::_scaled_dot_product_flash_attention_for_cpu` and its
backward), probed once against a float64 formula (`split_kernels_work`). The attention plan (`attention_plan.py`)
sends a call here only on CPU, without dropout, outside torch.compile / torch.export tracing, with more than one
query row and when the probe passed; every other call takes the public bias-bank path.

The floored bias (`attention_sdpa_split_floor.py`): each layer call of a causal plan raises its calls' biases to -C
per head, C from its queries' and keys' norms, where that provably keeps every forward `exp` argument out of fp32's
denormal range and the results within fp32 rounding (`SplitPlan.floor`, on in the model's causal plans;
`with_floors`). Bidirectional plans keep the exact bias (the proof is written for the causal frames).

Key ranges (`KeyRanges`, per head and block of query rows): keys before a block's first key are left out of that
block's calls for those heads, so skipped keys are never read. Blocks are then the chunks (one level); a head's
leading blocks that read every key are covered as the dense split covers rows, and each later block's call over the
keys left of it is made per run of heads that share a first key. Blocks that read as many keys back as each other
run as one strided call: certified skipping gives each head one such window per run of 16 blocks
(`shared_key_windows`), so a layer makes a few calls, not one per (head, block). With `near` widths, each head reads
the keys right before every block in calls of their own (run with the diagonals, before the certificate), and its
other keys left of the block end there; their frame is still the block's first row (bias m * (j - p), p that row's
position), which the floor's proof and the row shift assume.

Check: `HF_HUB_OFFLINE=1 python -m pytest -q tests/test_attention_sdpa_split.py`
"""

import copy
import dataclasses

import torch

from .alibi_bias import alibi_block_bias
from .attention_sdpa_split_calls import CallGroup, _cover, _group, _in_key_ranges, head_runs, near_calls
from .attention_sdpa_split_floor import bias_floors, floored
from .cpu_flash_kernels import _blocks, _SplitAttention, split_kernels_work  # noqa: F401  (the probe: this path's)

# Rows per query chunk on the split path, coarse to fine (see `SplitPlan`). Measured on one call (B=1, H=8, D=64,
# fp32, `python -m benchmarks.bench_attention_call --threads 1 --clock cpu`, 2026-11-30): against SDPA is_causal,
# (1024, 256) 1.07x at 2k and 1.04x at 8k; (768, 256), (1024, 256, 64) and (768, 256, 64) within +-3% of it, which
# is this machine's noise. The kernel tiles 256 query rows from 768 rows up and 64 below, so the first level keeps
# >= 768 rows, and the 256-row diagonal blocks (and sub-blocks) are what the per-score overhead sits in.
SPLIT_CHUNKS = (1024, 256)

# Blocks per first-level call where key ranges leave a head's leading blocks dense (`SplitPlan._ranged_calls`):
# the split's own ratio of first-level to block rows (1024 / 256)
_PREFIX_BLOCKS = SPLIT_CHUNKS[0] // SPLIT_CHUNKS[-1]


def sdpa_alibi_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slopes: torch.Tensor,
    query_offset: int,
    key_padding: torch.Tensor | None = None,
    scaling: float | None = None,
    chunks: tuple[int, ...] = SPLIT_CHUNKS,
    plan: "SplitPlan | None" = None,
    floor: bool = True,
) -> torch.Tensor:
    """Causal ALiBi attention of `query` (B, H, q, D) over `key`/`value` (B, H, kv, D); returns (B, H, q, D).

    Query row r sits at absolute position `query_offset + r` (`query_offset` = cached tokens) and sees keys
    j <= query_offset + r with bias -slopes[h] * (query_offset + r - j); keys from query_offset + q on are never read
    (a static cache may be longer).
    `key_padding` (B, kv) bool is True for real tokens. Rows with no visible key get a finite, meaningless output.
    `scaling` defaults to D ** -0.5. `plan` is these arguments' `split_plan`, built once per forward and shared by
    every layer (forward and backward), or such a plan cut to key ranges (`SplitPlan.in_key_ranges`: per head and
    block of query rows, the keys before the block's first key are left out); None builds it here, with the floored
    bias if `floor` (`attention_sdpa_split_floor.py`).
    """
    batch, heads, q_len, dim = query.shape
    if key.shape != value.shape or key.shape[:2] != (batch, heads) or key.shape[3] != dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} do not fit query {tuple(query.shape)}")
    if not 0 <= query_offset <= key.shape[2] - q_len:
        raise ValueError(f"query_offset={query_offset} must lie in [0, kv - q] = [0, {key.shape[2] - q_len}]")
    if slopes.shape != (heads,):
        raise ValueError(f"slopes must have shape ({heads},), got {tuple(slopes.shape)}")
    if key_padding is not None and key_padding.shape != (batch, key.shape[2]):
        raise ValueError(f"key_padding must have shape ({batch}, {key.shape[2]}), got {tuple(key_padding.shape)}")
    if not chunks or any(c < 1 for c in chunks) or any(a <= b for a, b in zip(chunks, chunks[1:])):
        raise ValueError(f"chunks must be decreasing positive row counts, coarse to fine, got {chunks!r}")
    if query.device.type != "cpu":
        raise ValueError(f"the split runs on the CPU flash kernels, got {query.device.type} tensors")
    scaling = dim**-0.5 if scaling is None else scaling
    if q_len == 0:
        return torch.empty_like(query)
    if plan is None:
        dtype = torch.promote_types(query.dtype, torch.float32)
        plan = split_plan(slopes.to(query.device), query_offset, q_len, key_padding, chunks, batch, dtype, floor=floor)
    elif (plan.q_len, plan.query_offset, plan.heads, plan.batch) != (q_len, query_offset, heads, batch):
        raise ValueError(
            f"the split plan is for q={plan.q_len}, query_offset={plan.query_offset}, {plan.heads} heads, "
            f"batch {plan.batch}; the call has q={q_len}, query_offset={query_offset}, {heads} heads, batch {batch}"
        )
    return split_attention(query, key, value, plan, scaling)


def split_attention(query, key, value, plan: "SplitPlan", scaling: float) -> torch.Tensor:
    """The split of `query` (B, H, q, D) over `key`/`value` (B, H, kv, D) by a plan built for these shapes, without
    re-checking them: the model's per-layer call (its plan validated the forward's inputs once). A layer in another
    dtype than the plan's masks gets the same calls with masks in its own (fp64 inputs: fp64 masks)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    if plan.dtype != dtype:
        ranged, ends, near = plan.first_keys, plan.end_keys, plan.near
        slopes = plan.slopes.to(query.device)
        facts = (plan.query_offset, plan.q_len, plan.key_padding, plan.chunks, plan.batch, dtype, plan.causal)
        plan = split_plan(slopes, *facts, plan.floor)
        if ranged is not None:
            plan = plan.in_key_ranges(torch.tensor(ranged), None if ends is None else torch.tensor(ends), near)
    return _SplitAttention.apply(query, key, value, plan.with_floors(query, key, scaling), scaling)


def split_plan(
    slopes,
    query_offset,
    q_len,
    key_padding=None,
    chunks=SPLIT_CHUNKS,
    batch=1,
    dtype=torch.float32,
    causal=True,
    floor=True,
) -> "SplitPlan":
    """Every call of the split for these facts, with its masks in `dtype` (fp32; fp64 for fp64 inputs); `causal`
    False: bidirectional (`SplitPlan`); `floor`: each layer call of a causal plan floors its biases where that is
    exact (`SplitPlan.with_floors`)."""
    slopes = slopes.to(torch.promote_types(dtype, torch.float32))  # biases, log-sum-exps and merges in it
    return SplitPlan(slopes, query_offset, q_len, key_padding, tuple(chunks), batch, causal, floor)


class SplitPlan:
    """Every kernel call of the split, with its mask, from one (H, visible) key ramp and one Toeplitz block.

    Rows are cut into `chunks[0]`-row chunks. A chunk sees the keys left of it in one call (per-key bias) and its
    own square diagonal block, which is cut the same way by the next chunk size, down to blocks of at most
    `chunks[-1]` rows that get the causal Toeplitz mask. Large first-level calls keep the kernel on its big row
    tiles (it is ~10% faster per score from 768 rows up); small last-level blocks keep the diagonal blocks' wasted
    upper halves, and the Toeplitz mask, small. With `first_keys` ((H, blocks) first key per head and block of
    `chunks[0]` rows: one level), each block's call over the keys left of it is cut into runs of heads that share
    a first key and starts there; runs whose range is empty make no call.

    A call (`SplitCall`) is rows [start, end) of heads [head_start, head_end) over keys [key_start, key_end), the
    block's own causal diagonal or not. Calls of one shape repeat at a fixed stride (every
    diagonal block; the n-th sub-block of every chunk), and their masks are equal: with batch 1 such a run becomes
    one kernel call whose batch dimension walks the sequence (a strided view, no copy), so the small calls cost one
    parallel region instead of one each (`groups`).

    `floor`: each layer call raises its biases to -C per head (`with_floors`), `floors` (H,): None in the shared plan.
    """

    def __init__(self, slopes, query_offset, q_len, key_padding, chunks, batch=1, causal=True, floor=True):
        object.__setattr__(self, "_frozen", False)
        self.floor, self.floors = floor and causal, None  # the floor's proof is written for the causal frames
        self.query_offset, self.key_padding = query_offset, key_padding
        self.heads, self.slopes = slopes.shape[0], slopes
        self.q_len, self.batch, self.dtype, self.chunks, self.causal = q_len, batch, slopes.dtype, chunks, causal
        self.visible = query_offset + q_len
        key_end = None if causal else self.visible  # bidirectional: every chunk also sees the keys right of it
        self.calls = _cover([], query_offset, 0, q_len, 0, chunks, (0, self.heads), key_end=key_end)
        self.first_keys = None  # (H, blocks) first keys as nested tuples once cut to key ranges (`in_key_ranges`)
        self.end_keys = None  # (H, blocks) end keys likewise, a bidirectional plan's keys right of each block
        self.near = None  # (H,) keys right before each block read by calls of their own (`in_key_ranges`)
        self._set_calls(self.calls)
        distance = torch.arange(self.visible, device=slopes.device, dtype=slopes.dtype)  # (visible,)
        self.ramp = -slopes[:, None] * distance.flip(0)  # (H, visible): -m * (visible - 1 - j)
        # bidirectional: keys right of a call's rows, -m * (t + 1) for the t-th of them (H, visible)
        self.fall = None if causal else -slopes[:, None] * (distance + 1)
        self.diagonal = alibi_block_bias(slopes, min(chunks[-1], q_len), causal)  # (1, H, n, n)
        self._frozen = True

    def __setattr__(self, name, value):
        """Frozen once built, like the other payloads: every layer of the forward (and the backward) shares it."""
        if self._frozen:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}: a SplitPlan is shared, read-only")
        object.__setattr__(self, name, value)

    def for_heads(self, heads: slice, plan) -> "SplitPlan":
        """The same calls for the global heads `heads` (a tensor-parallel rank's): `plan` is the attention plan
        already cut to them (its slopes and key ranges)."""
        return split_plan(
            plan.slopes,
            self.query_offset,
            self.q_len,
            self.key_padding,
            self.chunks,
            self.batch,
            self.dtype,
            self.causal,
            self.floor,
        )

    def with_floors(self, query, key, scaling: float, norms=None) -> "SplitPlan":
        """This plan for one layer call of `query` (B, H, q, D) over `key` (B, H, kv, D): its biases floored per head
        where that is exact (`bias_floors`, given the caller's `norms` of both, if any), itself where no head is (or
        `floor` is off)."""
        floors = bias_floors(query, key, scaling, self.query_offset, self.visible, norms) if self.floor else None
        if floors is None:
            return self
        call = copy.copy(self)  # the calls and masks shared; the floors its own
        object.__setattr__(call, "floors", floors.to(self.dtype))
        return call

    def in_key_ranges(self, first_key: torch.Tensor, end_key: torch.Tensor | None = None, near=None) -> "SplitPlan":
        """This plan's calls cut to `first_key` ((H, blocks) first key per head and block of `chunks[0]` rows), and
        for a bidirectional plan to `end_key` ((H, blocks): the keys from it on are left out), its masks shared: what
        a layer that certifies its own key ranges needs (a one-level plan, one per forward).

        `near` ((H,) ints, causal plans): each head reads the `near[h]` keys right before every block (fewer at the
        start) in calls of their own, which come right after the diagonal groups (`started` counts both: certified
        skipping runs them first, to certify the rest), and its other keys left of the block end there. A block's
        first key must then be at or before the block's start less its head's `near`."""
        if len(self.chunks) != 1:
            raise ValueError(f"key ranges cut a one-level plan (chunks = (rows,)), this one has {self.chunks}")
        if end_key is not None and self.causal:
            raise ValueError("end keys cut the keys right of a block's rows, which only a bidirectional plan reads")
        if near is not None and (not self.causal or len(near) != self.heads or min(near) < 0):
            raise ValueError(f"near must be {self.heads} widths >= 0 of a causal plan, got {near!r}")
        ranged = copy.copy(self)  # the masks shared; the calls its own
        object.__setattr__(ranged, "_frozen", False)
        ranged.first_keys = tuple(map(tuple, first_key.tolist()))
        ranged.end_keys = None if end_key is None else tuple(map(tuple, end_key.tolist()))
        ranged.near = None if near is None or not any(near) else tuple(int(width) for width in near)
        first = ranged._ranged_calls(ranged.first_keys, ranged.end_keys, ranged.near)
        ranged._set_calls(first, near_calls(self.query_offset, self.q_len, self.chunks[0], ranged.near or ()))
        ranged._frozen = True
        return ranged

    def _ranged_calls(self, first_keys, end_keys=None, near=None):
        """The calls that read, for each head and block, exactly the keys from its first key on (and, given
        `end_keys`, a bidirectional plan's, up to its end key).

        A head's leading blocks that read every key left of them (first key 0) are covered as the dense split covers
        rows: first-level calls of `_PREFIX_BLOCKS` blocks over the keys left of them, then each block over the keys
        from its first-level call on (`_cover`), per run of heads with as many such blocks; a bidirectional head's
        trailing blocks that read every key right of them likewise, mirrored. Their sub-block calls repeat at a
        stride and group (`_group`): a few calls where one per block was made. Every other block has its own call
        per run of heads that share its first (end) key (`_in_key_ranges`). `near` (`in_key_ranges`): each head's
        keys left of a block end that many keys before it."""
        rows, query_offset, calls = self.chunks[0], self.query_offset, []
        near = (0,) * self.heads if near is None else near
        leading = [next((b for b, first in enumerate(keys) if first > 0), len(keys)) for keys in first_keys]
        for head, end, (blocks, gap) in filter(lambda run: run[2][0], head_runs(list(zip(leading, near)))):
            cover = _cover(
                [],
                query_offset,
                0,
                min(blocks * rows, self.q_len),
                0,
                (_PREFIX_BLOCKS * rows, rows),
                (head, end),
                gap=gap,
            )
            calls += [call for call in cover if not call.diagonal]  # (the one-level plan's diagonals run below)
        rest = [
            [query_offset + b * rows if b < n else first for b, first in enumerate(keys)]  # the leading blocks: done
            for keys, n in zip(first_keys, leading)
        ]
        ends = None if end_keys is None else self._trailing_calls(calls, end_keys)
        cut = [ranged for call in self.calls for ranged in _in_key_ranges(call, rest, rows, ends, near=near)]
        return calls + cut

    def _trailing_calls(self, calls, end_keys):
        """`_ranged_calls`' mirror for a bidirectional plan (no cache): append the right-hand calls of each head's
        trailing blocks that read every key right of them, as the dense split makes them; return the end keys with
        those blocks' set to their own end (nothing left for `_in_key_ranges` to add)."""
        rows, length = self.chunks[0], self.visible
        count = len(end_keys[0])
        trailing = [count - 1 - next((b for b in reversed(range(count)) if keys[b] < length), -1) for keys in end_keys]
        for head, end, blocks in filter(lambda run: run[2], head_runs(trailing)):
            first = (count - blocks) * rows
            cover = _cover([], 0, first, length, first, (_PREFIX_BLOCKS * rows, rows), (head, end), key_end=length)
            calls += [call for call in cover if call.key_start >= call.end]  # the keys right of each chunk and block
        return [
            [min((b + 1) * rows, length) if b >= count - n else last for b, last in enumerate(keys)]
            for keys, n in zip(end_keys, trailing)
        ]

    def _set_calls(self, calls, near_part=()):
        self.calls = tuple(calls) + tuple(near_part)
        longest = max(end - start for start, end, *_ in self.calls)
        self.row_shift = self.slopes[:, None] * torch.arange(longest, device=self.slopes.device)  # (H, rows): m * a
        grouped = [
            _group(part) if self.batch == 1 else [CallGroup(1, 0, *call) for call in part]
            for part in (calls, near_part)
        ]
        # Diagonal blocks first: together they cover every row of every head once, so they start the running results;
        # then the near calls (`in_key_ranges`): `started` groups are what certified skipping computes first
        diagonals = [group for group in grouped[0] if group.diagonal]
        self.groups = tuple(diagonals + grouped[1] + [group for group in grouped[0] if not group.diagonal])
        self.started = len(diagonals) + len(grouped[1])
        # One diagonal call and nothing else (a short uncached prompt): the kernel's own result is the answer, and
        # its own backward the gradient
        self.one_call = len(self.groups) == 1 and self.groups[0].count == 1
        # One strided diagonal call over every row and head (batch 1, q a multiple of the block rows): the kernel
        # writes the running results' memory layout itself (`attend_diagonals`)
        diagonals = [group for group in self.groups if group.diagonal]
        first = diagonals[0]
        self.tiled_diagonals = (
            len(diagonals) == 1
            and self.batch == 1
            and (
                (first.start, first.count * first.end, first.head_start, first.head_end)
                == (0, self.q_len, 0, self.heads)
            )
        )

    def views(self, group):
        """A group's mask, shift (see `mask`) and the functions that cut its rows and its keys out of a tensor."""
        count, stride, start, end, key_start, key_end, diagonal, head_start, head_end = group
        heads = head_end - head_start

        def rows(tensor):  # (B|count, h, n, ...) of a (B, H, q, ...) tensor
            return _blocks(tensor.narrow(1, head_start, heads), start, end - start, stride, count)

        def keys(tensor):  # (B|count, h, keys, D) of a (B, H, kv, D) tensor
            return _blocks(tensor.narrow(1, head_start, heads), key_start, key_end - key_start, stride, count)

        return (*self.mask(*group), rows, keys)

    def add_keys(self, group, tensor, part) -> None:
        """Add `part` (B|count, h, keys, D), one piece per call of `group`, into those calls' keys of `tensor`
        (B, H, kv, D). Calls over shared windows (`shared_key_windows`) overlap in keys: added `stride` keys at a
        time, each piece's blocks apart."""
        count, stride, _, _, key_start, key_end, _, head_start, head_end = group
        keys, heads = key_end - key_start, tensor.narrow(1, head_start, head_end - head_start)
        step = keys if count == 1 else stride
        for first in range(0, keys, step):
            n = min(step, keys - first)
            _blocks(heads, key_start + first, n, stride, count).add_(part.narrow(2, first, n))

    def mask(self, count, stride, start, end, key_start, key_end, diagonal, head_start, head_end):
        """The group's mask, and the (h, n) shift from its logits' frame to the true ones (None: no shift)."""
        n, min_value, heads = end - start, torch.finfo(self.ramp.dtype).min, slice(head_start, head_end)
        if diagonal:
            mask, shift = self.diagonal[:, heads, :n, :n], None  # (1, h, n, n): -m * (a - b), min above the diagonal
        elif key_start >= self.query_offset + end:  # bidirectional, keys right of the rows: -m * (j - (p + n - 1))
            mask = self.fall[None, heads, None, : key_end - key_start]  # (1, h, 1, keys)
            shift = self.row_shift[heads, :n].flip(-1)  # (h, n): true logit = frame logit - m * (n - 1 - a)
        else:  # m * (j - p) for keys j < p, the rows' first position; ramp entry visible - 1 - p + j holds -m * (p - j)
            first = self.visible - 1 - (self.query_offset + start)
            mask = self.ramp[None, heads, None, first + key_start : first + key_end]  # (1, h, 1, keys)
            shift = self.row_shift[heads, :n]  # (h, n): true logit = chunk-frame logit - m * a
        if self.floors is not None:  # raised to -C per head; the causal upper triangle kept (padding comes next)
            mask = floored(mask, self.floors[heads])
        if self.key_padding is not None:
            keep = _blocks(self.key_padding[:, None, None], key_start, key_end - key_start, stride, count, dim=3)
            mask = mask.masked_fill(~keep, min_value)  # (B|count, h, n|1, keys)
        return mask, shift


def prepare_sdpa_split(plan, preparation):
    return split_plan(
        plan.slopes,
        plan.query_offset,
        plan.query_length,
        plan.key_padding,
        SPLIT_CHUNKS,
        plan.batch,
        dtype=preparation.dtype,
        causal=plan.causal,
    )


def sdpa_split_attention(query, key, value, plan, scaling, layer=None):
    """SDPA on the CPU flash kernels with no (q, kv) bias (`attention_sdpa_split`), the forward's calls planned (and
    its inputs validated) once: no per-layer checks."""
    return split_attention(query, key, value, plan.payload, scaling).transpose(1, 2), None  # (B, q, H, D)
