"""Train short, test long: train each position encoding with `transformers.Trainer` at one length, evaluate at many.

The recipe `recipes/train_short_test_long.py` is a thin `main()` over `run_experiment`. Layout of a run:

    <output_dir>/<model>/checkpoint-*      Trainer checkpoints (resume from these)
    <output_dir>/<model>/final/            the model + tokenizer (+ card for ALiBi): what push_to_hub uploads
    <output_dir>/<model>/evaluation.json   its length evaluation
    <output_dir>/results.{json,csv,md}, perplexity_vs_length.png, loss_by_position.png
    <output_dir>/.hf_alibi.lock            held while a run is live (a second run into the folder refuses)
"""

import json
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from accelerate import PartialState
from transformers import AutoTokenizer, Trainer, TrainingArguments, default_data_collator, set_seed
from transformers.trainer_utils import get_last_checkpoint

from .baselines import BASELINES, build_model, max_supported_length
from .data import STDLIB_CORPUS, corpus_fingerprint, heldout_token_ids, load_text_corpus, pack_documents
from .launch import check_process_group, output_dir_lock
from .length_eval import ModelEvaluation, evaluate_model
from .model_card import save_card
from .results import format_summary, write_results
from .tokenization import load_or_train_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODELS = ["alibi", "learned", "sinusoidal"]


@dataclass
class ExperimentArguments:
    """What a train-short/test-long experiment varies. `TrainingArguments` carry everything about optimisation."""

    models: list[str] = field(
        default_factory=lambda: list(DEFAULT_MODELS),
        metadata={"help": f"Position encodings to train, from {list(BASELINES)}."},
    )
    all_models: bool = field(default=False, metadata={"help": "Train all five position encodings."})
    train_length: int = field(default=256, metadata={"help": "Training sequence length (tokens per block)."})
    eval_factors: list[int] = field(
        default_factory=lambda: [1, 2, 4, 8, 16],
        metadata={"help": "Evaluate at train_length times each factor (every factor >= 1)."},
    )
    eval_stride: int | None = field(
        default=None, metadata={"help": "Sliding-window stride; default half of each evaluation length."}
    )
    eval_max_documents: int | None = field(default=None, metadata={"help": "Cap on held-out documents evaluated."})
    eval_batch_tokens: int = field(default=8192, metadata={"help": "Input tokens per evaluation forward."})
    dataset_name: str | None = field(
        default=None, metadata={"help": f"None/'{STDLIB_CORPUS}' (offline default), a Hub dataset, or a builder."}
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Hub dataset configuration, e.g. wikitext-103-raw-v1."}
    )
    data_files: list[str] | None = field(default=None, metadata={"help": "Local data files or globs."})
    text_column: str = field(default="text", metadata={"help": "Column holding each document's text."})
    heldout_fraction: float = field(
        default=0.1, metadata={"help": "Documents held out when the data has no validation split."}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder or Hub id; default: a byte-level BPE trained on the train split."},
    )
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary of the locally trained tokenizer."})
    n_embd: int = field(default=256, metadata={"help": "Model width (all models)."})
    n_layer: int = field(default=4, metadata={"help": "Model depth (all models)."})
    n_head: int = field(default=8, metadata={"help": "Attention heads (all models)."})
    dropout: float = field(default=0.0, metadata={"help": "Every dropout probability."})
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint (folder or Hub id) to fine-tune ('alibi' only), with its tokenizer: BLOOM, MPT or "
            "Falcon-RW (imported exactly by hf_alibi.convert) or GPT-2 (converted: it must first learn ALiBi)."
        },
    )
    init_from_gpt2: str | None = field(default=None, metadata={"help": "Older name of init_from."})
    max_train_documents: int | None = field(
        default=None, metadata={"help": "Cap on training documents (tokenizer and blocks; smoke runs)."}
    )
    max_train_blocks: int | None = field(default=None, metadata={"help": "Cap on training blocks (smoke runs)."})
    smoke: bool = field(default=False, metadata={"help": "Whole pipeline on a tiny model and budget (< 1 minute)."})

    def __post_init__(self):
        if self.all_models:
            self.models = list(BASELINES)
        unknown = [name for name in self.models if name not in BASELINES]
        if unknown or not self.models:
            raise ValueError(f"unknown model name(s) {unknown or self.models}; choose from {list(BASELINES)}")
        if self.train_length <= 0:
            raise ValueError(f"train_length must be positive, got {self.train_length}")
        if not self.eval_factors or any(f < 1 for f in self.eval_factors):
            raise ValueError(
                f"eval_factors must all be >= 1 (no evaluation below the training length), got {self.eval_factors}"
            )
        if self.eval_stride is not None and not 1 <= self.eval_stride <= self.train_length:
            raise ValueError(f"eval_stride must be in [1, train_length={self.train_length}], got {self.eval_stride}")
        if self.init_from_gpt2 is not None:
            if self.init_from not in (None, self.init_from_gpt2):
                raise ValueError(f"init_from={self.init_from!r} and init_from_gpt2={self.init_from_gpt2!r}: give one")
            self.init_from = self.init_from_gpt2
        if self.init_from is not None and self.models != ["alibi"]:
            raise ValueError(f"init_from fine-tunes one ALiBi model: set models to ['alibi'], got {self.models}")

    @property
    def eval_lengths(self) -> list[int]:
        return sorted({self.train_length * f for f in self.eval_factors})


