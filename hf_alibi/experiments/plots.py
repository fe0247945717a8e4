"""The explainer's figure: ALiBi's bias matrix for a few heads and the slope schedule across heads.

    plot_alibi_bias(AutoConfig.from_pretrained("runs/cpu_demo/alibi/final"), "alibi_bias.png")
    hf-alibi plot-bias runs/cpu_demo/alibi/final --output alibi_bias.png      # the same from the command line
    hf-alibi plot-bias --n-head 12 --output alibi_bias.png                   # the paper's slopes for 12 heads

Left panels: the lower-triangular bias `-m_h (i - j)` (query i, key j <= i) of a few heads, with the line
`i - j = ln(1/eps) / m_h` beyond which the bias alone leaves less than `eps` of a head's attention. Right panel: the
slope of every head in head order (the paper's interleave shows for head counts that are not a power of two) and,
on a second axis, each head's theoretical window `ln(1/eps) / m_h`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..models.alibi_gpt2.alibi import alibi_causal_bias, slopes_from_config
from .attention_window import theoretical_window


def bias_heads(slopes: torch.Tensor, count: int = 3) -> list[int]:
    """`count` heads spread over the slope range: the steepest, the flattest, and evenly ranked ones between."""
    order = torch.argsort(slopes, descending=True, stable=True).tolist()  # steepest first
    if count >= len(order):
        return sorted(order)
    picks = [order[round(i * (len(order) - 1) / (count - 1))] for i in range(count)] if count > 1 else order[:1]
    return list(dict.fromkeys(picks))


def plot_alibi_bias(
    config_or_slopes,
    path: str | Path,
    *,
    heads: list[int] | None = None,
    size: int = 64,
    eps: float = 0.01,
) -> Path:
    """Draw the bias of `heads` (default: `bias_heads`) over `size` x `size` positions and the slope schedule.

    `config_or_slopes`: an ALiBi config (its `alibi_slopes` or the paper's rule) or a sequence of slopes. Written
    atomically to `path` (PNG); returns the path.
    """
    from matplotlib.figure import Figure

    from .results import _atomic_savefig

    if hasattr(config_or_slopes, "n_head"):
        slopes = slopes_from_config(config_or_slopes)
    else:
        slopes = torch.as_tensor(list(config_or_slopes), dtype=torch.float32)
    if slopes.dim() != 1 or slopes.numel() == 0:
        raise ValueError(f"need one slope per head, got {slopes.tolist()}")
    if size < 2:
        raise ValueError(f"size must be at least 2 positions, got {size}")
    heads = bias_heads(slopes) if heads is None else heads
    bad = [h for h in heads if not 0 <= h < slopes.numel()]
    if bad or not heads:
        raise ValueError(f"heads {heads} must be indices in [0, {slopes.numel()})")
    theory = theoretical_window(slopes, eps)
    bias = alibi_causal_bias(slopes[heads], size, size)  # (len(heads), size, size)
    bias = bias.masked_fill(bias <= torch.finfo(torch.float32).min, math.nan)  # above the diagonal: blank

    figure = Figure(figsize=(3.6 * len(heads) + 5.5, 3.8), layout="constrained")
    axes = figure.subplots(1, len(heads) + 1, width_ratios=[1] * len(heads) + [1.5])
    lowest = float(torch.nan_to_num(bias, nan=0.0).min())
    for ax, h, matrix in zip(axes, heads, bias):
        image = ax.imshow(matrix.numpy(), cmap="viridis", vmin=lowest, vmax=0.0, interpolation="nearest")
        window = theory[h]
        if window is not None and window < size:
            # the diagonal band i - j = window, drawn in pixel centres
            ax.plot([0, size - 1 - window], [window, size - 1], color="white", linestyle="--", linewidth=1.2)
        window_text = "inf" if window is None else f"{window:.1f}"
        ax.set_title(f"head {h}: m = {float(slopes[h]):.4g}\nwindow ln(1/{eps:g})/m = {window_text}", fontsize=9)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    figure.colorbar(image, ax=list(axes[:-1]), shrink=0.8, label="bias -m_h (i - j)")
    schedule = axes[-1]
    index = list(range(slopes.numel()))
    schedule.bar(index, slopes.tolist(), color=["C1" if h in heads else "C0" for h in index])
    schedule.set_yscale("log", base=2)
    schedule.set_xlabel("head")
    schedule.set_ylabel("slope m_h (bars)")
    schedule.set_title("slope schedule and window per head", fontsize=9)
    windows = schedule.twinx()
    finite = [(h, w) for h, w in zip(index, theory) if w is not None]
    windows.plot([h for h, _ in finite], [w for _, w in finite], "kD", label=f"ln(1/{eps:g}) / m_h")
    windows.set_yscale("log")
    windows.set_ylabel("window (tokens, diamonds)")
    windows.legend(fontsize="small", loc="upper left")
    path = Path(path)
    _atomic_savefig(figure, path)
    return path


__all__ = ["bias_heads", "plot_alibi_bias"]
