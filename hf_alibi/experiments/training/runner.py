"""Train short, test long: train each position encoding with `transformers.Trainer` at one length, evaluate at many.

The orchestration of one run: `run_experiment` takes the output folder's lock, prepares the data (`recipe_data`),
trains each model (`training`), evaluates it (`length_eval`, `attention_window`) and writes the results
(`results`), cards and Hub upload (`publish`). `hf-alibi train` (`train_short_test_long.main`) is a thin `main()`
over it. A model is named by its position encoding (`learned`: trained at `train_length`) or by encoding and
training length (`learned@512`). Every model sees the same number of training tokens: at `k x train_length` the
batch holds `1/k` as many sequences (same steps, same tokens per step, same schedule). Layout of a run:

    <output_dir>/<model>/checkpoint-*      Trainer checkpoints (resume from these)
    <output_dir>/<model>/final/            model + tokenizer (+ card, figures for ALiBi): what push_to_hub uploads
    <output_dir>/<model>/evaluation.json   its length evaluation and training facts (tokens/s, peak memory)
    <output_dir>/results.{json,csv,md}, perplexity_vs_length.png, loss_by_position.png
    <output_dir>/run_arguments.json        what the run was started with: rerunning with the same resumes it
    <output_dir>/.hf_alibi.lock            held while a run is live (a second run into the folder refuses)
    <output_dir>/effective_window.{json,png}   ALiBi models: measured attention window per head vs ln(1/eps) / m_h

The names this module exported before the split (`train_one`, `make_model`, `prepare_data`, `measure_costs`,
`write_cards`, `push_alibi_model`, ...) are still importable from here: the benchmarks and users' scripts use them.
"""

import json
import logging
import platform
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from accelerate import PartialState
from transformers import TrainingArguments

from ...atomic_files import write_text_atomically
from ...models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from ..data.corpus import STDLIB_CORPUS, corpus_fingerprint
from ..length.attention_window import measure_effective_window
from ..length.length_eval import ModelEvaluation, evaluate_model
from ..reporting.plots import plot_effective_window
from ..reporting.publish import fine_tuned_from, push_alibi_model, write_cards
from ..reporting.results import format_summary, run_caveat, write_results
from ..setup.arguments import ExperimentArguments
from ..setup.baselines import max_supported_length
from ..setup.launch import check_process_group, output_dir_lock, portable_command
from ..setup.token_budget import apply_smoke, batch_size_at
from .recipe_data import heldout_bytes_per_token, prepare_data
from .train_model import StepClock, final_dir, make_model, measure_costs, model_training_args, train_one

logger = logging.getLogger(__name__)

__all__ = [
    "ExperimentArguments",
    "apply_smoke",
    "run_experiment",
    "train_one",
    "write_cards",
    "push_alibi_model",
    # defined in training, recipe_data and publish; still importable from here (module docstring)
    "StepClock",
    "fine_tuned_from",
    "heldout_bytes_per_token",
    "make_model",
    "measure_costs",
    "model_training_args",
    "prepare_data",
]
# The `TrainingArguments` values a run's metadata (results.md, model cards) records.
RECORDED_TRAINING = (
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "bf16",
    "seed",
)


RUN_ARGUMENTS = "run_arguments.json"  # what a run was started with: a rerun with the same resumes it


def run_arguments(experiment: ExperimentArguments, training: TrainingArguments) -> dict:
    """The arguments that decide a run's results (the experiment's and `RECORDED_TRAINING`), as JSON values."""
    arguments = {"experiment": asdict(experiment), "training": {k: training.to_dict()[k] for k in RECORDED_TRAINING}}
    return json.loads(json.dumps(arguments, default=str))


def check_output_dir(experiment: ExperimentArguments, training: TrainingArguments) -> list[str]:
    """What the run will do in its output folder, as lines to print: nothing is ever overwritten silently.

    A fresh folder: a new run. A folder of an unfinished run started with the same arguments (`RUN_ARGUMENTS`): it is
    resumed as `--resume_from_checkpoint true` does (finished models kept, unfinished ones from their last
    checkpoint), so rerunning `make demo` after an interruption continues it. `ValueError` for a finished run
    (results.json written) unless `--resume_from_checkpoint` is given, for a run of other arguments, and for finished
    models without a record of their arguments (a run from before the record existed) unless resuming explicitly.
    """
    for length in experiment.train_lengths():
        batch_size_at(experiment, training, length)  # a bad combination fails before anything is written
    output_dir = Path(training.output_dir)
    finished = [name for name in experiment.models if (output_dir / name / "evaluation.json").exists()]
    record = output_dir / RUN_ARGUMENTS
    if record.exists() and not training.resume_from_checkpoint:
        recorded, arguments = json.loads(record.read_text()), run_arguments(experiment, training)
        if recorded != arguments:
            raise ValueError(
                f"{output_dir} holds a run started with other arguments ({_differences(recorded, arguments)}"
                "): choose another --output_dir"
            )
        if (output_dir / "results.json").exists():
            raise ValueError(
                f"{output_dir} holds a finished run (results in {output_dir / 'results.md'}): choose "
                "another --output_dir, or pass --resume_from_checkpoint true to redo its results"
            )
        training.resume_from_checkpoint = "true"
        return [f"{output_dir}: resuming the interrupted run of the same arguments"] + [
            f"  {name}: {_resume_state(output_dir / name, name in finished)}" for name in experiment.models
        ]
    if finished and not training.resume_from_checkpoint:
        raise ValueError(
            f"{output_dir} already holds finished models {finished}: pass --resume_from_checkpoint true to continue "
            "the run, or choose another --output_dir"
        )
    return []


