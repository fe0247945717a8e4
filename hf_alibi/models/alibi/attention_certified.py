"""Certified key ranges for one layer's attention call (`alibi_skip_eps`), from the bounds of `attention_skip.py`.

A plan on a certified path (`choose_path` picks one for `skip_eps > 0`, in training too) has every layer turn its
own queries and keys into `KeyRanges`: per head and block of `ROWS` query rows, the first key whose predecessors'
softmax mass is certified <= eps (`certified_key_starts`):
- prefill on the split (`sdpa_split_certified`, `certified_split`): each block's own diagonal first, on the kernel;
  its log-sum-exp is the lower bound on each row's (Theorem 4), far tighter than the diagonal logit on flat heads;
  then the certificate, then only the kept keys left of each block, merged into the diagonal's results;
- prefill on FlexAttention (`flex_attention_certified`, `certified_flex_ranges`): the ranges before the call, from
  the diagonal logit (Theorem 2), as per-head block masks;
- decoding (`sdpa_decode_certified`, one query row over a dynamic cache, `certified_decode_ranges`): per head, from
  the current query's norm, its diagonal logit and the running maximum of key norms per block of cache positions
  (`attention_key_norms.RunningKeyNorms`), so a step costs the kept keys, not a pass over the whole cache.
Every output moves by at most 2 * eps * max|v| (Theorem 1 there). Each certified path's payload (below) is built
once per forward by its `prepare_*`; the ranges are the layer's own.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .attention_flex import flex_block_mask, flex_over_blocks
from .attention_plan import AUTO_EPS, AlibiAttentionPlan, Preparation, mask_in_dtype  # noqa: F401
from .attention_sdpa import BiasBank, bias_bank, decode_in_ranges
from .attention_sdpa_split import SplitPlan, split_plan
from .attention_sdpa_split_calls import shared_key_windows
from .attention_skip import (  # noqa: F401  (KeyRanges: the certified paths' ranges, imported from here too)
    KeyRanges,
    certified_decode_start,
    certified_key_starts,
    kernel_lse_lower_bound,
    key_block_norms,
    upper_norms,
)
from .cpu_flash_kernels import _SplitAttention, attend, attend_diagonals

# Query rows per block of the certificate, and the split's one level of blocks when skipping. Finer blocks follow
# steep heads more closely; 256 rows keep the kernel's calls large enough (measured on the demo checkpoint at 8k:
# 0.382 of causal work kept with 256-row blocks, 0.404 with 512, 0.445 with 1024).
ROWS = 256
# Keys per block of the bound. Finer blocks certify more of the steep heads (results/skip/kept_fraction.md: at 8k on
# the demo checkpoint 0.356 of causal work kept with 64-key blocks against 0.381 with 256) for 4x the bound's work.
KEY_BLOCK = 64
# FlexAttention's prefill, where no kernel has computed a block first, bounds each row's log-sum-exp from below by its
# diagonal logit (Theorem 2; decoding uses it too). On the demo checkpoint at 8k, 32 near keys certified 0.352 of
# causal work against 0.381, but their float64 products cost more than they save (`benchmarks/skip_research.py`).
# The split needs none: its diagonal blocks' log-sum-exps (Theorem 4) certify 0.382 against the diagonal logit's 0.399
# at no extra cost (the exact log-sum-exp of every key would give 0.353; an oracle that knows the dropped mass, 0.304).
# Rows bounded together (sorted by query norm): 16x less work than row by row, for 0.001 more kept work at 8k
# (0.3803 / 0.3818 with 4 / 16 rows; 0.3923 with 16 rows unsorted).
ROW_GROUP = 16

# `alibi_skip_eps="auto"`: where skipping (with `AUTO_EPS`) pays on CPU (the split's prefill and training step, the segmented
# decoding step).
# Each head's kept keys per row reach about `ROWS + AUTO_REACH / slope` back (the block, then the distance at which
# ALiBi's decay outweighs the logits: on the demo checkpoint at 8k and 32k, slopes 1/4 .. 1/256 kept 0.062, 0.125,
# 0.386, 0.955 and 0.016, 0.032, 0.106, 0.359 of causal work, which this predicts to within 0.03). Skipping pays where
# the predicted kept work, averaged over heads, is at most `AUTO_PREFILL_KEPT` of a prefill's causal work or
# `AUTO_DECODE_KEPT` of a decoding step's keys. Measured on that checkpoint (`benchmarks/bench_skip.py`), skip / dense:
# - prefill: kept 0.67 at 2k: 1.09x on an AMD EPYC, 0.86x on an Intel Xeon (AMX); 0.51 at 4k: 0.67x (Xeon); 0.38 at
#   8k: 0.70x (EPYC), 0.43x (Xeon). The threshold skips from 4k: the EPYC's loss at 2k is not taken;
# - decoding (each step a few fixed operations per run of heads): kept 0.24 at 8k: 1.16x (EPYC), 1.52x (Xeon); 0.12
#   at 16k: 0.84x (EPYC), 0.65x (Xeon). Both skip from ~12k-16k of context.
# With denormals flushed on every thread (then done by attention, now the opt-in `hf_alibi/native_flush.py`), Xeon:
# prefill 1.11x at 2k, 0.88x at 4k, 0.58-0.65x at 8k; decoding 1.05x at 8k, 0.55x at 16k; a training step (forward
# and backward: the prefill's rule) 0.73-0.83x at 4k, 0.55-0.59x at 8k. The thresholds still fall where it stops paying.
# On a busy machine (the Intel Xeon, 2 busy processes beside each measured one, torch's 2 threads, load average 7-10;
# `python -m benchmarks.bench_skip --forward 4096,8192 --decode 0 --contestants alibi-dense,alibi-auto --load 2
# --processes 2 --repeats 1`, results/skip/auto_under_load*.md), with the per-head windows of `certified_split`:
# prefill kept 0.52 at 4k: 1.27x and 1.61x of dense in two runs; 0.40 at 8k: 0.57x. A default must not lose there,
# so the prefill threshold sat between them, at 0.45 (the demo slopes skipped from ~6.2k tokens; was 0.55, from 4k).
# On a host shared with other test processes instead (no added load, load average 3-4.5, 4 interleaved processes each;
# `--forward 8192,16384 --contestants alibi-dense,alibi-auto --processes 4`, results/skip/auto_shared_host_8k_16k.md):
# kept 0.39 at 8k: 1.15x of dense; 0.24 at 16k: 0.61x (8k again, results/skip/shared_host_8k_recheck/: 1.12x and
# 1.22x beside two test processes, 0.57x and 0.76x beside one). A default must lose on no shared machine measured, so
# the threshold sits between those, at 0.32: the demo slopes skip a prefill (and a training step) from ~11.3k tokens.
AUTO_REACH = 24.0
AUTO_PREFILL_KEPT = 0.32
AUTO_DECODE_KEPT = 0.15
# An encoder's bidirectional rows (`certified_split` with end keys too), the same prediction (each side is a causal
# prefill's share). Measured on the masked LM of `recipes/train_mlm.py --config mlm_demo` (4 heads, slopes 1/4 ..
# 1/256), real text, skip (eps 1e-7) / dense, 2 fresh processes each (`python -m benchmarks.bench_skip --checkpoint
# /work/ckpt/mlm_demo/final --forward 2048,4096,8192,16384 --contestants bert-sdpa,alibi-dense,alibi-skip`,
# results/skip/encoder_skip.md): predicted kept 0.70 at 2k: 1.13x (0.97x in an earlier run); 0.53 at 4k: 0.80x;
# 0.39 at 8k: 0.55x; 0.24 at 16k: 0.37x; with two busy processes beside each (`--load 2 --processes 3`,
# results/skip/encoder_skip_under_load.md): 0.87x at 4k, 0.62x at 8k. The threshold sits between 2k and 4k.
AUTO_BIDIRECTIONAL_KEPT = 0.55


def predicted_kept(slopes: torch.Tensor, query_length: int, key_length: int) -> float:
    """The fraction of key work certified skipping is predicted to keep, averaged over heads (the reach of
    `AUTO_REACH`): of a decoding row's `key_length` keys, or of a prefill's causal (query, key) pairs. Plain floats:
    a decoding step asks once per forward, and tensor ops would cost more than the answer saves. An encoder's rows
    keep the reach on both sides of each row, and that share of its L x L pairs is the same number: each side is a
    causal prefill's kept share of its half."""
    length = float(key_length)  # a prefill's rows end at the last of `key_length` keys: causal work ~ length^2 / 2
    kept = 0.0
    for slope in slopes.tolist():
        reach = min(ROWS + AUTO_REACH / max(slope, 1e-12), length)  # keys kept back from each row
        kept += reach / length if query_length == 1 else reach * (2 * length - reach) / length**2
    return kept / len(slopes)


