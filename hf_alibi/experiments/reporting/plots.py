"""Every figure hf_alibi draws, and the one way they are saved: `save_figure`, PNG at 120 dpi, atomically.

    plot_alibi_bias(AutoConfig.from_pretrained("runs/cpu_demo/alibi/final"), "alibi_bias.png")
    hf-alibi plot-bias runs/cpu_demo/alibi/final --output alibi_bias.png      # the same from the command line
    hf-alibi plot-bias --n-head 12 --output alibi_bias.png                   # the paper's slopes for 12 heads

- `plot_perplexity_vs_length`, `plot_loss_by_position`: a length evaluation (`results.write_results` draws both);
- `plot_alibi_bias`: the explainer's figure. Left panels: the lower-triangular bias `-m_h (i - j)` (query i, key
  j <= i) of a few heads, with the line `i - j = ln(1/eps) / m_h` beyond which the bias alone leaves less than `eps`
  of a head's attention. Right panel: the slope of every head in head order (the paper's interleave shows for head
  counts that are not a power of two) and, on a second axis, each head's theoretical window `ln(1/eps) / m_h`;
- `plot_effective_window`: the measured attention window per head (`attention_window`) against that theory;
- `plot_retrieval`: the retrieval experiment's passkey accuracy by length and depth (`retrieval`);
- `plot_sweep`: a budget sweep's 16L / L perplexity ratio against training tokens (`budget_sweep`).

Figures are built on `matplotlib.figure.Figure`, never pyplot (no global backend or figure registry, Agg by
default); matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ...atomic_files import write_file_atomically
from ...models.alibi.alibi_bias import alibi_causal_bias, slopes_from_config
from ..length.attention_window import EffectiveWindow, theoretical_window
from ..length.length_eval import LengthResult, ModelEvaluation
from .axes import bits_unit, evaluated_lengths, mixed_train_lengths, reference_train_length


def save_figure(figure, path: str | os.PathLike) -> Path:
    """Write `figure` to `path` as PNG (120 dpi), atomically: a reader never sees half an image. Returns the path."""
    return write_file_atomically(path, lambda handle: figure.savefig(handle, format="png", dpi=120))


def _title(figure, title: str | None, caveat: str | None) -> None:
    """The figure's title, with `caveat` (`results.run_caveat`: a smoke run says so) under it in red."""
    if caveat:
        figure.suptitle(f"{title}\n{caveat}" if title else caveat, color="tab:red")
    elif title:
        figure.suptitle(title)


def plot_perplexity_vs_length(
    results: Mapping[str, ModelEvaluation],
    path: str | os.PathLike,
    bytes_per_token: float | None = None,
    caveat: str | None = None,
) -> None:
    """Two panels (nonoverlapping, sliding): perplexity (log) against evaluation length (log2), one line per model;
    the right-hand axis reads the same curves in bits per byte (bits per token without `bytes_per_token`). `caveat`
    goes under the title (a smoke run's)."""
    import numpy as np
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure registry, Agg by default
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    train_length = reference_train_length(results)
    lengths = evaluated_lengths(results)
    mixed = mixed_train_lengths(results)
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    if mixed:
        title = "Perplexity vs evaluation length, by position encoding and training length (circled)"
    else:
        title = f"Perplexity vs evaluation length (trained on {train_length}-token sequences)" if train_length else None
    _title(figure, title, caveat)
    panels = [("ppl_nonoverlapping", "Nonoverlapping")]
    if any(r.ppl_sliding is not None for ev in results.values() for r in ev.lengths):  # else one panel
        panels.append(("ppl_sliding", "Sliding window"))
    axes = figure.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (key, title) in zip(axes, panels):
        _plot_models(ax, results, key, lengths, mixed)
        if train_length and not mixed:
            ax.axvline(train_length, color="0.4", linestyle=":", linewidth=1.5, label=f"train length {train_length}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(lengths, [str(length) for length in lengths])
        ax.xaxis.set_minor_locator(LogLocator(base=2, subs=()))
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_title(f"{title} ({'solid' if key == 'ppl_nonoverlapping' else 'dashed'})")
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("perplexity (log scale)")
    scale = bytes_per_token or 1.0
    right = axes[-1].secondary_yaxis(
        "right", functions=(lambda p: np.log2(np.maximum(p, 1e-300)) / scale, lambda b: np.exp2(b * scale))
    )
    right.yaxis.set_major_locator(MaxNLocator(8))
    right.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3f}"))
    right.yaxis.set_minor_formatter(NullFormatter())
    right.set_ylabel(bits_unit(bytes_per_token))
    if mixed:  # one line per model and training length: the legend goes beside the plot
        figure.legend(*axes[-1].get_legend_handles_labels(), fontsize="small", loc="outside center right")
    else:
        axes[0].legend(fontsize="small")
    save_figure(figure, path)


