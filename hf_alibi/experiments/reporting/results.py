"""Length-evaluation results a person wants to look at: JSON, CSV, a markdown table like the paper's, plots.

`write_results(output_dir, {name: ModelEvaluation}, metadata=...)` writes, each file atomically
(`hf_alibi.atomic_files`: a crash never leaves a half-written file under the final name), the figures drawn by
`plots`:

- `results.json`: everything, `{"metadata": ..., "models": {name: ModelEvaluation.to_dict()}}`;
- `results.csv`: one row per (model, length);
- `results.md`: perplexity tables, models as rows and lengths as columns, "n/a" where a model cannot run;
- `perplexity_vs_length.png`: nonoverlapping and sliding perplexity against length (log2), training length marked;
  with several training lengths (models named `encoding@length`), the paper's Figure 1: one colour per encoding, one
  marker per training length, each line's training length circled;
- `loss_by_position.png`: mean NLL against context length, one panel per model, one line per evaluation length.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...atomic_files import write_text_atomically
from ..length.length_eval import LengthResult, ModelEvaluation
from .axes import bits_unit, evaluated_lengths, mixed_train_lengths, reference_train_length  # re-exported

atomic_write_text = write_text_atomically  # its earlier name here

CSV_COLUMNS = [
    "model",
    "train_length",
    "length",
    "factor",
    "unsupported",
    "ppl_nonoverlapping",
    "ppl_sliding",
    "tokens_nonoverlapping",
    "tokens_sliding",
    "stride",
    "documents",
]
NOT_AVAILABLE = "n/a"


def run_caveat(metadata: Mapping[str, Any] | None) -> str | None:
    """What a run's plots and tables must say before their numbers: that a smoke run (`--smoke`) is one (its tiny
    models barely trained, on auto-scaled axes, look like results otherwise); None for a real run."""
    metadata = metadata or {}
    if not metadata.get("experiment", {}).get("smoke"):
        return None
    steps = metadata.get("training", {}).get("max_steps")
    return (
        f"SMOKE RUN: tiny models trained {steps} steps, a check of the pipeline, not results"
        if steps
        else "SMOKE RUN: tiny models barely trained, a check of the pipeline, not results"
    )


def write_results(
    output_dir: str | os.PathLike,
    results: Mapping[str, ModelEvaluation | dict],
    *,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Path]:
    """Write every results file into `output_dir` (created if needed); returns {kind: path}."""
    from .plots import plot_loss_by_position, plot_perplexity_vs_length  # here: matplotlib only when drawing

    results = _as_evaluations(results)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"metadata": dict(metadata or {}), "models": {name: ev.to_dict() for name, ev in results.items()}}
    paths = {
        "json": out / "results.json",
        "csv": out / "results.csv",
        "markdown": out / "results.md",
        "plot": out / "perplexity_vs_length.png",
        "position_plot": out / "loss_by_position.png",
    }
    write_text_atomically(paths["json"], json.dumps(payload, indent=2) + "\n")
    write_text_atomically(paths["csv"], results_csv(results))
    write_text_atomically(paths["markdown"], results_markdown(results, metadata=metadata))
    caveat = run_caveat(metadata)
    plot_perplexity_vs_length(
        results, paths["plot"], bytes_per_token=(metadata or {}).get("bytes_per_token"), caveat=caveat
    )
    plot_loss_by_position(results, paths["position_plot"], caveat=caveat)
    return paths


def load_results(path: str | os.PathLike) -> tuple[dict[str, ModelEvaluation], dict[str, Any]]:
    """Read a `results.json` (or the folder holding it) back into `({name: ModelEvaluation}, metadata)`."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    payload = json.loads(path.read_text())
    return _as_evaluations(payload["models"]), payload.get("metadata", {})


