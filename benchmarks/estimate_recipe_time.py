"""Estimate the wall time of a train-short/test-long config from a few timed steps of every shape it runs.

    HF_HUB_OFFLINE=1 python -m benchmarks.estimate_recipe_time --config hf_alibi/experiments/configs/headline.yaml
    HF_HUB_OFFLINE=1 python -m benchmarks.estimate_recipe_time --config cpu_demo --steps 2

For every model of the config: `--steps` timed training steps (after one warm-up) at its own batch shape (forward,
loss, backward, AdamW step, on random tokens: the time does not depend on the values), times `max_steps`; one timed
evaluation forward per evaluation length at the runner's batch shape, times the number of batches the held-out
documents give (nonoverlapping, plus sliding when the config evaluates it); for ALiBi models one effective-window
forward (`output_attentions`), times the windows measured. Trainer overhead (logging, checkpoints), tokenizer and
data preparation are not timed: add about a minute.

Every timing is interleaved with the shape of the last quiet measurement (ALiBi, `make demo` on a quiet 2-core
machine, `results/cpu_demo_bpe8k`: training at 16 x 256 ran 1690.4 tokens/s (`--anchor`); its 32 x 256 evaluation batch
took 38.2 s / 23 batches = 1.66 s (`--eval_anchor`)), the minimum of each taken (contention only adds time), and the
ratio applied to the quiet figure: printed times are quiet-machine estimates, as steady as the load is between two
neighbouring timings.
"""

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from transformers import PreTrainedTokenizerBase, TrainingArguments

from hf_alibi.experiments.data.corpus import heldout_token_ids, load_recipe_corpus
from hf_alibi.experiments.data.tokenization import load_or_train_tokenizer
from hf_alibi.experiments.length.length_eval import nonoverlapping_windows, select_documents, sliding_windows
from hf_alibi.experiments.setup.arguments import ExperimentArguments, batch_size_at, parse_args
from hf_alibi.experiments.training.runner import make_model

from .measure import time_calls


def train_step(model, optimizer, ids: torch.Tensor) -> None:
    """One training step on `ids` (B, L): forward, loss, backward, AdamW."""
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.inference_mode()
def eval_forward(model, ids: torch.Tensor, **kwargs) -> None:
    model(input_ids=ids, use_cache=False, **kwargs)


def fastest_pair(work, anchor, repeats: int) -> tuple[float, float]:
    """Shortest of `repeats` timings of `work()` and of `anchor()`, interleaved (A B A B ...) after one warm-up each,
    so both see the same load; contention only ever adds time, hence the minimum."""
    times = time_calls({"anchor": anchor, "work": work}, repeats=repeats, warmup=1)
    return min(times["work"]), min(times["anchor"])