def near_widths(slopes: torch.Tensor, rows: int = ROWS) -> tuple[int, ...] | None:
    """Per head, how many keys right before each block of `rows` query rows a causal `certified_split` reads with the
    block's diagonal, before it certifies: `rows` for the heads whose predicted reach beyond the block
    (`AUTO_REACH / slope`) is at least that, so they keep those keys anyway; 0 for the others; None when no head does.
    Their log-sum-exp raises each row's lower bound (Theorem 4 over more keys): on the demo checkpoint nearly to the
    exact log-sum-exp's (`python -m benchmarks.compare_lse_bounds`, results/length_scaling/lse_bounds.md)."""
    widths = tuple(rows if rows * slope <= AUTO_REACH else 0 for slope in slopes.tolist())
    return widths if any(widths) else None


def skipping_pays(slopes: torch.Tensor, query_length: int, key_length: int, causal: bool = True) -> bool:
    """Whether `alibi_skip_eps="auto"` skips for this call's shape and the heads' slopes (CPU, measured above);
    `causal` False: an encoder's bidirectional rows."""
    kept = predicted_kept(slopes, query_length, key_length)
    if not causal:
        return kept <= AUTO_BIDIRECTIONAL_KEPT
    return kept <= (AUTO_DECODE_KEPT if query_length == 1 else AUTO_PREFILL_KEPT)


