"""The retrieval experiment's results: perplexity and passkey retrieval of every arm side by side, by length.

`write_retrieval(output_dir, records, metadata)` writes, atomically, beside the perplexity files of
`results.write_results` (results.{json,csv,md}, perplexity_vs_length.png, loss_by_position.png):

- `retrieval.json`: `{"metadata": ..., "arms": {arm: {"evaluation", "retrieval", "dropped"}}}` (`retrieval.Probe`);
- `retrieval.md`: one table of perplexity / retrieval per arm and length, retrieval per depth with its 95% Wilson
  interval, and the ALiBi arms' share of keys certified skipping drops;
- `retrieval_vs_length.png`: retrieval against length, one panel per depth and one for all depths (`plots`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...atomic_files import write_text_atomically
from ..length.length_eval import ModelEvaluation
from ..reporting.results import write_results

SETUP_KEYS = (
    "command",
    "corpus",
    "corpus_fingerprint",
    "train_length",
    "training",
    "python",
    "torch",
    "transformers",
    "load_average_at_start",
    "load_average_at_end",
)


def records_as_evaluations(records: dict[str, dict]) -> dict[str, ModelEvaluation]:
    """`{arm: ModelEvaluation}` of the arms' perplexity records."""
    return {arm: ModelEvaluation.from_dict(record["evaluation"]) for arm, record in records.items()}


def write_retrieval(output_dir: Path, records: dict[str, dict], metadata: dict) -> None:
    """Every results file of a retrieval run (module docstring)."""
    from ..reporting.plots import plot_retrieval

    write_results(output_dir, records_as_evaluations(records), metadata=metadata)
    payload = {"metadata": metadata, "arms": records}
    write_text_atomically(output_dir / "retrieval.json", json.dumps(payload, indent=2) + "\n")
    write_text_atomically(output_dir / "retrieval.md", retrieval_markdown(records, metadata))
    plot_retrieval(records, output_dir / "retrieval_vs_length.png", train_length=metadata.get("train_length"))


def _lengths(records: dict[str, dict]) -> list[int]:
    return sorted({r["length"] for record in records.values() for r in record["evaluation"]["lengths"]})


def _header(lengths: list[int], train_length: int | None, first: str = "Arm") -> list[str]:
    labels = [f"{n} ({n / train_length:g}x)" if train_length else str(n) for n in lengths]
    return ["| " + " | ".join([first, *labels]) + " |", "|---" + "|---:" * len(lengths) + "|"]


def _percent(cell: dict | None, interval: bool = False) -> str:
    if cell is None:
        return "n/a"
    text = f"{100 * cell['accuracy']:.0f}%"
    if "seed_min" in cell:  # pooled over seeds: the seeds' own accuracies span this
        text += f" (seeds {100 * cell['seed_min']:.0f}-{100 * cell['seed_max']:.0f})"
    return f"{text} [{100 * cell['low']:.0f}, {100 * cell['high']:.0f}]" if interval else text


def side_by_side_table(records: dict[str, dict], train_length: int | None) -> str:
    """Arms as rows, lengths as columns, each cell `perplexity / retrieval (all depths)`."""
    lengths = _lengths(records)
    lines = _header(lengths, train_length)
    for arm, record in records.items():
        by_length = {r["length"]: r for r in record["evaluation"]["lengths"]}
        cells = []
        for n in lengths:
            ppl = by_length.get(n, {}).get("ppl_nonoverlapping")
            found = record["retrieval"].get(str(n))
            seeds = record.get("perplexity_by_seed", {}).get(str(n))
            spread = f" ({min(seeds.values()):.2f}-{max(seeds.values()):.2f})" if seeds else ""
            cells.append("n/a" if ppl is None else f"{ppl:.2f}{spread} / {_percent(found and found['all'])}")
        lines.append("| " + " | ".join([arm, *cells]) + " |")
    return "\n".join(lines)


def depth_table(records: dict[str, dict], depths: list[str], train_length: int | None) -> str:
    """(arm, depth) as rows, lengths as columns: retrieval with its 95% Wilson interval."""
    lengths = _lengths(records)
    lines = _header(lengths, train_length, "Arm, depth")
    for arm, record in records.items():
        for depth in depths:
            cells = [_percent((record["retrieval"].get(str(n)) or {}).get(depth), interval=True) for n in lengths]
            lines.append("| " + " | ".join([f"{arm}, {depth}", *cells]) + " |")
    return "\n".join(lines)


def dropped_table(records: dict[str, dict], train_length: int | None) -> str:
    """ALiBi arms as rows: the share of causal keys certified skipping drops, by length ("" if no arm has one)."""
    lengths = _lengths(records)
    rows = [(arm, record["dropped"]) for arm, record in records.items() if record.get("dropped")]
    if not rows:
        return ""
    lines = _header(lengths, train_length)
    for arm, dropped in rows:
        cells = [f"{100 * dropped[str(n)]['overall']:.1f}%" if str(n) in dropped else "-" for n in lengths]
        lines.append("| " + " | ".join([arm, *cells]) + " |")
    return "\n".join(lines)