def evaluation_batches(docs, length: int, batch: int, stride: int | None, sliding: bool) -> int:
    windows = sum(len(nonoverlapping_windows(doc.numel(), length)) for doc in docs)
    if sliding:
        stride = stride or max(1, length // 2)
        windows_sliding = sum(len(sliding_windows(doc.numel(), length, stride)) for doc in docs)
        return math.ceil(windows / batch) + math.ceil(windows_sliding / batch)
    return math.ceil(windows / batch)


@dataclass(frozen=True)
class Recipe:
    """What the config trains and evaluates on: its arguments, its tokenizer and the held-out documents."""

    experiment: ExperimentArguments
    training: TrainingArguments
    tokenizer: PreTrainedTokenizerBase
    heldout: list[torch.LongTensor]  # the held-out documents long enough to evaluate, (L,) each
    docs: list[torch.LongTensor]  # those the evaluation selects

    @classmethod
    def load(cls, config: str) -> "Recipe":
        experiment, training = parse_args(["--config", config], ExperimentArguments)
        corpus = load_recipe_corpus(experiment)
        tokenizer = load_or_train_tokenizer(corpus["train"], experiment.vocab_size)
        heldout = heldout_token_ids(corpus["validation"], tokenizer, max(experiment.eval_lengths) + 1)
        docs, _ = select_documents(heldout, experiment.eval_lengths, experiment.eval_max_documents)
        return cls(experiment, training, tokenizer, heldout, docs)

    def random_ids(self, batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, len(self.tokenizer), (batch, length))  # (B, L)


class QuietClock:
    """Quiet-machine seconds of a call: timed interleaved with the anchor (the last quiet measurement's shape, an ALiBi
    model at 256 tokens), then scaled by the anchor's quiet figure (`--anchor`, `--eval_anchor`)."""

    def __init__(self, recipe: Recipe, args: argparse.Namespace):
        model = make_model("alibi", recipe.experiment, recipe.tokenizer, 256).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        train_ids = recipe.random_ids(16, 256)  # the quiet training measurement's shape
        eval_ids = recipe.random_ids(32, 256)  # its evaluation batch (8192 tokens at 256)
        self.train_anchor = partial(train_step, model, optimizer, train_ids)
        self.eval_anchor = partial(eval_forward, model, eval_ids)
        self.args = args

    def train(self, work: Callable[[], None]) -> float:
        here, anchor = fastest_pair(work, self.train_anchor, self.args.steps)
        return here * (16 * 256 / self.args.anchor) / anchor

    def eval(self, work: Callable[[], None]) -> float:
        here, anchor = fastest_pair(work, self.eval_anchor, 1)
        return here * self.args.eval_anchor / anchor


def estimate_model(recipe: Recipe, encoding: str, length: int, clock: QuietClock, skip_eval: bool) -> dict:
    """Quiet-machine seconds of one model of the config: its training, its evaluations, its effective window."""
    experiment = recipe.experiment
    model = make_model(encoding, experiment, recipe.tokenizer, length).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = batch_size_at(experiment, recipe.training, length)
    step = clock.train(partial(train_step, model, optimizer, recipe.random_ids(batch, length)))
    model.eval()
    evaluate = 0.0
    for eval_length in [] if skip_eval else experiment.eval_lengths:
        per_batch = max(1, experiment.eval_batch_tokens // eval_length)
        batches = evaluation_batches(
            recipe.docs, eval_length, per_batch, experiment.eval_stride, experiment.eval_sliding
        )
        evaluate += batches * clock.eval(partial(eval_forward, model, recipe.random_ids(per_batch, eval_length)))
    window = 0.0
    if encoding == "alibi" and not skip_eval:
        chunks = sum(doc.numel() // experiment.window_length for doc in recipe.heldout)
        window_ids = recipe.random_ids(1, experiment.window_length)
        window = min(8, chunks) * clock.eval(partial(eval_forward, model, window_ids, output_attentions=True))
    train = step * recipe.training.max_steps
    return {"batch": batch, "step": step, "train": train, "evaluate": evaluate, "window": window}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a shipped config's name or a YAML file")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per model (after a warm-up)")
    parser.add_argument("--anchor", type=float, default=1690.4, help="quiet-machine ALiBi training tokens/s, 16 x 256")
    parser.add_argument("--eval_anchor", type=float, default=1.66, help="quiet seconds of its 32 x 256 eval batch")
    parser.add_argument("--skip_eval", action="store_true", help="time training steps only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_arguments(argv)
    recipe = Recipe.load(args.config)
    torch.manual_seed(0)
    clock = QuietClock(recipe, args)
    total = 0.0
    for name, (encoding, length) in recipe.experiment.model_specs().items():
        times = estimate_model(recipe, encoding, length, clock, args.skip_eval)
        seconds = times["train"] + times["evaluate"] + times["window"]
        total += seconds
        print(
            f"{name:>20}: batch {times['batch']:3d} x {length:5d}, {times['batch'] * length / times['step']:6.0f} "
            f"tokens/s; train {times['train']:5.0f} s, evaluate {times['evaluate']:4.0f} s, "
            f"window {times['window']:3.0f} s; {seconds / 60:5.1f} min",
            flush=True,
        )
    print(f"total on a quiet machine: {total / 60:.1f} min, plus about a minute of data preparation and overhead")


if __name__ == "__main__":
    main()