@dataclass(frozen=True, eq=False)
class CertifiedSplit:
    """`sdpa_split_certified`: the one-level split of `ROWS`-row blocks over every causal key (each layer cuts it to
    its own ranges), shared by all layers of the forward."""

    eps: float
    split: SplitPlan

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "CertifiedSplit":
        return replace(self, split=self.split.for_heads(heads, plan))


@dataclass(frozen=True, eq=False)
class CertifiedFlex:
    """`flex_attention_certified`: nothing per forward beyond eps (each layer builds its per-head block mask), and
    whether FlexAttention's fused kernel runs (`Route.compiled`)."""

    eps: float
    compiled: bool = False

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "CertifiedFlex":
        return self


@dataclass(frozen=True, eq=False)
class CertifiedDecode:
    """`sdpa_decode_certified`: the decoding row's per-key bias bank (padding folded in), the cache's running
    key-norm summary (None: each layer summarises its keys afresh), and whether long key runs go to the CPU flash
    kernel in segments (`Route.segmented`)."""

    eps: float
    bank: BiasBank
    key_norms: object | None = None
    segmented: bool = False

    def for_heads(self, heads: slice, plan: AlibiAttentionPlan) -> "CertifiedDecode":
        return replace(self, bank=self.bank.for_heads(heads, plan))


def prepare_sdpa_split_certified(plan: AlibiAttentionPlan, preparation: Preparation) -> CertifiedSplit:
    split = split_plan(
        plan.slopes,
        plan.query_offset,
        plan.query_length,
        plan.key_padding,
        (ROWS,),
        plan.batch,
        dtype=preparation.dtype,
        causal=plan.causal,
    )
    return CertifiedSplit(preparation.skip_eps, split)


