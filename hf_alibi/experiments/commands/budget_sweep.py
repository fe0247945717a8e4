"""When does position use set in? Each encoding's longest-length / training-length perplexity ratio at several
training budgets, one experiment per budget.

    HF_HUB_OFFLINE=1 hf-alibi sweep --config budget_sweep        # or, in a clone: python -m recipes.budget_sweep ...
    HF_HUB_OFFLINE=1 hf-alibi sweep --config budget_sweep --smoke --budgets 2 4 --output_dir runs/sweep_smoke  # seconds

A model that has not learned to rely on position has nothing to lose when positions go out of range: its ratio
stays near 1 whatever its encoding. The sweep trains the same models at each budget (`max_steps`, the same batch),
each budget a whole `run_experiment` in `<output_dir>/steps_<budget>/`, and writes

    <output_dir>/budget_sweep.json   {budget: {model: {"train_tokens", "ppl_train_length", "ppl_longest", "ratio"}}}
    <output_dir>/budget_sweep.md     one table: models as rows, budgets as columns, `ppl at L -> ppl at 16L (ratio)`
    <output_dir>/budget_sweep.png    the ratio against training tokens, one line per model, 1.0 marked
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainingArguments

from ...atomic_files import write_text_atomically
from ..length.length_eval import ModelEvaluation
from ..reporting.plots import plot_sweep


@dataclass
class SweepArguments:
    """The budgets of a sweep; everything else comes from `ExperimentArguments` and `TrainingArguments`."""

    budgets: list[int] = field(
        default_factory=lambda: [60, 180, 500],
        metadata={"help": "Training budgets as max_steps (same batch at every budget), one experiment each."},
    )

    def __post_init__(self):
        if not self.budgets or any(b < 1 for b in self.budgets) or len(set(self.budgets)) != len(self.budgets):
            raise ValueError(f"budgets must be distinct positive step counts, got {self.budgets}")
        self.budgets = sorted(self.budgets)


def budget_training_args(training: TrainingArguments, budget: int) -> TrainingArguments:
    """`training` with `max_steps=budget` and its own folder `<output_dir>/steps_<budget>`."""
    output_dir = str(Path(training.output_dir) / f"steps_{budget}")
    return TrainingArguments(**{**training.to_dict(), "max_steps": budget, "output_dir": output_dir})


def position_use(evaluation: ModelEvaluation, train_tokens: int | None = None) -> dict:
    """Nonoverlapping perplexity at the training length and at the longest evaluated length, and their ratio."""
    by_length = evaluation.by_length()
    longest = max(r.length for r in evaluation.lengths if not r.unsupported)
    own = by_length[evaluation.train_length].ppl_nonoverlapping
    far = by_length[longest].ppl_nonoverlapping
    return {
        "train_tokens": train_tokens,
        "train_length": evaluation.train_length,
        "longest": longest,
        "ppl_train_length": own,
        "ppl_longest": far,
        "ratio": far / own,
    }


def run_budget_sweep(experiment, training: TrainingArguments, sweep: SweepArguments) -> dict[int, dict[str, dict]]:
    """Run the experiment once per budget, then write the sweep's table, figure and JSON (module docstring)."""
    from ..training.runner import run_experiment

    table: dict[int, dict[str, dict]] = {}
    for budget in sweep.budgets:
        args = budget_training_args(training, budget)
        evaluations = run_experiment(experiment, args)
        if not evaluations:  # a non-main process of a multi-process launch
            continue
        table[budget] = {}
        for name, evaluation in evaluations.items():
            record = json.loads((Path(args.output_dir) / name / "evaluation.json").read_text())
            table[budget][name] = position_use(evaluation, record["training"].get("train_tokens"))
    if table:
        write_sweep(Path(training.output_dir), table)
    return table


def sweep_markdown(table: dict[int, dict[str, dict]]) -> str:
    budgets = sorted(table)
    models = list(dict.fromkeys(name for budget in budgets for name in table[budget]))
    first = next(iter(table[budgets[0]].values()))
    header = ["Model"] + [f"{b} steps ({_tokens(table[b])})" for b in budgets]
    lines = [
        "# Position use by training budget",
        "",
        f"Nonoverlapping perplexity at the training length -> at {first['longest']} tokens "
        f"({first['longest'] // first['train_length']}x), and their ratio (> 1: worse past the training length).",
        "",
        "| " + " | ".join(header) + " |",
        "|---" + "|---:" * len(budgets) + "|",
    ]
    for name in models:
        cells = []
        for budget in budgets:
            row = table[budget].get(name)
            if row is None:
                cells.append("-")
            else:
                cells.append(f"{row['ppl_train_length']:.2f} -> {row['ppl_longest']:.2f} (**{row['ratio']:.2f}x**)")
        lines.append("| " + " | ".join([name] + cells) + " |")
    return "\n".join(lines) + "\n"


def write_sweep(output_dir: Path, table: dict[int, dict[str, dict]]) -> None:
    write_text_atomically(output_dir / "budget_sweep.json", json.dumps({str(b): v for b, v in table.items()}, indent=2))
    write_text_atomically(output_dir / "budget_sweep.md", sweep_markdown(table))
    plot_sweep(table, output_dir / "budget_sweep.png")


def main(argv: list[str] | None = None) -> None:
    """`hf-alibi sweep`: parse `argv` (ExperimentArguments, SweepArguments, TrainingArguments) and run the sweep.
    `--smoke` shrinks the model and data to the smoke budget; the budgets stay as given."""
    from ..setup.arguments import ExperimentArguments, apply_smoke, parse_args

    argv = sys.argv[1:] if argv is None else argv
    experiment, sweep, training = parse_args(argv, ExperimentArguments, SweepArguments, prog="hf-alibi sweep")
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if experiment.smoke:
        apply_smoke(experiment, training)
    run_budget_sweep(experiment, training, sweep)


def _tokens(row: dict[str, dict]) -> str:
    tokens = next(iter(row.values()))["train_tokens"]
    if tokens is None:
        return "-"
    return f"{tokens / 1e6:.2f}M tokens" if tokens >= 100_000 else f"{tokens:,} tokens"


__all__ = ["SweepArguments", "main", "budget_training_args", "position_use", "run_budget_sweep", "write_sweep"]
