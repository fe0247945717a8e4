"""How much of its context a trained ALiBi model can still see: the share of causal keys certified skipping drops.

    layers = capture_queries_keys(model, ids)                 # every layer's (query, key), (B, H, L, D) each
    dropped_fraction(model, ids, eps=1e-7)                    # mean over layers and heads of 1 - kept fraction

`hf_alibi.models.alibi.attention_skip.certified_key_starts` proves, per head and block of query rows, the first
key whose predecessors carry softmax mass <= eps on every row; the keys before it are what the model cannot use (at
that layer) beyond eps. The slopes are the ones the forward uses at the input's length: with
`alibi_scaling={"type": "linear", "train_seq_len": n}` they are divided by max(1, K / n) (K keys), so slope interpolation's wider reach shows as fewer keys dropped.
`benchmarks/measure_kept_fraction.py` measures the same on the demo checkpoints with its own grid and ablations.

Bidirectional rows (an encoder, `-m |i - j|` on every key): `certified_key_windows` bounds the keys far on both
sides. Left of row i it is the causal certificate as is (Theorems 2-3 of `attention_skip` hold for any subset of
the visible keys: the diagonal logit still bounds LSE_i from below, and the keys left of t are bounded with
`-m (i - j)`); the right side is the same certificate on the sequence reversed (j -> L - 1 - j maps `-m (j - i)` to
`-m (i' - j')`: `attention_certified.certified_key_ends`). Each side certifies eps / 2, so the dropped mass of a row
is <= eps and its output moves by at most 2 eps max|v| (Theorem 1). `bidirectional_kept_fraction` is the kept share
of the L x L work. The model's encoder path (`certified_split` on a bidirectional plan) bounds each row's LSE by its
diagonal block's log-sum-exp instead of the diagonal logit (tighter); this is the measurement that decided it pays
(`benchmarks/measure_bidirectional_kept.py`).
"""

from __future__ import annotations

import torch

from ...models.alibi.alibi_bias import length_scaled_slopes
from ...models.alibi.attention_certified import certified_key_ends
from ...models.alibi.attention_skip import certified_key_starts
from ...models.alibi.configuration_alibi_gpt2 import train_seq_len


def kept_fraction(starts: torch.Tensor, query_length: int, row_block: int, query_offset: int = 0) -> torch.Tensor:
    """Computed keys / causal keys per head, float64 (H,), for `starts` (H, n_row_blocks) of `certified_key_starts`.

    Row r (absolute position i = query_offset + r) computes keys [start, i]: i + 1 - start of its i + 1 causal keys.
    The heads' mean is the overall fraction (every head has the same causal work). One decoding row: query_length=1.
    """
    for name, value in (("row_block", row_block), ("query_length", query_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if starts.dim() != 2 or starts.shape[1] != -(-query_length // row_block):
        raise ValueError(f"starts must be (H, {-(-query_length // row_block)}), got {tuple(starts.shape)}")
    positions = torch.arange(query_offset, query_offset + query_length, device=starts.device)  # (q,)
    row_starts = starts.repeat_interleave(row_block, dim=1)[:, :query_length]  # (H, q)
    causal = (positions + 1).double()  # (q,)
    return (causal - row_starts).sum(-1) / causal.sum()  # (H,)


def certified_key_windows(
    query, key, slopes, scaling: float, eps: float, row_block: int, key_block: int, key_padding=None, row_group=1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, block of `row_block` rows) of a bidirectional self-attention: `(starts, ends)`, int64
    (H, ceil(L / row_block)) each; every real row of the block keeps keys [start, end), the dropped mass of the
    visible keys outside it certified <= eps (module docstring). `query`, `key` (B, H, L, D); `key_padding` (B, L)
    True = real; `row_group` as `certified_key_starts`'s (the left side's)."""
    half = eps / 2
    starts = certified_key_starts(query, key, slopes, scaling, 0, half, row_block, key_block, key_padding, row_group)
    ends = certified_key_ends(query, key, slopes, scaling, half, row_block, key_block, key_padding, row_group=row_group)
    return starts, ends


def bidirectional_kept_fraction(starts: torch.Tensor, ends: torch.Tensor, length: int, row_block: int) -> torch.Tensor:
    """Computed keys / all L x L keys per head, float64 (H,), for the windows of `certified_key_windows`."""
    counts = (ends - starts).repeat_interleave(row_block, dim=1)[:, :length]  # (H, L)
    return counts.double().sum(-1) / float(length) ** 2


def capture_queries_keys(model, ids: torch.Tensor, values: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's (query, key), and its value with `values`, each (B, H, L, D), from one forward of an ALiBi GPT-2
    over `ids` (B, L)."""
    captured, handles = [], []
    for block in model.transformer.h:

        def hook(attention, args):  # the attention module's own projections of its input (clip_qkv applied)
            query, key, value = attention.projections(args[0])  # (B, H, L, D) each
            captured.append((query, key, value) if values else (query, key))

        handles.append(block.attn.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def slopes_at(model, key_length: int) -> torch.Tensor:
    """The slopes (H,) float64 the model's forward applies over `key_length` keys: its slopes buffer (a static
    factor is already in it), divided by max(1, K / n) for the length-dependent `alibi_scaling` (the model's own
    `length_scaled_slopes`)."""
    slopes = model.transformer.alibi_slopes.double()
    return length_scaled_slopes(slopes, key_length, train_seq_len(getattr(model.config, "alibi_scaling", None)))


def dropped_fraction(model, ids: torch.Tensor, eps: float = 1e-7, block: int = 32) -> dict:
    """Share of causal keys certified skipping drops on `ids` (B, L): `{"overall": float, "per_head": [H]}`, averaged
    over layers (and the batch's rows: a block's start holds for every row of it), blocks of `block` rows and keys."""
    length = ids.shape[1]
    slopes = slopes_at(model, length)
    scaling = model.transformer.h[0].attn.scaling
    per_layer = []
    for query, key in capture_queries_keys(model, ids):
        starts = certified_key_starts(query, key, slopes, scaling, 0, eps, block, block)  # (H, n_row_blocks)
        per_layer.append(1.0 - kept_fraction(starts, length, block))
    per_head = torch.stack(per_layer).mean(0)  # (H,)
    return {"overall": float(per_head.mean()), "per_head": per_head.tolist()}


__all__ = [
    "bidirectional_kept_fraction",
    "capture_queries_keys",
    "certified_key_windows",
    "dropped_fraction",
    "kept_fraction",
    "slopes_at",
]