SMOKE_OVERRIDES = {
    "experiment": dict(train_length=32, eval_factors=[1, 2, 4], n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                       eval_max_documents=4, max_train_documents=60, max_train_blocks=256),
    "training": dict(max_steps=8, per_device_train_batch_size=8, logging_steps=4, save_steps=4, warmup_steps=0),
}  # fmt: skip


def apply_smoke(experiment: ExperimentArguments, training: TrainingArguments) -> None:
    """Shrink a run to the tiny smoke budget in place (the pipeline stays whole)."""
    for key, value in SMOKE_OVERRIDES["experiment"].items():
        setattr(experiment, key, value)
    for key, value in SMOKE_OVERRIDES["training"].items():
        setattr(training, key, value)


def _final_dir(output_dir: Path, name: str) -> Path:
    return output_dir / name / "final"


def check_output_dir(experiment: ExperimentArguments, training: TrainingArguments) -> None:
    """Refuse to train over finished models unless resuming: nothing is overwritten silently."""
    output_dir = Path(training.output_dir)
    finished = [name for name in experiment.models if (output_dir / name / "evaluation.json").exists()]
    if finished and not training.resume_from_checkpoint:
        raise ValueError(
            f"{output_dir} already holds finished models {finished}: pass --resume_from_checkpoint true to continue "
            "the run, or choose another --output_dir"
        )


def prepare_data(experiment: ExperimentArguments, state: PartialState):
    """Load the corpus, get the tokenizer, pack training blocks, and tokenize held-out documents."""
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
        train_blocks = pack_documents(corpus["train"], tokenizer, experiment.train_length)
    if experiment.max_train_blocks is not None:
        train_blocks = train_blocks.select(range(min(experiment.max_train_blocks, len(train_blocks))))
    heldout = heldout_token_ids(corpus["validation"], tokenizer, max(experiment.eval_lengths) + 1)
    return corpus, tokenizer, train_blocks, heldout


