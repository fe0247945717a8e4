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

import torch

from hf_alibi.experiments.arguments import ExperimentArguments, batch_size_at, parse_args
from hf_alibi.experiments.data import heldout_token_ids, load_recipe_corpus
from hf_alibi.experiments.length_eval import nonoverlapping_windows, select_documents, sliding_windows
from hf_alibi.experiments.runner import make_model
from hf_alibi.experiments.tokenization import load_or_train_tokenizer

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a shipped config's name or a YAML file")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per model (after a warm-up)")
    parser.add_argument("--anchor", type=float, default=1690.4, help="quiet-machine ALiBi training tokens/s, 16 x 256")
    parser.add_argument("--eval_anchor", type=float, default=1.66, help="quiet seconds of its 32 x 256 eval batch")
    parser.add_argument("--skip_eval", action="store_true", help="time training steps only")
    args = parser.parse_args(argv)
    experiment, training = parse_args(["--config", args.config], ExperimentArguments)
    corpus = load_recipe_corpus(experiment)
    tokenizer = load_or_train_tokenizer(corpus["train"], experiment.vocab_size)
    heldout = heldout_token_ids(corpus["validation"], tokenizer, max(experiment.eval_lengths) + 1)
    docs, _ = select_documents(heldout, experiment.eval_lengths, experiment.eval_max_documents)
    vocab = len(tokenizer)
    torch.manual_seed(0)

    anchor_model = make_model("alibi", experiment, tokenizer, 256).train()
    anchor_optimizer = torch.optim.AdamW(anchor_model.parameters(), lr=1e-4)
    anchor_ids = torch.randint(0, vocab, (16, 256))  # (B, L): the quiet training measurement's shape
    eval_anchor_ids = torch.randint(0, vocab, (32, 256))  # (B, L): its evaluation batch (8192 tokens at 256)

    def train_anchor():
        train_step(anchor_model, anchor_optimizer, anchor_ids)

    def eval_anchor():
        eval_forward(anchor_model, eval_anchor_ids)

    def quiet_train(work) -> float:
        here, anchor = fastest_pair(work, train_anchor, args.steps)
        return here * (16 * 256 / args.anchor) / anchor

    def quiet_eval(work) -> float:
        here, anchor = fastest_pair(work, eval_anchor, 1)
        return here * args.eval_anchor / anchor

    total = 0.0
    for name, (encoding, length) in experiment.model_specs().items():
        model = make_model(encoding, experiment, tokenizer, length).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        batch = batch_size_at(experiment, training, length)
        ids = torch.randint(0, vocab, (batch, length))  # (B, L)
        step = quiet_train(lambda: train_step(model, optimizer, ids))
        train = step * training.max_steps
        model.eval()
        evaluate = 0.0
        for eval_length in [] if args.skip_eval else experiment.eval_lengths:
            per_batch = max(1, experiment.eval_batch_tokens // eval_length)
            batches = evaluation_batches(docs, eval_length, per_batch, experiment.eval_stride, experiment.eval_sliding)
            eval_ids = torch.randint(0, vocab, (per_batch, eval_length))  # (B, L)
            evaluate += batches * quiet_eval(lambda: eval_forward(model, eval_ids))
        window = 0.0
        if encoding == "alibi" and not args.skip_eval:
            chunks = sum(doc.numel() // experiment.window_length for doc in heldout)
            window_ids = torch.randint(0, vocab, (1, experiment.window_length))  # (1, L)
            forward = quiet_eval(lambda: eval_forward(model, window_ids, output_attentions=True))
            window = min(8, chunks) * forward
        seconds = train + evaluate + window
        total += seconds
        print(f"{name:>20}: batch {batch:3d} x {length:5d}, {batch * length / step:6.0f} tokens/s; "
              f"train {train:5.0f} s, evaluate {evaluate:4.0f} s, window {window:3.0f} s; {seconds / 60:5.1f} min",
              flush=True)  # fmt: skip
        del model, optimizer
    print(f"total on a quiet machine: {total / 60:.1f} min, plus about a minute of data preparation and overhead")


if __name__ == "__main__":
    main()