def copy_curve_table(metadata: dict) -> str:
    """One row per model with a copy curve (`<model>_copy_curve`): the first step at >= 90% exact match, and where
    its last point stands; '' without curves."""
    from .copy_curve import first_step_at

    curves = {key.removesuffix("_copy_curve"): curve for key, curve in metadata.items() if key.endswith("_copy_curve")}
    rows = [(name, curve) for name, curve in curves.items() if curve]
    if not rows:
        return ""
    lines = [
        "| Model | first step >= 90% | last step | exact | per digit | loss on the copy | on the needle |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, curve in rows:
        last, first = curve[-1], first_step_at(curve)
        cells = [
            name,
            "never" if first is None else str(first),
            str(last["step"]),
            f"{100 * last['exact']:.1f}%",
            f"{100 * last['per_digit']:.1f}%",
            f"{last['copy_loss']:.3f}",
            f"{last['needle_loss']:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _introduction(metadata: dict, depths: list[str]) -> list[str]:
    """retrieval.md's opening lines: the probes per cell and their widest interval, how seeds are pooled."""
    from .passkey import wilson_interval

    samples = metadata.get("experiment", {}).get("passkey_samples")
    lines = ["# Perplexity and passkey retrieval by evaluation length", ""]
    if samples:
        worst = wilson_interval(samples // 2, samples)
        lines += [
            f"{samples} probes per (arm, length, depth) at depths {', '.join(depths)} ({samples * len(depths)} "
            f"per length): the widest 95% Wilson interval of one depth is [{100 * worst[0]:.1f}, "
            f"{100 * worst[1]:.1f}]% at {samples // 2}/{samples}.",
            "",
        ]
    if metadata.get("seeds"):
        seeds = metadata["seeds"]
        lines += [
            f"Pooled over {len(seeds)} seeds ({', '.join(map(str, seeds))}; each a whole run in `seed_<S>/`): a "
            "retrieval cell is every seed's probes together, its Wilson interval theirs, and `(seeds a-b)` the range "
            "of the seeds' own accuracies; perplexity is the geometric mean over seeds (their summed log-likelihood "
            "on the same tokens) with the seeds' range in parentheses.",
            "",
        ]
    return lines


def _section(title: str, explanation: str, table: str) -> list[str]:
    """A titled section of retrieval.md, or nothing when its table is empty."""
    return [f"## {title}", "", explanation, "", table, ""] if table else []


def retrieval_markdown(records: dict[str, dict], metadata: dict) -> str:
    """retrieval.md (module docstring)."""
    experiment = metadata.get("experiment", {})
    train_length = metadata.get("train_length")
    depths = [str(float(d)) for d in experiment.get("passkey_depths", [])]
    lines = _introduction(metadata, depths)
    lines += _section(
        "Perplexity / retrieval (all depths)",
        "Nonoverlapping perplexity per token on the held-out text (the same tokens at every length) / share of "
        "probes whose greedy digits are the key exactly.",
        side_by_side_table(records, train_length),
    )
    lines += _section(
        "Retrieval by depth (95% Wilson interval)",
        "Depth 0: the needle opens the context; 1: it sits right before the question (the same distance at "
        "every length).",
        depth_table(records, depths, train_length),
    )
    lines += _section(
        "Context certified skipping drops (ALiBi arms)",
        f"Share of causal (query, key) pairs whose keys carry softmax mass <= {experiment.get('kept_eps', 0):g} "
        "provably (`attention_skip.certified_key_starts`, 32-token blocks), mean over layers and heads, on one probe "
        "per depth: what the model cannot see at that layer.",
        dropped_table(records, train_length),
    )
    lines += _section(
        "The copy's learning curve at the training length",
        "The 1x probes every `copy_curve_steps` steps of training (`copy_curve.py`): exact match, per-digit accuracy, "
        "and mean loss on the copied digits against their first occurrence (random digits: ln 10 = 2.303 there).",
        copy_curve_table(metadata),
    )
    lines += ["## Setup", ""] + [f"- {key}: {metadata[key]}" for key in SETUP_KEYS if key in metadata]
    lines += [f"- {key}: {value}" for key, value in metadata.items() if key.endswith("_training")]
    lines.append(f"- experiment: {experiment}")
    return "\n".join(lines) + "\n"


__all__ = [
    "copy_curve_table",
    "depth_table",
    "dropped_table",
    "records_as_evaluations",
    "retrieval_markdown",
    "side_by_side_table",
    "write_retrieval",
]
