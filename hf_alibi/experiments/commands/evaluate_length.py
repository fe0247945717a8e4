"""Evaluate causal LMs at multiples of their training length ("train short, test long") and write the results.

`hf-alibi evaluate` runs `main`; so does, in a clone, `python -m recipes.evaluate_length`. Arguments come from the
command line and, as for `hf-alibi train`, optionally a `--config` YAML file of `EvaluateLengthArguments` keys.

Writes `results.json`, `results.csv`, `results.md`, `perplexity_vs_length.png` and `loss_by_position.png` into
`--output_dir` (see `hf_alibi.experiments.reporting.results`) and prints a summary. Works on any saved checkpoint (ALiBi ones
load because `hf_alibi` is imported first) and, with a network, on Hub models and datasets.

CPU-sized (a minute or two: one checkpoint, 1x to 4x, four documents, no sliding window):

    HF_HUB_OFFLINE=1 hf-alibi evaluate --model runs/alibi/final \
        --length_factors 1 2 4 --max_documents 4 --no_sliding --output_dir runs/length_eval_small

The paper's sweep (1x to 16x), ALiBi against a baseline, on the offline Python-stdlib held-out documents:

    HF_HUB_OFFLINE=1 hf-alibi evaluate --model runs/alibi/final runs/sinusoidal/final \
        --name alibi sinusoidal --output_dir runs/length_eval

A Hub model on WikiText-103 (needs a network; GPT-2's position table stops at 1024, so 2x and up read "n/a"):

    hf-alibi evaluate --model gpt2 --dataset_name wikitext \
        --dataset_config wikitext-103-raw-v1 --train_length 1024 --length_factors 1 2 --output_dir runs/gpt2_wt103
"""

from __future__ import annotations

import gc
import json
import logging
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_alibi  # noqa: F401  (registers "alibi_gpt2" with the Auto classes before any checkpoint loads)
from hf_alibi.conversion.common import load_config

from ..length.length_eval import ModelEvaluation, evaluate_model
from ..reporting.results import format_summary, write_results
from ..setup.baselines import restore_position_encoding
from ..setup.launch import output_dir_lock
from ..setup.parsing import parse_args

logger = logging.getLogger(__name__)