def _plot_models(ax, results: Mapping[str, ModelEvaluation], key: str, lengths: list[int], mixed: bool) -> None:
    """One line per model of its `key` perplexity on `ax`; with `mixed` training lengths, a colour per position
    encoding, a marker per training length and a circle at the model's own training length."""
    encodings = list(dict.fromkeys(name.partition("@")[0] for name in results))
    train_lengths = sorted({ev.train_length for ev in results.values() if ev.train_length})
    for index, (name, evaluation) in enumerate(results.items()):
        by_length = evaluation.by_length()
        xs = [length for length in lengths if length in by_length]
        ys = [_value(by_length[length], key) for length in xs]
        label = name if evaluation.max_length is None else f"{name} (positions <= {evaluation.max_length})"
        style = "-" if key == "ppl_nonoverlapping" else "--"
        if not mixed:
            ax.plot(xs, ys, style, marker="o", color=f"C{index}", label=label)
            continue
        colour = f"C{encodings.index(name.partition('@')[0]) % 10}"
        marker = "osD^v"[train_lengths.index(evaluation.train_length) % 5] if evaluation.train_length else "x"
        ax.plot(xs, ys, style, marker=marker, color=colour, label=label)
        if evaluation.train_length in by_length:  # circle the point at the model's own training length
            own = _value(by_length[evaluation.train_length], key)
            ax.plot([evaluation.train_length], [own], "o", markersize=13, fillstyle="none", color=colour)