def prepare_sdpa_decode_certified(plan: AlibiAttentionPlan, preparation: Preparation) -> CertifiedDecode:
    bank, folded = bias_bank(plan, 1)  # (B|1, H, 1, kv), padding folded in
    norms = preparation.key_norms() if preparation.key_norms is not None else None
    bank = BiasBank(bank, mask_in_dtype(bank, preparation.dtype), folded)
    return CertifiedDecode(preparation.skip_eps, bank, norms, preparation.segmented)


def prepare_flex_attention_certified(plan: AlibiAttentionPlan, preparation: Preparation) -> CertifiedFlex:
    return CertifiedFlex(preparation.skip_eps, preparation.compiled)


def certified_flex_ranges(plan: AlibiAttentionPlan, query, key, scaling: float) -> KeyRanges:
    """A FlexAttention prefill layer's certified ranges for `query` (B, H, q, D) over `key` (B, H, kv, D), the plan's
    keys, from each row's diagonal logit."""
    with torch.no_grad():  # a certificate of this forward's queries and keys: the ranges are constants to autograd
        starts = certified_key_starts(
            query.detach(),
            key.detach(),
            plan.slopes,
            scaling,
            plan.query_offset,
            plan.payload.eps,
            ROWS,
            KEY_BLOCK,
            plan.key_padding,
            row_group=ROW_GROUP,
        )  # (H, blocks)
    return KeyRanges(ROWS, starts)


def certified_key_ends(
    query, key, slopes, scaling: float, eps: float, row_block: int, key_block: int, key_padding=None, **bounds
) -> torch.Tensor:
    """Bidirectional rows (module docstring): per (head, block of `row_block` rows) of uncached self-attention, the
    end of the keys a kernel must compute, int64 (H, n_row_blocks): for every real row of the block the softmax mass
    of the keys from it on is <= `eps`. Never before the block's last row + 1. Arguments as `certified_key_starts`'
    (`bounds`: its `row_group`, and `lse_lower`, `query_norms`, `key_norms` (B, H, L) in the original order).

    The mirror image of `certified_key_starts`: reversed, the keys right of row i are the keys left of its mirror at
    the same distances, so the causal certificate of the reversed queries and keys holds for them. Each group of
    `row_group` consecutive rows is certified as a block of its own there (reversed blocks of `row_block` rows would
    not line up with the original ones), and a block's end is the largest of its groups'.
    """
    length = query.shape[2]
    if key.shape[2] != length:
        raise ValueError(f"bidirectional self-attention needs as many keys as queries, got {key.shape[2]} and {length}")
    group = bounds.pop("row_group", 1)
    reverse = {name: None if tensor is None else tensor.flip(-1) for name, tensor in bounds.items()}
    padding = None if key_padding is None else key_padding.flip(-1)
    mirrored = certified_key_starts(
        query.flip(2), key.flip(2), slopes, scaling, 0, eps, group, key_block, padding, group, **reverse
    )  # (H, ceil(L / group)) first keys of the reversed sequence
    ends = (length - mirrored.repeat_interleave(group, dim=1)[:, :length]).flip(-1)  # (H, L) each row's end
    return F.pad(ends, (0, -length % row_block), value=0).unflatten(1, (-1, row_block)).amax(-1)  # (H, R)