def results_csv(results: Mapping[str, ModelEvaluation]) -> str:
    """One row per (model, length), columns `CSV_COLUMNS`; floats at full precision (they round-trip exactly)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for name, evaluation in results.items():
        for r in evaluation.lengths:
            row = {key: getattr(r, key) for key in CSV_COLUMNS if hasattr(r, key)}
            row.update(model=name, train_length=evaluation.train_length, documents=evaluation.selection.documents)
            writer.writerow({key: "" if value is None else value for key, value in row.items()})
    return buffer.getvalue()


def results_markdown(results: Mapping[str, ModelEvaluation], *, metadata: Mapping[str, Any] | None = None) -> str:
    """Markdown tables (nonoverlapping, then sliding) of perplexity: models as rows, lengths as columns."""
    train_length = reference_train_length(results)
    caveat = run_caveat(metadata)
    lines = ["# Perplexity vs evaluation length" + (" (smoke run)" if caveat else ""), ""]
    if caveat:
        lines += [f"> **{caveat}.** `make demo` (the cpu_demo config) trains the models the docs report.", ""]
    if mixed_train_lengths(results):
        trained = ", ".join(f"{name} at {ev.train_length}" for name, ev in results.items())
        lines.append(
            f"Models trained on sequences of different lengths ({trained}); columns are evaluation lengths, "
            f"factors relative to {train_length}."
        )
    elif train_length:
        lines.append(f"Models trained on {train_length}-token sequences; columns are evaluation lengths.")
    lines.extend(_selection_lines(results))
    lines.append("")
    lines += ["## Nonoverlapping windows", "", perplexity_table(results, "ppl_nonoverlapping"), ""]
    bytes_per_token = (metadata or {}).get("bytes_per_token")
    unit = bits_unit(bytes_per_token).capitalize()
    ratio = f", divided by the evaluation text's {bytes_per_token:g} bytes per token" if bytes_per_token else ""
    lines += [
        f"## {unit}, nonoverlapping",
        "",
        f"log2 of the perplexity{ratio}.",
        "",
        bits_table(results, bytes_per_token),
        "",
    ]
    if any(r.ppl_sliding is not None for ev in results.values() for r in ev.lengths):
        strides = sorted({(r.length, r.stride) for ev in results.values() for r in ev.lengths if r.stride})
        stride_text = ", ".join(f"{stride} at {length}" for length, stride in strides)
        lines += ["## Sliding window", "", f"Stride (tokens scored per window): {stride_text}.", ""]
        lines += [perplexity_table(results, "ppl_sliding"), ""]
    unsupported = sorted(
        {
            f"{name}: {r.unsupported.removeprefix('unsupported: ')}"
            for name, ev in results.items()
            for r in ev.lengths
            if r.unsupported
        }
    )
    if unsupported:
        lines += [f"{NOT_AVAILABLE}: not run at that length ({'; '.join(unsupported)}).", ""]
    costs = training_cost_table(results, metadata or {})
    if costs:
        lines += ["## Training cost", "", costs, ""]
    if metadata:
        lines += ["## Setup", ""] + [f"- {key}: {value}" for key, value in metadata.items()] + [""]
    return "\n".join(lines)


def perplexity_table(results: Mapping[str, ModelEvaluation], key: str = "ppl_nonoverlapping") -> str:
    """One markdown table of `key` (`ppl_nonoverlapping` or `ppl_sliding`), like the paper's Table 1 layout."""
    return _length_table(results, lambda r: _cell(r, key))


def _length_table(results: Mapping[str, ModelEvaluation], cell) -> str:
    """Models as rows, evaluation lengths as columns; `cell(LengthResult or None)` formats each entry."""
    lengths = evaluated_lengths(results)
    train_length = reference_train_length(results)
    mixed = mixed_train_lengths(results)
    header = ["Model"] + [_length_label(length, train_length, not mixed) for length in lengths]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * len(lengths) + "|"]
    for name, evaluation in results.items():
        by_length = evaluation.by_length()
        lines.append("| " + " | ".join([name] + [cell(by_length.get(length)) for length in lengths]) + " |")
    return "\n".join(lines)