@dataclass
class EvaluateLengthArguments:
    model: list[str] = field(metadata={"help": "Checkpoint folders or Hub ids to evaluate, one or more."})
    name: list[str] | None = field(
        default=None, metadata={"help": "Display names, one per --model; default: each checkpoint's folder name."}
    )
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer folder or Hub id for every model; default: each model's own."}
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Corpus: unset/'python-stdlib' (offline), a Hub dataset, or a builder with --data_files."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration name."})
    data_files: list[str] | None = field(default=None, metadata={"help": "Local data files or globs."})
    text_column: str = field(default="text", metadata={"help": "Column holding the documents' text."})
    validation_split: str | None = field(
        default=None, metadata={"help": "Held-out split; default 'validation' if present, else a hashed hold-out."}
    )
    heldout_fraction: float = field(
        default=0.1, metadata={"help": "Hold-out fraction when the data has no validation split (match training)."}
    )
    train_length: int | None = field(
        default=None, metadata={"help": "Training length in tokens; default: the first model's config.n_positions."}
    )
    length_factors: list[float] = field(
        default_factory=lambda: [1, 2, 4, 8, 16],
        metadata={"help": "Evaluation lengths as multiples of --train_length."},
    )
    stride: int | None = field(
        default=None, metadata={"help": "Sliding-window stride in tokens; default: half of each evaluation length."}
    )
    sliding: bool = field(default=True, metadata={"help": "Also run the sliding-window protocol (--no_sliding: off)."})
    batch_tokens: int = field(default=4096, metadata={"help": "Input tokens per forward pass (bounds memory)."})
    max_documents: int | None = field(
        default=None, metadata={"help": "Evaluate only the first N documents long enough for the longest length."}
    )
    output_dir: str = field(default="runs/length_eval", metadata={"help": "Where the results files go."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow checkpoints' own modeling code."})
    device: str | None = field(default=None, metadata={"help": "Torch device; default: cuda if available, else cpu."})

    def __post_init__(self):
        if self.name is not None and len(self.name) != len(self.model):
            raise ValueError(f"--name needs one name per --model: got {self.name} for {self.model}")
        if not self.length_factors or any(f <= 0 for f in self.length_factors):
            raise ValueError(f"length_factors must be positive, got {self.length_factors}")
        if self.train_length is not None and self.train_length < 1:
            raise ValueError(f"train_length must be positive, got {self.train_length}")


def main(argv: list[str] | None = None) -> dict[str, ModelEvaluation]:
    """Parse `argv` (default `sys.argv[1:]`), evaluate every model, write the results, print the summary."""
    argv = sys.argv[1:] if argv is None else argv
    (args,) = parse_args(argv, EvaluateLengthArguments, training_arguments=False, prog="hf-alibi evaluate")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with output_dir_lock(args.output_dir):  # a second evaluation into the same folder refuses to start
        results, metadata = evaluate_checkpoints(args)
        write_results(args.output_dir, results, metadata=metadata)
    print(format_summary(results, args.output_dir))
    return results


def evaluate_checkpoints(args: EvaluateLengthArguments) -> tuple[dict[str, ModelEvaluation], dict]:
    """Evaluate every `args.model` on the same documents and lengths; returns `({name: evaluation}, metadata)`."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = args.name or _default_names(args.model)
    configs = [load_config(path, trust_remote_code=args.trust_remote_code) for path in args.model]  # all, at once
    train_length = args.train_length or _config_train_length(args.model[0], configs[0])
    lengths = evaluation_lengths(train_length, args.length_factors)
    documents: dict[str, tuple[list[torch.Tensor], str]] = {}  # per tokenizer: (token ids, corpus fingerprint)
    results, tokenizers, fingerprints, steps = {}, {}, {}, {}
    for name, path in zip(names, args.model):
        tokenizer_path = args.tokenizer or path
        if tokenizer_path not in documents:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=args.trust_remote_code)
            documents[tokenizer_path] = load_documents(args, tokenizer, min_tokens=max(lengths) + 1)
        docs, fingerprints[name] = documents[tokenizer_path]
        tokenizers[name], steps[name] = tokenizer_path, _global_step(path)
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=args.trust_remote_code).to(device)
        restore_position_encoding(model)  # e.g. the embedding multiplier of a "sinusoidal_paper" baseline
        logger.info("evaluating %s (%s) at lengths %s on %d documents", name, path, lengths, len(docs))
        results[name] = evaluate_model(
            model,
            docs,
            lengths,
            name=name,
            train_length=train_length,
            stride=args.stride,
            batch_tokens=args.batch_tokens,
            max_documents=args.max_documents,
            sliding=args.sliding,
        )
        del model
        gc.collect()
    metadata = {
        "arguments": asdict(args),
        "train_length": train_length,
        "lengths": lengths,
        "models": dict(zip(names, args.model)),
        "tokenizers": tokenizers,
        "global_step": steps,
        "corpus_fingerprint": fingerprints,
        "device": str(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }
    return results, metadata


def evaluation_lengths(train_length: int, factors: list[float]) -> list[int]:
    """`train_length * factor` for each factor, each of which must give a whole number of tokens."""
    lengths = []
    for factor in factors:
        length = train_length * factor
        if length != int(length):
            raise ValueError(f"length factor {factor} x train_length {train_length} is not a whole number of tokens")
        lengths.append(int(length))
    return sorted(set(lengths))


def load_documents(args: EvaluateLengthArguments, tokenizer, min_tokens: int) -> tuple[list[torch.Tensor], str]:
    """Held-out documents of at least `min_tokens` tokens as 1-D LongTensors, and the corpus fingerprint.

    The one place that knows `hf_alibi.experiments.data.corpus`: its held-out split is a hash of each document's name, the same one
    the training recipe trains around.
    """
    from ..data.corpus import corpus_fingerprint, heldout_token_ids, load_text_corpus

    corpus = load_text_corpus(
        args.dataset_name,
        args.dataset_config,
        data_files=args.data_files,
        text_column=args.text_column,
        validation_split=args.validation_split,
        heldout_fraction=args.heldout_fraction,
    )
    return heldout_token_ids(corpus["validation"], tokenizer, min_eval_tokens=min_tokens), corpus_fingerprint(corpus)


def _default_names(paths: list[str]) -> list[str]:
    names = [Path(path.rstrip("/")).name or path for path in paths]
    if len(set(names)) < len(names):  # e.g. runs/alibi/final and runs/sinusoidal/final
        names = [path.rstrip("/") for path in paths]
    return names


def _config_train_length(path: str, config) -> int:
    length = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not length:
        raise ValueError(f"{path}: its config names no training length; pass --train_length")
    return int(length)


def _global_step(path: str) -> int | None:
    """The training step of a Trainer checkpoint (from `trainer_state.json`), None if it has none."""
    state = Path(path) / "trainer_state.json"
    return json.loads(state.read_text()).get("global_step") if state.is_file() else None


if __name__ == "__main__":
    from ...command_errors import run_command

    sys.exit(run_command(main))