def certified_split(
    query, key, value, plan: AlibiAttentionPlan, scaling: float, rows: int | None = None, key_block: int = KEY_BLOCK
):
    """The split with certified skipping: (output (B, H, q, D) in the query's dtype, the `KeyRanges` it read: the
    certified ones, or earlier).

    1. Every `rows`-row block's own diagonal, on the kernel: the running output and log-sum-exp of each row; in a
       causal plan, for the heads that reach further back (`near_widths`), the `rows` keys right before each
       block too, merged in (keys every such row keeps: they are never skipped below).
    2. Those log-sum-exps, less their rounding (`kernel_lse_lower_bound`), bound each row's from below; with them,
       `certified_key_starts` gives each (head, block) its first key (`_certified_windows`; never after the near
       keys), and for a bidirectional plan `certified_key_ends` its end key too, each side with eps / 2.
    3. Each block's keys from its first key to the block, less the near keys step 1 merged (and from the block to
       its end key), per run of heads sharing a first (end) key, merged in. With batch 1 each head's first keys are
       moved back to one window per run of 16 blocks (`shared_key_windows`: more keys kept, so still certified),
       which lets each run's blocks run as one kernel call.
    `plan` is a `sdpa_split_certified` plan; `key`/`value` hold its keys (a static cache's filled part). `rows` and
    `key_block` size the blocks of query rows (None: the plan's `ROWS`) and of keys (the defaults are the measured
    ones).

    Training (gradients on): steps 1-2 run without autograd, on this step's own queries and keys, so the dropped
    mass is certified for the very forward it drops from. Step 3 and the backward are the split's autograd function
    over the ranged calls (`_SplitAttention`, given step 1's results): the gradient is the exact gradient of the
    attention this forward computed, the attention restricted to each (head, block)'s kept keys. The ranges are a
    step function of the queries and keys, constant almost everywhere, so holding them fixed is what the derivative
    of the computed function is. That attention is within 2 * eps * max|v| of dense attention in every output
    (Theorem 1); the gradients are those of the computed, not of dense, attention. With the floored bias
    (`attention_sdpa_split_floor.py`, causal plans: the certificate bounds the exact logits, the floor raises the far
    keys' weights by at most e^-18 of a row's mass in all) the bound is 2 * (eps + e^-18) * max|v|.
    """
    batch, heads, q_len, _ = query.shape
    query_offset, slopes, dense = plan.query_offset, plan.slopes, plan.payload.split
    rows = dense.chunks[0] if rows is None else rows
    blocks = query_offset + torch.arange(0, q_len, rows, device=query.device)  # (R,) each block's first position
    block_ends = (blocks + rows).clamp(max=query_offset + q_len)  # (R,)
    if dense.chunks != (rows,) or dense.dtype != torch.promote_types(query.dtype, torch.float32):
        facts = (query_offset, q_len, plan.key_padding, (rows,), batch, query.dtype, plan.causal)
        dense = split_plan(slopes, *facts, floor=dense.floor)  # (another layer dtype)
    ends = None if plan.causal else block_ends.expand(heads, -1)  # nothing right of any block: its diagonal alone
    with torch.no_grad():  # the certificate of this step's queries and keys: no autograd through it
        q, k, v = query.detach(), key.detach(), value.detach()
        norms = upper_norms(q), upper_norms(k)  # (B, H, q), (B, H, kv): the floors' and the certificate's, once
        dense = dense.with_floors(q, k, scaling, norms)  # this layer call's floored biases, if exact (fwd and bwd)
        near = near_widths(slopes, rows) if plan.causal else None  # (H,) keys read right before each block, or None
        diagonals = dense.in_key_ranges(blocks.expand(heads, -1), ends, near)  # no other key left of any block
        output, lse = attend_diagonals(diagonals, q, k, v, scaling)  # (B, H, q, .)
        near_groups = [group for group in diagonals.groups[: diagonals.started] if not group.diagonal]
        attend(diagonals, near_groups, q, k, v, scaling, output, lse)  # merged into the diagonals' results
        seen = rows + max(near or (0,))  # the most keys a row's log-sum-exp is over
        starts, ends = _certified_windows(plan, norms, lse, scaling, rows, key_block, q, k, seen)  # (H, R) each
        if near is not None:  # the near keys are computed: every range keeps them
            starts = torch.minimum(
                starts, (blocks[None] - torch.tensor(near, device=blocks.device)[:, None]).clamp(min=0)
            )
        if batch == 1:  # one call per head over all its blocks, not one per (head, block): `shared_key_windows`
            starts = shared_key_windows(starts, blocks)
            ends = None if ends is None else q_len - shared_key_windows(q_len - ends, q_len - block_ends)
    ranged = dense.in_key_ranges(starts, ends, near)
    output = _SplitAttention.apply(query, key, value, ranged, scaling, (output, lse))
    return output, KeyRanges(rows, starts, ends)  # (B, H, q, D) in the query's dtype


