"""Training one model of the recipe with `transformers.Trainer`, and measuring what training every model costs.

A model is named `encoding` (trained at `train_length`) or `encoding@length`; `model_training_args` gives it its own
folder and the per-device batch that keeps the tokens per step of every model equal. `train_one` trains (or resumes)
it and saves `<output_dir>/<name>/final` atomically; `measure_costs` times every model again, interleaved
(`training_cost`), so that their costs compare. `runner.run_experiment` calls both.
"""

import shutil
import statistics
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator, set_seed
from transformers.trainer_utils import get_last_checkpoint

from ...atomic_files import replace_folder
from ..setup.arguments import ExperimentArguments, parse_model_spec
from ..setup.baselines import build_model
from ..setup.launch import final_dir, shard_model  # final_dir: re-exported, it lived here
from ..setup.token_budget import batch_size_at
from .peak_memory import PeakMemory
from .training_cost import measure_training_costs


def make_model(name: str, experiment: ExperimentArguments, tokenizer, train_length: int | None = None):
    """A fresh model of position encoding `name` to be trained at `train_length` (default `experiment.train_length`)."""
    train_length = train_length or experiment.train_length
    if experiment.init_from is not None:
        from ...conversion import convert

        model = convert(experiment.init_from)  # any importable family, found by its model_type
        model.config.n_positions = train_length
        return model
    return build_model(
        name,
        vocab_size=len(tokenizer),
        n_embd=experiment.n_embd,
        n_layer=experiment.n_layer,
        n_head=experiment.n_head,
        train_length=train_length,
        max_length=max(*experiment.eval_lengths, train_length),
        dropout=experiment.dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _resume_point(model_dir: Path, resume) -> str | None:
    """`true`/`last`: the newest checkpoint in `model_dir` (None: start fresh); any other value is a checkpoint path."""
    if not resume:
        return None
    if str(resume).lower() in ("true", "last", "1"):
        return get_last_checkpoint(str(model_dir)) if model_dir.is_dir() else None
    return str(resume)


class StepClock(TrainerCallback):
    """Wall time of every optimisation step of a Trainer run (`on_step_begin` to `on_step_end`)."""

    def __init__(self):
        self.seconds: list[float] = []
        self._began = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._began is not None:
            self.seconds.append(time.perf_counter() - self._began)
            self._began = None


def model_training_args(name: str, experiment, training) -> tuple[str, int, int, TrainingArguments]:
    """`(encoding, training length, per-device batch, TrainingArguments)` of model `name` (`encoding[@length]`)."""
    encoding, length = parse_model_spec(name, experiment.train_length)
    batch = batch_size_at(experiment, training, length)
    overrides = {
        "output_dir": str(Path(training.output_dir) / name),
        "push_to_hub": False,
        "per_device_train_batch_size": batch,
    }
    steps = experiment.max_steps_of(name)
    if steps is not None:  # a model given a longer schedule than the others
        overrides["max_steps"] = steps
    if experiment.sharded:  # Trainer 5.24-5.25 keeps no optimizer state of a model sharded at load time (it refuses)
        overrides["save_only_model"] = True
    return encoding, length, batch, TrainingArguments(**{**training.to_dict(), **overrides})


def train_one(
    name, experiment, training, tokenizer, train_blocks, state, callbacks=None
) -> tuple[torch.nn.Module, dict]:
    """Train (or resume) model `name` (`encoding[@length]`); save it atomically to `<output_dir>/<name>/final`.

    `train_blocks` maps each training length to its packed blocks. Returns `(model, facts)`; the facts carry the
    training length, batch, tokens, the run's own clock (`train_seconds`, Trainer's tokens/s, the median step and the
    seconds spent outside steps: checkpoints, logging) and its peak memory (`PeakMemory`). The run's clock is what
    this run took on this machine; compare models by `measure_costs`, which times them interleaved.
    """
    encoding, length, batch, args = model_training_args(name, experiment, training)
    model_dir = Path(args.output_dir)
    set_seed(args.seed)
    model = make_model(encoding, experiment, tokenizer, length)
    if experiment.sharded:
        model = shard_model(model, experiment, model_dir / "initial", state)
    clock = StepClock()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_blocks[length],
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[*(callbacks or []), clock],
    )
    with PeakMemory(args.device) as peak:
        start = time.perf_counter()
        result = trainer.train(resume_from_checkpoint=_resume_point(model_dir, training.resume_from_checkpoint))
        seconds = time.perf_counter() - start
    final = final_dir(Path(training.output_dir), name)
    staging = model_dir / ".final.tmp"
    if state.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    state.wait_for_everyone()
    trainer.save_model(str(staging))  # only the main process writes
    if state.is_main_process:
        replace_folder(staging, final)
    state.wait_for_everyone()
    steady = clock.seconds[2:] or clock.seconds  # the first steps carry one-time set-up
    facts = {
        "train_length": length,
        "per_device_train_batch_size": batch,
        "train_tokens": result.global_step * batch * length * args.gradient_accumulation_steps * state.num_processes,
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "final_logged_loss": next((log["loss"] for log in reversed(trainer.state.log_history) if "loss" in log), None),
        "train_seconds": round(seconds, 1),
        "train_tokens_per_second": round(result.metrics.get("train_samples_per_second", 0) * length, 1),
        "step_seconds_median": round(statistics.median(steady), 5) if steady else None,
        "step_seconds_mean": round(statistics.fmean(steady), 5) if steady else None,  # > median: slow steps (load)
        "seconds_outside_steps": round(seconds - sum(clock.seconds), 1),
        **peak.result(),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return trainer.model, facts


def measure_costs(experiment, training, tokenizer, train_blocks) -> dict[str, dict]:
    """Training cost of every model, measured the same way (`training_cost`): fresh models, interleaved steps on a
    batch as the recipe's collator makes it, the optimizer Trainer creates. `{name: cost}`; {} when
    `experiment.cost_steps` is 0."""
    if experiment.cost_steps == 0:
        return {}

    def builder(name):
        def build():
            encoding, length, batch, args = model_training_args(name, experiment, training)
            set_seed(args.seed)
            model = make_model(encoding, experiment, tokenizer, length).to(args.device)
            optimizer = Trainer(model=model, args=args).create_optimizer()
            blocks = train_blocks[length]
            inputs = default_data_collator([blocks[i % len(blocks)] for i in range(batch)])
            return model, optimizer, {key: value.to(args.device) for key, value in inputs.items()}

        return build

    return measure_training_costs(
        {name: builder(name) for name in experiment.models},
        steps=experiment.cost_steps,
        warmup=experiment.cost_warmup_steps,
        max_grad_norm=training.max_grad_norm,
        device=training.device,
    )


__all__ = ["StepClock", "final_dir", "make_model", "measure_costs", "model_training_args", "train_one"]