def training_cost_table(results: Mapping[str, ModelEvaluation], metadata: Mapping[str, Any]) -> str:
    """Markdown: per model, its training length, batch and tokens, then its cost. "" when no model has cost facts.

    Tokens/s, step time and peak memory come from `metadata["<model>_cost"]` (`training_cost`: every model timed
    the same way, interleaved, warm-up excluded) when the run measured them, else from the training run's own clock
    (`metadata["<model>_training"]`, marked "run clock"); `train seconds` is always the training run's wall time.
    """
    rows, reference, protocols = [], None, set()
    for name in results:
        facts = metadata.get(f"{name}_training")
        if not isinstance(facts, Mapping) or "train_tokens_per_second" not in facts:
            continue
        cost = metadata.get(f"{name}_cost")
        length = facts.get("train_length", results[name].train_length)
        tokens = facts.get("train_tokens")
        if isinstance(cost, Mapping):
            speed, step, peak, source = (
                cost["tokens_per_second"],
                cost["step_seconds_median"],
                cost.get("peak_memory_mib"),
                "",
            )
            protocols.add(cost.get("protocol"))
        else:
            speed, step, peak, source = (
                facts["train_tokens_per_second"],
                facts.get("step_seconds_median"),
                facts.get("peak_memory_mib"),
                " (run clock)",
            )
        reference = reference if reference is not None else (name, step)
        relative = "-" if not step or not reference[1] else f"{step / reference[1]:.3f}"
        rows.append(
            f"| {name} | {length} | {facts.get('per_device_train_batch_size', '-')} | "
            f"{'-' if tokens is None else f'{tokens:,}'} | {speed:,.0f}{source} | "
            f"{'-' if step is None else f'{step * 1000:.1f}'} | {relative} | "
            f"{'-' if peak is None else f'{peak:,.0f}'} | {facts.get('train_seconds', '-')} |"
        )
    if not rows:
        return ""
    header = (
        f"| Model | train length | batch | training tokens | tokens/s | step (ms) | step time / {reference[0]} | "
        "peak memory (MiB) | train seconds |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    protocols.discard(None)
    note = ""
    if protocols:
        note = (
            "\n\nTokens/s, step time and peak memory: every model measured the same way after training (fresh "
            f"models, {'; '.join(sorted(protocols))}; peak memory: process growth while building the model "
            "and running its warm-up steps). Train seconds: the training run's own wall clock (checkpoints and "
            "logging included; whatever else ran on the machine then, too)."
        )
    return "\n".join([header, *rows]) + note


def bits_table(
    results: Mapping[str, ModelEvaluation], bytes_per_token: float | None, key: str = "ppl_nonoverlapping"
) -> str:
    """Markdown table of bits per byte (`log2(ppl) / bytes_per_token`), or bits per token when it is unknown."""

    def cell(r: LengthResult | None) -> str:
        value = None if r is None or r.unsupported else getattr(r, key)
        return _cell(r, key) if value is None else f"{bits(value, bytes_per_token):.3f}"

    return _length_table(results, cell)


def bits(perplexity_value: float, bytes_per_token: float | None = None) -> float:
    """Bits per byte of a per-token perplexity (`log2(ppl) / bytes_per_token`); bits per token without the ratio."""
    return math.log2(perplexity_value) / (bytes_per_token or 1.0)


def format_summary(results: Mapping[str, ModelEvaluation | dict], output_dir: str | os.PathLike | None = None) -> str:
    """A few lines for stdout: `nonoverlapping / sliding` perplexity per model and length."""
    results = _as_evaluations(results)
    lengths = evaluated_lengths(results)
    train_length = reference_train_length(results)
    rows = []
    for evaluation in results.values():
        by_length = evaluation.by_length()
        rows.append(
            [
                f"{_cell(by_length.get(n), 'ppl_nonoverlapping')} / {_cell(by_length.get(n), 'ppl_sliding')}"
                for n in lengths
            ]
        )
    labels = [_length_label(length, train_length, not mixed_train_lengths(results)) for length in lengths]
    cell = max(len(text) for text in labels + [c for row in rows for c in row]) + 2
    width = max(len(name) for name in results)
    lines = ["perplexity (nonoverlapping / sliding) by evaluation length"]
    lines.append(" " * width + "".join(f"{label:>{cell}}" for label in labels))
    lines += [f"{name:<{width}}" + "".join(f"{c:>{cell}}" for c in row) for name, row in zip(results, rows)]
    lines.extend(_selection_lines(results))
    if output_dir is not None:
        lines.append(f"results written to {output_dir}")
    return "\n".join(lines)


def _as_evaluations(results: Mapping[str, ModelEvaluation | dict]) -> dict[str, ModelEvaluation]:
    if not results:
        raise ValueError("results is empty: nothing to write")
    return {
        name: ev if isinstance(ev, ModelEvaluation) else ModelEvaluation.from_dict(ev) for name, ev in results.items()
    }


def _length_label(length: int, train_length: int | None, mark_train: bool = True) -> str:
    if not train_length:
        return str(length)
    factor = length / train_length
    factor_text = f"{factor:g}x"
    return f"{length} ({factor_text}, train)" if length == train_length and mark_train else f"{length} ({factor_text})"


def _cell(r: LengthResult | None, key: str) -> str:
    if r is None:
        return "-"
    if r.unsupported:
        return NOT_AVAILABLE
    value = getattr(r, key)
    return "-" if value is None else f"{value:.2f}"


def _selection_lines(results: Mapping[str, ModelEvaluation]) -> list[str]:
    lines = []
    for fingerprint in dict.fromkeys(ev.selection.fingerprint for ev in results.values()):
        names = [name for name, ev in results.items() if ev.selection.fingerprint == fingerprint]
        s = results[names[0]].selection
        scope = "" if len(names) == len(results) else f" ({', '.join(names)})"
        lines.append(
            f"Eval set{scope}: {s.documents} documents, {s.tokens_used:,} tokens (skipped {s.skipped} shorter than "
            f"{s.min_tokens} tokens, dropped {s.tokens_dropped:,} tail tokens), fingerprint {fingerprint[:12]}."
        )
    return lines


__all__ = [
    "CSV_COLUMNS",
    "atomic_write_text",
    "bits",
    "bits_table",
    "bits_unit",
    "evaluated_lengths",
    "format_summary",
    "load_results",
    "mixed_train_lengths",
    "perplexity_table",
    "reference_train_length",
    "results_csv",
    "results_markdown",
    "training_cost_table",
    "write_results",
]