def plot_loss_by_position(
    results: Mapping[str, ModelEvaluation], path: str | os.PathLike, caveat: str | None = None
) -> None:
    """Mean nonoverlapping NLL against context length (log2 buckets): one panel per model, one line per length;
    `caveat` (a smoke run's) as the title."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator

    models = list(results.items())
    lengths = evaluated_lengths(results)
    train_length = reference_train_length(results)
    figure = Figure(figsize=(5.5 * len(models), 4.2), layout="constrained")
    _title(figure, None, caveat)
    axes = figure.subplots(1, len(models), sharex=True, sharey=True, squeeze=False)[0]
    colours = colormaps["viridis"]
    for ax, (name, evaluation) in zip(axes, models):
        for r in evaluation.lengths:
            if r.position_loss is None:
                continue
            loss = r.position_loss
            colour = colours(lengths.index(r.length) / max(1, len(lengths) - 1))
            ax.plot(loss.context_start, loss.mean_nll, marker=".", color=colour, label=f"L={r.length}")
        if train_length:
            ax.axvline(train_length, color="0.4", linestyle=":", linewidth=1.5, label=f"train length {train_length}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xlabel("tokens of context before the predicted token (bucket start)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("mean NLL (nats)")
    save_figure(figure, path)


def _value(r: LengthResult, key: str) -> float:
    value = getattr(r, key)
    return math.nan if value is None else value


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
    return save_figure(figure, path)


def plot_effective_window(
    windows: Mapping[str, EffectiveWindow | Mapping], path: str | Path, caveat: str | None = None
) -> Path:
    """Left: measured window per (layer, head) against slope, with the line ln(1/eps) / m. Right: mass at distance
    `>= d` per head of the last layer of the first model, with the bias-only curve exp(-m d) dashed. `caveat` (a
    smoke run's) as the title."""
    from matplotlib.figure import Figure

    windows = {
        name: w if isinstance(w, EffectiveWindow) else EffectiveWindow.from_dict(w) for name, w in windows.items()
    }
    if not windows:
        raise ValueError("windows is empty: nothing to plot")
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    _title(figure, None, caveat)
    left, right = figure.subplots(1, 2)
    markers = "osD^vP*X"
    for index, (name, w) in enumerate(windows.items()):
        positive = [m for m in w.slopes if m > 0]
        for layer, measured in enumerate(w.measured):
            xs = [m for m, value in zip(w.slopes, measured) if m > 0 and value is not None]
            ys = [value for m, value in zip(w.slopes, measured) if m > 0 and value is not None]
            label = f"{name} layer {layer}" if len(windows) > 1 else f"layer {layer}"
            left.scatter(xs, ys, marker=markers[layer % len(markers)], color=f"C{index}", alpha=0.7, label=label)
            wider = [m for m, value in zip(w.slopes, measured) if m > 0 and value is None]
            left.scatter(wider, [w.max_distance] * len(wider), marker="^", color=f"C{index}", alpha=0.7)
        if positive:
            grid = torch.logspace(math.log10(min(positive)), math.log10(max(positive)), 50).tolist()
            left.plot(grid, [math.log(1 / w.eps) / m for m in grid], "k--", label=f"ln(1/{w.eps:g}) / m")
        left.axhline(w.max_distance, color="0.6", linestyle=":", label=f"measurable up to {w.max_distance} (^: wider)")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("slope m_h")
    left.set_ylabel("window (tokens)")
    left.set_title("Effective window: measured vs theory")
    left.legend(fontsize="small")
    name, w = next(iter(windows.items()))
    distances = list(range(1, w.max_distance + 1))
    for h, (slope, curve) in enumerate(zip(w.slopes, w.mass_beyond[-1])):
        right.plot(distances, curve[1:], color=f"C{h % 10}", label=f"head {h} (m={slope:.3g})")
        if slope > 0:
            right.plot(distances, [math.exp(-slope * d) for d in distances], color=f"C{h % 10}", linestyle="--")
    right.axhline(w.eps, color="k", linestyle=":", label=f"eps = {w.eps:g}")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_ylim(1e-6, 2.0)  # mass is at most 1
    right.set_xlabel("key distance d")
    right.set_ylabel("attention mass at distance >= d")
    right.set_title(f"{name}, last layer (dashed: bias alone)")
    right.legend(fontsize="x-small", ncol=2)
    return save_figure(figure, path)


def plot_sweep(table: dict[int, dict[str, dict]], path: str | os.PathLike) -> None:
    """A budget sweep's table (`budget_sweep`): each model's longest / training-length perplexity ratio against its
    training tokens (the budget where they are unknown), 1.0 (position not used) dotted."""
    from matplotlib.figure import Figure

    budgets = sorted(table)
    models = list(dict.fromkeys(name for budget in budgets for name in table[budget]))
    figure = Figure(figsize=(7, 4.5), layout="constrained")
    ax = figure.subplots()
    for index, name in enumerate(models):
        points = [(table[b][name]["train_tokens"] or b, table[b][name]["ratio"]) for b in budgets if name in table[b]]
        ax.plot(*zip(*points), marker="o", color=f"C{index}", label=name)
    ax.axhline(1.0, color="0.4", linestyle=":", linewidth=1.5)
    first = next(iter(table[budgets[0]].values()))
    ax.set_xscale("log")
    ax.set_xlabel("training tokens per model")
    ax.set_ylabel(f"perplexity at {first['longest']} / at {first['train_length']}")
    ax.set_title("When models start to rely on position (16L / L perplexity)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    save_figure(figure, path)


def plot_retrieval(records: Mapping[str, Mapping], path: str | os.PathLike, train_length: int | None = None) -> Path:
    """Passkey retrieval (`retrieval.Probe` records) against evaluation length (log2), one line per arm with its 95%
    Wilson interval shaded: one panel per depth, the last for all depths."""
    from matplotlib.figure import Figure

    keys = list(
        dict.fromkeys(depth for record in records.values() for cells in record["retrieval"].values() for depth in cells)
    )
    keys = [k for k in keys if k != "all"] + ["all"]
    figure = Figure(figsize=(3.6 * len(keys) + 1.5, 4.2), layout="constrained")
    axes = figure.subplots(1, len(keys), sharey=True, squeeze=False)[0]
    figure.suptitle(
        "Passkey retrieval vs evaluation length" + (f" (trained at {train_length})" if train_length else "")
    )
    for index, (arm, record) in enumerate(records.items()):
        lengths = sorted(record["retrieval"], key=int)
        style = dict(color=f"C{index % 10}", linestyle="-" if "+" not in arm else "--", marker="o", markersize=3)
        for ax, key in zip(axes, keys):
            cells = [record["retrieval"][n][key] for n in lengths]
            xs = [int(n) for n in lengths]
            ax.plot(xs, [100 * c["accuracy"] for c in cells], label=arm, **style)
            ax.fill_between(
                xs, [100 * c["low"] for c in cells], [100 * c["high"] for c in cells], color=style["color"], alpha=0.08
            )
    for ax, key in zip(axes, keys):
        ax.set_xscale("log", base=2)
        ax.set_title("all depths" if key == "all" else f"needle depth {key}", fontsize=10)
        ax.set_xlabel("evaluation length (tokens)")
        if train_length:
            ax.axvline(train_length, color="0.5", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("exact-match retrieval (%)")
    axes[0].set_ylim(-3, 103)
    axes[-1].legend(fontsize="x-small", loc="best")
    return save_figure(figure, path)


__all__ = [
    "bias_heads",
    "plot_alibi_bias",
    "plot_effective_window",
    "plot_loss_by_position",
    "plot_perplexity_vs_length",
    "plot_retrieval",
    "plot_sweep",
    "save_figure",
]