def make_model(name: str, experiment: ExperimentArguments, tokenizer):
    if experiment.init_from is not None:
        from ..conversion import convert

        model = convert(experiment.init_from)  # any importable family, found by its model_type
        model.config.n_positions = experiment.train_length
        return model
    return build_model(
        name,
        vocab_size=len(tokenizer),
        n_embd=experiment.n_embd,
        n_layer=experiment.n_layer,
        n_head=experiment.n_head,
        train_length=experiment.train_length,
        max_length=max(experiment.eval_lengths),
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


def train_one(
    name, experiment, training, tokenizer, train_blocks, state, callbacks=None
) -> tuple[torch.nn.Module, dict]:
    """Train (or resume) one model; save it atomically to `<output_dir>/<name>/final`. Returns (model, facts)."""
    model_dir = Path(training.output_dir) / name
    args = TrainingArguments(**{**training.to_dict(), "output_dir": str(model_dir), "push_to_hub": False})
    set_seed(args.seed)
    model = make_model(name, experiment, tokenizer)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_blocks,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
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
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
    state.wait_for_everyone()
    facts = {
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "final_logged_loss": next((log["loss"] for log in reversed(trainer.state.log_history) if "loss" in log), None),
        "train_seconds": round(seconds, 1),
        "train_tokens_per_second": round(
            result.metrics.get("train_samples_per_second", 0) * experiment.train_length, 1
        ),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    return trainer.model, facts


def _atomic_json(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def run_experiment(
    experiment: ExperimentArguments, training: TrainingArguments, callbacks=None
) -> dict[str, ModelEvaluation]:
    """Train every requested model at `train_length`, evaluate each at `eval_lengths`, write results and cards.

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
        "train_blocks": len(train_blocks),
        "heldout_documents": len(heldout),
        "experiment": asdict(experiment),
        "training": {k: training.to_dict()[k] for k in ("max_steps", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps",
                     "weight_decay", "bf16", "seed")},
        "world_size": state.num_processes,
        "command": " ".join(sys.argv),
    }  # fmt: skip
    evaluations: dict[str, ModelEvaluation] = {}
    for name in experiment.models:
        record = output_dir / name / "evaluation.json"
        if record.exists():  # finished in an earlier, interrupted run
            saved = json.loads(record.read_text())
            evaluations[name], metadata[f"{name}_training"] = (
                ModelEvaluation.from_dict(saved["evaluation"]),
                saved["training"],
            )
            continue
        model, facts = train_one(name, experiment, training, tokenizer, train_blocks, state, callbacks)
        if state.is_main_process:
            model = model.float().eval()
            evaluation = evaluate_model(
                model,
                heldout,
                experiment.eval_lengths,
                name=name,
                train_length=experiment.train_length,
                stride=experiment.eval_stride,
                batch_tokens=experiment.eval_batch_tokens,
                max_length=max_supported_length(model),
                max_documents=experiment.eval_max_documents,
            )
            _atomic_json(record, {"evaluation": evaluation.to_dict(), "training": facts})
            evaluations[name], metadata[f"{name}_training"] = evaluation, facts
            logger.info("%s: %s", name, facts)
        state.wait_for_everyone()
        del model
    if state.is_main_process:
        write_results(output_dir, evaluations, metadata=metadata)
        write_cards(experiment, training, evaluations, metadata)
        print(format_summary(evaluations, output_dir))
        if training.push_to_hub:
            push_alibi_model(experiment, training)
    state.wait_for_everyone()
    return evaluations


def write_cards(experiment, training, evaluations, metadata) -> None:
    """A model card (with the extrapolation table and plot) in the final folder of the ALiBi model."""
    output_dir = Path(training.output_dir)
    for name in ("alibi",):  # the template describes ALiBi slopes; NoPE (zero slopes) gets none
        if name not in evaluations:
            continue
        others = {other: ev for other, ev in evaluations.items() if other != name}
        save_card(
            _final_dir(output_dir, name),
            evaluations[name],
            plot_path=output_dir / "perplexity_vs_length.png",
            model_name=training.hub_model_id or f"alibi-gpt2-{name}-{experiment.train_length}",
            repo_id=training.hub_model_id,
            architecture={k: getattr(experiment, k) for k in ("n_embd", "n_layer", "n_head", "vocab_size")},
            training={**metadata["training"], **metadata.get(f"{name}_training", {}),
                      "corpus_fingerprint": metadata["corpus_fingerprint"]},
            compare_with=others,
        )  # fmt: skip


def push_alibi_model(experiment, training) -> str:
    """Upload the ALiBi model's final folder (weights, config with auto_map, code, tokenizer, card, plot) as is."""
    from huggingface_hub import HfApi

    if not training.hub_model_id:
        raise ValueError("push_to_hub needs --hub_model_id")
    folder = _final_dir(Path(training.output_dir), "alibi")
    api = HfApi(token=training.hub_token)
    api.create_repo(training.hub_model_id, private=training.hub_private_repo, exist_ok=True)
    api.upload_folder(
        repo_id=training.hub_model_id, folder_path=str(folder), commit_message="hf_alibi train-short-test-long"
    )
    return training.hub_model_id
