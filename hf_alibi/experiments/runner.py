"""Train short, test long: train each position encoding with `transformers.Trainer` at one length, evaluate at many.

`hf-alibi train` (`train_short_test_long.main`) is a thin `main()` over `run_experiment`. A model is named by its
position encoding (`learned`: trained at `train_length`) or by encoding and training length (`learned@512`). Every
model sees the same number of training tokens: at `k x train_length` the batch holds `1/k` as many sequences (same
steps, same tokens per step, same schedule). Layout of a run:

    <output_dir>/<model>/checkpoint-*      Trainer checkpoints (resume from these)
    <output_dir>/<model>/final/            model + tokenizer (+ card, figures for ALiBi): what push_to_hub uploads
    <output_dir>/<model>/evaluation.json   its length evaluation and training facts (tokens/s, peak memory)
    <output_dir>/results.{json,csv,md}, perplexity_vs_length.png, loss_by_position.png
    <output_dir>/.hf_alibi.lock            held while a run is live (a second run into the folder refuses)
    <output_dir>/effective_window.{json,png}   ALiBi models: measured attention window per head vs ln(1/eps) / m_h
"""

import json
import logging
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from accelerate import PartialState
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from ..atomic_files import replace_folder, write_text_atomically
from ..models.alibi_gpt2.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .attention_window import measure_effective_window, window_table
from .arguments import ExperimentArguments, apply_smoke, batch_size_at, parse_model_spec
from .baselines import build_model, max_supported_length
from .data import STDLIB_CORPUS, corpus_fingerprint, heldout_token_ids, load_text_corpus, pack_documents
from .launch import check_process_group, output_dir_lock, shard_model
from .length_eval import ModelEvaluation, evaluate_model, select_documents
from .model_card import save_card
from .peak_memory import PeakMemory
from .plots import plot_alibi_bias, plot_effective_window
from .results import format_summary, write_results
from .tokenization import load_or_train_tokenizer
from .training_cost import measure_training_costs

logger = logging.getLogger(__name__)

__all__ = ["ExperimentArguments", "apply_smoke", "run_experiment", "train_one", "write_cards", "push_alibi_model"]


def _final_dir(output_dir: Path, name: str) -> Path:
    return output_dir / name / "final"


def check_output_dir(experiment: ExperimentArguments, training: TrainingArguments) -> None:
    """Refuse to train over finished models unless resuming: nothing is overwritten silently."""
    for length in experiment.train_lengths():
        batch_size_at(experiment, training, length)  # a bad combination fails before anything is written
    output_dir = Path(training.output_dir)
    finished = [name for name in experiment.models if (output_dir / name / "evaluation.json").exists()]
    if finished and not training.resume_from_checkpoint:
        raise ValueError(
            f"{output_dir} already holds finished models {finished}: pass --resume_from_checkpoint true to continue "
            "the run, or choose another --output_dir"
        )