def _resume_state(model_dir: Path, finished: bool) -> str:
    from transformers.trainer_utils import get_last_checkpoint

    if finished:
        return "finished earlier, kept"
    last = get_last_checkpoint(str(model_dir)) if model_dir.is_dir() else None
    return f"resumes from {Path(last).name}" if last else "starts (no checkpoint yet)"


def _differences(recorded: dict, arguments: dict) -> str:
    """`section.name: recorded -> now` for every argument that differs."""
    return (
        ", ".join(
            f"{section}.{name}: {recorded.get(section, {}).get(name)!r} -> {value!r}"
            for section, values in arguments.items()
            for name, value in values.items()
            if recorded.get(section, {}).get(name) != value
        )
        or "its record differs"
    )


def run_experiment(
    experiment: ExperimentArguments, training: TrainingArguments, callbacks=None
) -> dict[str, ModelEvaluation]:
    """Train every requested model at its training length, evaluate each at `eval_lengths`, write results and cards.

    ALiBi models also get their effective attention window measured (`attention_window`) at `window_length` tokens.

    `callbacks` are `transformers.TrainerCallback`s given to every model's `Trainer`. Refuses (before writing
    anything) a launch whose processes did not form one process group, and an output folder another live run holds.
    """
    _ = training.device  # TrainingArguments sets up the process group (gloo DDP on CPU under torchrun) first
    state = PartialState()
    check_process_group(state, use_cpu=training.use_cpu)
    with output_dir_lock(training.output_dir, state):
        return _run_locked(experiment, training, state, callbacks)


def run_metadata(experiment, training, state, corpus, train_blocks, heldout) -> dict:
    """What results.json/md and the cards record about the run: corpus, versions, arguments, launch."""
    return {
        "corpus": experiment.dataset_name or STDLIB_CORPUS,
        "corpus_fingerprint": corpus_fingerprint(corpus),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "train_length": experiment.train_length,
        "train_blocks": {length: len(blocks) for length, blocks in train_blocks.items()},
        "heldout_documents": len(heldout),
        "experiment": asdict(experiment),
        "training": {k: training.to_dict()[k] for k in RECORDED_TRAINING},
        "world_size": state.num_processes,
        "command": portable_command(),  # no machine paths in a committed result
    }


def evaluate_trained(model, name, encoding, length, experiment, heldout) -> tuple[ModelEvaluation, dict | None]:
    """Model `name`'s length evaluation and, for ALiBi, its measured effective window (`.to_dict()`; else None)."""
    model = model.float().eval()
    evaluation = evaluate_model(
        model,
        heldout,
        experiment.eval_lengths,
        name=name,
        train_length=length,
        stride=experiment.eval_stride,
        batch_tokens=experiment.eval_batch_tokens,
        max_length=max_supported_length(model),
        max_documents=experiment.eval_max_documents,
        sliding=experiment.eval_sliding,
    )
    window = None
    if encoding == "alibi":
        window = measure_effective_window(
            model, heldout, length=experiment.window_length, eps=experiment.window_eps
        ).to_dict()
    return evaluation, window


def _run_locked(experiment, training, state, callbacks) -> dict[str, ModelEvaluation]:
    plan = check_output_dir(experiment, training)
    corpus, tokenizer, train_blocks, heldout = prepare_data(experiment, state)  # fails before writing anything
    output_dir = Path(training.output_dir)
    if state.is_main_process:
        if plan:
            print("\n".join(plan), flush=True)
        record = json.dumps(run_arguments(experiment, training), indent=2) + "\n"
        if not (output_dir / RUN_ARGUMENTS).exists():
            write_text_atomically(output_dir / RUN_ARGUMENTS, record)
    state.wait_for_everyone()
    metadata = run_metadata(experiment, training, state, corpus, train_blocks, heldout)
    evaluations: dict[str, ModelEvaluation] = {}
    windows: dict[str, dict] = {}
    for name, (encoding, length) in experiment.model_specs().items():
        record = output_dir / name / "evaluation.json"
        if record.exists():  # finished in an earlier, interrupted run
            saved = json.loads(record.read_text())
            evaluations[name], metadata[f"{name}_training"] = (
                ModelEvaluation.from_dict(saved["evaluation"]),
                saved["training"],
            )
            if saved.get("window") is not None:
                windows[name] = saved["window"]
            continue
        model, facts = train_one(name, experiment, training, tokenizer, train_blocks, state, callbacks)
        if state.is_main_process:
            if experiment.sharded:  # a sharded forward needs every rank: evaluate the saved (gathered) model alone
                model = AlibiGPT2LMHeadModel.from_pretrained(final_dir(output_dir, name))
            evaluation, window = evaluate_trained(model, name, encoding, length, experiment, heldout)
            if window is not None:
                windows[name] = window
            payload = {"evaluation": evaluation.to_dict(), "training": facts, "window": window}
            write_text_atomically(record, json.dumps(payload, indent=2) + "\n")
            evaluations[name], metadata[f"{name}_training"] = evaluation, facts
            logger.info("%s: %s", name, facts)
        state.wait_for_everyone()
        del model
    if state.is_main_process:
        metadata["bytes_per_token"] = heldout_bytes_per_token(heldout, tokenizer, experiment)
        for name, cost in measure_costs(experiment, training, tokenizer, train_blocks).items():
            metadata[f"{name}_cost"] = cost
        write_results(output_dir, evaluations, metadata=metadata)
        if windows:
            write_text_atomically(output_dir / "effective_window.json", json.dumps(windows, indent=2) + "\n")
            plot_effective_window(windows, output_dir / "effective_window.png", caveat=run_caveat(metadata))
        write_cards(experiment, training, evaluations, metadata, windows)
        print(format_summary(evaluations, output_dir))
        if training.push_to_hub:
            push_alibi_model(experiment, training)
    state.wait_for_everyone()
    return evaluations
