"""The effective attention window of a trained ALiBi model, measured against the bias's own ln(1/eps) / m_h.

With the bias alone (q.k = 0), head h weights key distance k by `exp(-m_h k)`, so the attention mass at distance
`>= W` is `exp(-m_h W)` (for long contexts): at most `eps` exactly when `W >= ln(1/eps) / m_h`. A trained head adds
its q.k logits, which can attend further (or nearer). This module measures, from `output_attentions` on held-out
text, each head's mass at distance `>= d` and its window: the smallest `W` whose mass at distance `>= W` is at most
`eps`, i.e. the nearest `W` keys (distances `0 .. W - 1`) hold at least `1 - eps` of the attention.

    window = measure_effective_window(model, heldout_token_ids, length=2048, eps=0.01)
    window.measured[layer][head], window.theory[head]      # tokens; None: wider than the measurable distance
    plot_effective_window({"alibi": window.to_dict()}, "effective_window.png")   # from hf_alibi.experiments.reporting.plots

Queries are the second half of each input window (positions `length // 2 .. length - 1`), so every query has at
least `length // 2 + 1` keys and mass is measurable at every distance `0 .. length // 2`; averaging over queries
that all see the same distances keeps short-context queries (which cannot attend far) out of the average.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from ...models.alibi.alibi_bias import slopes_from_config


@dataclass
class EffectiveWindow:
    """Measured and theoretical attention windows of one ALiBi model; `to_dict` / `from_dict` round-trip JSON."""

    eps: float
    length: int  # input tokens per window
    max_distance: int  # largest distance measured (length // 2)
    windows: int  # input windows averaged over
    slopes: list[float]  # per head
    theory: list[float | None]  # ln(1/eps) / m_h; None for a zero slope (no decay)
    measured: list[list[int | None]]  # [layer][head]; None: mass beyond max_distance is still above eps
    mass_beyond: list[list[list[float]]]  # [layer][head][d]: mean attention mass at distance >= d, d = 0..max

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> EffectiveWindow:
        return cls(**data)


def theoretical_window(slopes: torch.Tensor | list[float], eps: float) -> list[float | None]:
    """`ln(1 / eps) / m_h` per head (the distance where the bias alone leaves `eps` of the mass); None for m_h = 0."""
    if not 0 < eps < 1:
        raise ValueError(f"eps must be in (0, 1), got {eps}")
    return [math.log(1 / eps) / float(m) if float(m) > 0 else None for m in slopes]


def mass_beyond_distance(attentions: torch.Tensor) -> torch.Tensor:
    """Mean attention mass at key distance `>= d`, d = 0 .. L // 2, over the queries `L // 2 .. L - 1`.

    `attentions` (B, H, L, L) holds causal attention probabilities (rows sum to 1). Returns float64 (H, L // 2 + 1).
    """
    batch, heads, length, _ = attentions.shape
    first = length // 2
    max_distance = length // 2
    query = torch.arange(first, length, device=attentions.device)  # (Q,)
    distance = torch.arange(max_distance + 1, device=attentions.device)  # (D,)
    key = query[:, None] - distance[None, :]  # (Q, D): every key index >= 0 since query >= first >= max_distance
    rows = attentions[:, :, first:, :].double()  # (B, H, Q, L)
    by_distance = rows.gather(-1, key.expand(batch, heads, -1, -1))  # (B, H, Q, D): weight at distance d
    nearer = torch.cumsum(by_distance, dim=-1) - by_distance  # (B, H, Q, D): weight at distances < d
    beyond = rows.sum(-1, keepdim=True) - nearer  # (B, H, Q, D): weight at distances >= d
    return beyond.mean(dim=(0, 2))  # (H, D)


def window_from_mass(mass_beyond: torch.Tensor, eps: float) -> list[int | None]:
    """Per head: the smallest d with mass at distance `>= d` at most `eps`; None if no measured d qualifies."""
    windows = []
    for curve in mass_beyond:  # (D,)
        below = torch.nonzero(curve <= eps)
        windows.append(int(below[0]) if below.numel() else None)
    return windows


@torch.inference_mode()
def measure_effective_window(
    model, documents: list[torch.Tensor], *, length: int = 2048, eps: float = 0.01, max_windows: int = 8
) -> EffectiveWindow:
    """Measure every layer's and head's attention window of an ALiBi causal LM on `documents` (1-D token ids).

    Runs up to `max_windows` nonoverlapping windows of `length` tokens (cut from the documents in order, one per
    forward) with `output_attentions=True` (ALiBi's eager path, fp32 scores and bias).
    """
    if length < 2:
        raise ValueError(f"length must be at least 2, got {length}")
    slopes = slopes_from_config(model.config)
    chunks = [doc[start : start + length] for doc in documents for start in range(0, doc.numel() - length + 1, length)]
    chunks = chunks[:max_windows]
    if not chunks:
        longest = max((doc.numel() for doc in documents), default=0)
        raise ValueError(f"no document has the {length} tokens a window of length {length} needs (longest {longest})")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = None
    try:
        for chunk in chunks:
            out = model(input_ids=chunk[None].to(device), output_attentions=True, use_cache=False)
            mass = torch.stack([mass_beyond_distance(layer.float()) for layer in out.attentions])  # (layers, H, D)
            total = mass if total is None else total + mass
    finally:
        model.train(was_training)
    mass = (total / len(chunks)).cpu()  # (layers, H, D)
    return EffectiveWindow(
        eps=eps,
        length=length,
        max_distance=length // 2,
        windows=len(chunks),
        slopes=slopes.tolist(),
        theory=theoretical_window(slopes, eps),
        measured=[window_from_mass(layer, eps) for layer in mass],
        mass_beyond=[[[round(v, 8) for v in head.tolist()] for head in layer] for layer in mass],
    )


def window_table(window: EffectiveWindow | Mapping) -> str:
    """Markdown: one row per head, its slope, the theoretical window and the measured window of each layer."""
    w = window if isinstance(window, EffectiveWindow) else EffectiveWindow.from_dict(window)
    layers = len(w.measured)
    header = ["head", "slope m_h", f"ln(1/{w.eps:g}) / m_h"] + [f"layer {i}" for i in range(layers)]
    lines = ["| " + " | ".join(header) + " |", "|---:" * len(header) + "|"]
    for h, (slope, theory) in enumerate(zip(w.slopes, w.theory)):
        cells = [str(h), f"{slope:.4g}", "inf" if theory is None else f"{theory:.1f}"]
        cells += [f"> {w.max_distance}" if m[h] is None else str(m[h]) for m in w.measured]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = [
    "EffectiveWindow",
    "mass_beyond_distance",
    "measure_effective_window",
    "theoretical_window",
    "window_from_mass",
    "window_table",
]