def prepare_data(experiment: ExperimentArguments, state: PartialState):
    """Load the corpus, get the tokenizer, pack training blocks per training length, tokenize held-out documents.

    Returns `(corpus, tokenizer, {training length: blocks}, held-out token ids)`. Blocks of every length come from
    the same training documents; `max_train_blocks` caps the blocks of `train_length` and the others to the same
    number of tokens.
    """
    if experiment.init_from is not None:
        from ..conversion.common import load_config

        load_config(experiment.init_from)  # a missing folder or an uncached Hub id fails here, by name
    corpus = load_text_corpus(
        experiment.dataset_name,
        experiment.dataset_config,
        data_files=experiment.data_files,
        text_column=experiment.text_column,
        heldout_fraction=experiment.heldout_fraction,
    )
    if experiment.max_train_documents is not None:
        corpus["train"] = corpus["train"].select(range(min(experiment.max_train_documents, len(corpus["train"]))))
    with state.main_process_first():  # one process trains and caches the tokenizer; the others load it
        if experiment.init_from is not None:
            tokenizer = AutoTokenizer.from_pretrained(experiment.tokenizer_name or experiment.init_from)
        elif experiment.tokenizer_name is not None:
            tokenizer = AutoTokenizer.from_pretrained(experiment.tokenizer_name)
        else:
            tokenizer = load_or_train_tokenizer(corpus["train"], experiment.vocab_size)
        train_blocks = {length: pack_documents(corpus["train"], tokenizer, length)
                        for length in experiment.train_lengths()}  # fmt: skip
    if experiment.max_train_blocks is not None:
        tokens = experiment.max_train_blocks * experiment.train_length
        for length, blocks in train_blocks.items():
            train_blocks[length] = blocks.select(range(min(max(1, tokens // length), len(blocks))))
    heldout = heldout_token_ids(corpus["validation"], tokenizer, max(experiment.eval_lengths) + 1)
    return corpus, tokenizer, train_blocks, heldout


def make_model(name: str, experiment: ExperimentArguments, tokenizer, train_length: int | None = None):
    """A fresh model of position encoding `name` to be trained at `train_length` (default `experiment.train_length`)."""
    train_length = train_length or experiment.train_length
    if experiment.init_from is not None:
        from ..conversion import convert

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
    overrides = {"output_dir": str(Path(training.output_dir) / name), "push_to_hub": False,
                 "per_device_train_batch_size": batch}  # fmt: skip
    if experiment.sharded:  # Trainer 5.24 checkpoints no optimizer state of a model sharded at load time (it refuses)
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
    final = _final_dir(Path(training.output_dir), name)
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
        "train_tokens_per_second": round(
            result.metrics.get("train_samples_per_second", 0) * length, 1
        ),
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


def _run_locked(experiment, training, state, callbacks) -> dict[str, ModelEvaluation]:
    check_output_dir(experiment, training)
    corpus, tokenizer, train_blocks, heldout = prepare_data(experiment, state)  # fails before writing anything
    output_dir = Path(training.output_dir)
    metadata = {
        "corpus": experiment.dataset_name or STDLIB_CORPUS,
        "corpus_fingerprint": corpus_fingerprint(corpus),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "train_length": experiment.train_length,
        "train_blocks": {length: len(blocks) for length, blocks in train_blocks.items()},
        "heldout_documents": len(heldout),
        "experiment": asdict(experiment),
        "training": {k: training.to_dict()[k] for k in ("max_steps", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
                     "weight_decay", "bf16", "seed")},
        "world_size": state.num_processes,
        "command": " ".join(sys.argv),
    }  # fmt: skip
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
                model = AlibiGPT2LMHeadModel.from_pretrained(_final_dir(output_dir, name))
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
            plot_effective_window(windows, output_dir / "effective_window.png")
        write_cards(experiment, training, evaluations, metadata, windows)
        print(format_summary(evaluations, output_dir))
        if training.push_to_hub:
            push_alibi_model(experiment, training)
    state.wait_for_everyone()
    return evaluations


def heldout_bytes_per_token(heldout, tokenizer, experiment) -> float:
    """Mean UTF-8 bytes per token of the evaluation text (the documents every length scores): bits per byte =
    bits per token / this. Exactly 1.0 for the byte-level vocabulary (`vocab_size: 257`)."""
    docs, _ = select_documents(heldout, experiment.eval_lengths, experiment.eval_max_documents)
    tokens = sum(doc.numel() for doc in docs)
    text_bytes = sum(len(tokenizer.decode(doc.tolist(), clean_up_tokenization_spaces=False).encode()) for doc in docs)
    return round(text_bytes / tokens, 6)


def write_cards(experiment, training, evaluations, metadata, windows=None) -> None:
    """A model card in the final folder of every ALiBi model: extrapolation table and plot, the bias figure
    (`alibi_bias.png`) and, when measured, the effective window per head (`effective_window.png`)."""
    output_dir = Path(training.output_dir)
    windows = windows or {}
    for name, (encoding, length) in experiment.model_specs().items():
        if encoding != "alibi" or name not in evaluations:  # the template describes ALiBi slopes; NoPE gets none
            continue
        final = _final_dir(output_dir, name)
        config = AutoConfig.from_pretrained(final)
        bias_plot = plot_alibi_bias(config, final / "alibi_bias.png", eps=experiment.window_eps)
        window_plot = None
        if name in windows:
            window_plot = plot_effective_window({name: windows[name]}, final / "effective_window.png")
        others = {other: ev for other, ev in evaluations.items() if other != name}
        save_card(
            final,
            evaluations[name],
            plot_path=output_dir / "perplexity_vs_length.png",
            bias_plot_path=bias_plot,
            window_plot_path=window_plot,
            window_table=window_table(windows[name]) if name in windows else "",
            model_name=training.hub_model_id or f"alibi-gpt2-{encoding}-{length}",
            repo_id=training.hub_model_id,
            architecture={k: getattr(config, k) for k in ("n_embd", "n_layer", "n_head", "vocab_size")},
            **fine_tuned_from(experiment.init_from),
            training={**metadata["training"], **metadata.get(f"{name}_training", {}),
                      "corpus_fingerprint": metadata["corpus_fingerprint"]},
            compare_with=others,
        )  # fmt: skip


def fine_tuned_from(init_from: str | None) -> dict:
    """`render_card`'s `base_model` and `source_license` for a model fine-tuned from `init_from` ({} if none): the
    Hub id or folder name, and the licence fields of the source's own model card."""
    if init_from is None:
        return {}
    from ..conversion.common import LICENSE_FIELDS, checkpoint_name, source_card_metadata

    card = source_card_metadata(init_from)
    base_model = card.get("base_model") if Path(init_from).exists() else None  # a local import names its source
    base_model = base_model if isinstance(base_model, str) else checkpoint_name(init_from)
    return {"base_model": base_model, "source_license": {k: card[k] for k in LICENSE_FIELDS if k in card}}


def push_alibi_model(experiment, training) -> str:
    """Upload the ALiBi model's final folder (weights, config with auto_map, code, tokenizer, card, plot) as is."""
    from huggingface_hub import HfApi

    if not training.hub_model_id:
        raise ValueError("push_to_hub needs --hub_model_id")
    alibi = [name for name, (encoding, _) in experiment.model_specs().items() if encoding == "alibi"]
    if not alibi:
        raise ValueError(f"push_to_hub uploads the ALiBi model, but models {experiment.models} has none")
    folder = _final_dir(Path(training.output_dir), alibi[0])
    api = HfApi(token=training.hub_token)
    api.create_repo(training.hub_model_id, private=training.hub_private_repo, exist_ok=True)
    api.upload_folder(
        repo_id=training.hub_model_id, folder_path=str(folder), commit_message="hf_alibi train-short-test-long"
    )
    return training.hub_model_id