def _certified_windows(plan: AlibiAttentionPlan, norms, lse, scaling: float, rows: int, key_block: int, q, k, seen):
    """Step 2 of `certified_split`: each (head, block)'s certified first key, and for a bidirectional plan its end
    key (eps / 2 on each side), int64 (H, R) each (None: a causal plan's), from the log-sum-exps of step 1 (each row's
    over at most `seen` keys) and the `upper_norms` of `q` and `k` (`norms`: (B, H, q), (B, H, kv))."""
    padding, slopes, eps = plan.key_padding, plan.slopes, plan.payload.eps
    query_norms, key_norms = norms
    real_norms = key_norms if padding is None else key_norms.masked_fill(~padding[:, None], 0.0)
    lower = kernel_lse_lower_bound(lse, query_norms, real_norms.amax(-1), slopes, scaling, seen, q.shape[-1])
    side = eps if plan.causal else eps / 2
    bounds = dict(row_group=ROW_GROUP, lse_lower=lower, query_norms=query_norms, key_norms=key_norms)
    starts = certified_key_starts(q, k, slopes, scaling, plan.query_offset, side, rows, key_block, padding, **bounds)
    if plan.causal:
        return starts, None
    return starts, certified_key_ends(q, k, slopes, scaling, side, rows, key_block, padding, **bounds)


@torch.no_grad()  # a certificate: the ranges are constants to autograd
def certified_decode_ranges(plan: AlibiAttentionPlan, query, key, scaling: float, layer: int | None) -> KeyRanges:
    """A `sdpa_decode_certified` layer's first key per head, (H, 1), for its one row `query` (B, H, 1, D) over `key`
    (B, H, kv, D): the minimum over the batch of each row's certified start. `layer` names the layer for the cache's
    running key-norm summary."""
    query_offset, payload = plan.query_offset, plan.payload
    if payload.key_norms is not None:
        norms = payload.key_norms(layer, key, plan.key_padding)  # (1, H, blocks)
    else:
        norms = key_block_norms(key, KEY_BLOCK, plan.key_padding).amax(0, keepdim=True)  # (1, H, blocks)
    # the diagonal logit (Theorem 2 with N = {i}) in float64, as `diagonal_lse` gives it, in a step's
    # fewest operations
    lse = (query[:, :, 0].double() * key[:, :, query_offset].double()).sum(-1) * scaling  # (B, H)
    if plan.key_padding is not None:  # a padded row (its own token is padding) has no certificate: keep it dense
        lse = lse.masked_fill(~plan.key_padding[:, None, query_offset], -torch.inf)
    starts = certified_decode_start(query, norms, plan.slopes, scaling, query_offset, payload.eps, KEY_BLOCK, lse)
    return KeyRanges(1, starts.amin(0)[:, None])  # (H, 1)


def sdpa_split_certified_attention(query, key, value, plan, scaling, layer=None):
    """The split computes the diagonals, certifies the rest from their log-sum-exps, then reads only the kept keys
    (`certified_split`)."""
    return certified_split(query, key, value, plan, scaling)[0].transpose(1, 2), None  # (B, q, H, D)


def sdpa_decode_certified_attention(query, key, value, plan, scaling, layer=None):
    """A decoding row over its layer's certified key ranges (`certified_decode_ranges`): one
    public call per run of heads that share a first key, over keys [first, kv) with the bank's per-key bias, so
    skipped keys are not read at all; `segmented` (the payload's): in key segments on the CPU flash kernel
    (`attention_sdpa.decode_in_ranges`)."""
    ranges = certified_decode_ranges(plan, query, key, scaling, layer)
    return decode_in_ranges(query, key, value, plan, plan.payload.bank, ranges, scaling, plan.payload.segmented), None


def flex_certified_alibi_attention(query, key, value, plan, scaling, layer=None):
    """FlexAttention over the layer's certified key ranges, as per-head block masks (`compiled`: the fused kernel)."""
    block_mask = flex_block_mask(plan, certified_flex_ranges(plan, query, key, scaling))
    return flex_over_blocks(query, key, value, plan, scaling, block_mask, plan.payload.compiled)
