"""Did each model of a retrieval run learn the copy, when, and with which heads? One table over finished runs.

    python -m hf_alibi.experiments.retrieval.retrieval_diagnosis --runs runs/sweep/rotary-lr1e-3 runs/sweep/alibi-lr1e-3 \\
        --config retrieval --diagnosis_markdown diagnosis_table.md

For every trained model (`<run>/<model>/final`) of every run folder: its copy curve (`copy_curve_steps`; the first
step at >= 90% exact match and the last point), and the induction-head look (`copy_curve.copy_attention`) on the
held-out 1x passkey probes of the config given (`--config` and overrides as `hf-alibi train` takes them): per layer,
the largest weight one head puts from the answer queries onto the needle digit to copy. A layer whose best head puts
most of its weight there holds an induction head; a model that never learned the copy has none.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from ...atomic_files import write_text_atomically
from ..data.corpus import heldout_token_ids, load_recipe_corpus
from ..setup.arguments import ExperimentArguments
from ..setup.baselines import restore_position_encoding
from ..setup.parsing import parse_args
from .copy_curve import CURVE_FILE, copy_attention, first_step_at, read_curve
from .experiment import experiment_probes
from .passkey import PasskeyTemplate, filler_stream


@dataclass
class DiagnosisArguments:
    """Which runs to read and where the table goes."""

    runs: list[str] = field(default_factory=list, metadata={"help": "Finished retrieval run folders (output_dir)."})
    diagnosis_markdown: str | None = field(default=None, metadata={"help": "Write the table here (atomically)."})


def probes_for(experiment: ExperimentArguments, tokenizer) -> list:
    """The held-out passkey probes at the training length, as a retrieval run of `experiment` builds them."""
    heldout = heldout_token_ids(
        load_recipe_corpus(experiment)["validation"], tokenizer, max(experiment.eval_lengths) + 1
    )
    template = PasskeyTemplate.from_tokenizer(tokenizer, experiment.passkey_digits)
    stream = filler_stream(heldout, tokenizer.eos_token_id)
    return experiment_probes(experiment, stream, template, experiment.train_length)


def diagnose_model(model_dir: Path, examples: list) -> dict:
    """One trained model's row: its copy curve's summary and its best head's copy attention per layer."""
    model = AutoModelForCausalLM.from_pretrained(model_dir / "final", attn_implementation="eager")
    model = restore_position_encoding(model).float().eval()
    curve = read_curve(model_dir / CURVE_FILE)
    scores = copy_attention(model, examples)  # [layer][head]
    return {
        "model": model_dir.name,
        "first_step_90": first_step_at(curve),
        "last": curve[-1] if curve else None,
        "copy_attention_best_head": [max(heads) for heads in scores],
    }


def diagnosis_table(rows: list[dict]) -> str:
    """The markdown table of `diagnose_model` rows, each with its `run`."""
    lines = [
        "| run | model | first step >= 90% | last step: exact / per digit | loss on the copy / on the needle | "
        "copy attention of the best head, by layer |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        last = row["last"]
        first = "no curve" if last is None else ("never" if row["first_step_90"] is None else row["first_step_90"])
        accuracy = (
            "-" if last is None else f"{last['step']}: {100 * last['exact']:.0f}% / {100 * last['per_digit']:.0f}%"
        )
        losses = "-" if last is None else f"{last['copy_loss']:.3f} / {last['needle_loss']:.3f}"
        attention = ", ".join(f"{a:.2f}" for a in row["copy_attention_best_head"])
        lines.append(f"| {row['run']} | {row['model']} | {first} | {accuracy} | {losses} | {attention} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    """Parse `argv` (default `sys.argv[1:]`), diagnose every model of every run, print (and write) the table."""
    arguments, experiment, _ = parse_args(
        sys.argv[1:] if argv is None else argv, DiagnosisArguments, ExperimentArguments, prog="retrieval_diagnosis"
    )
    if not arguments.runs:
        raise ValueError("name at least one finished retrieval run folder with --runs")
    rows, examples = [], None
    for run in map(Path, arguments.runs):
        models = sorted(path for path in run.iterdir() if (path / "final").is_dir()) if run.is_dir() else []
        if not models:
            raise ValueError(f"{run} holds no trained model (<model>/final): is it a finished retrieval run?")
        for model_dir in models:
            if examples is None:  # every run of one config shares the tokenizer: the same probes for all
                examples = probes_for(experiment, AutoTokenizer.from_pretrained(model_dir / "final"))
            rows.append({"run": run.name, **diagnose_model(model_dir, examples)})
    table = diagnosis_table(rows)
    if arguments.diagnosis_markdown:
        write_text_atomically(arguments.diagnosis_markdown, table)
    print(table, end="")
    return table


if __name__ == "__main__":
    main()
