"""Train short, test long, told whole: does a model use the longer context, or only survive it?

`hf-alibi train --config retrieval` runs `run_retrieval` (the YAML sets `retrieval: true`):

    HF_HUB_OFFLINE=1 hf-alibi train --config retrieval           # sized for <= 45 min on 2 quiet cores; results/retrieval
    HF_HUB_OFFLINE=1 hf-alibi train --config retrieval_smoke     # the whole pipeline in under a minute

Every model trains at `train_length` on the recipe's corpus with `passkey_share` of its blocks replaced by passkey
documents that fit in it (`passkey`), the same steps and tokens as the plain recipe. Each evaluation arm
(`eval_arms`: a trained model as it is, or with a training-free extension set through its config) is then measured
at every evaluation length on

- perplexity: nonoverlapping, on the same held-out tokens at every length (`length_eval`);
- passkey retrieval: `passkey_samples` probes per depth, exact match of the greedy digits, with a 95% Wilson interval;
- for ALiBi arms, the share of causal keys certified skipping drops at `kept_eps` on the probes (`kept_context`).

Layout of a run:

    <output_dir>/<model>/final/              the trained model (+ tokenizer)
    <output_dir>/<model>/evaluation.json     its training facts, written when it finished training (resume)
    <output_dir>/<model>/copy_curve.json     with `copy_curve_steps`: the copy's learning curve (copy_curve.py)
    <output_dir>/arms/<arm>.json             an arm's perplexity, retrieval and dropped keys (resume: kept)
    <output_dir>/results.{json,csv,md}, perplexity_vs_length.png, loss_by_position.png   perplexity of every arm
    <output_dir>/retrieval.{json,md}, retrieval_vs_length.png   perplexity and retrieval side by side, per arm
    <output_dir>/seed_<S>/                   with `seeds`: each seed's whole run as above; the top level pools them
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset, concatenate_datasets
from transformers import AutoModelForCausalLM

from ...atomic_files import write_text_atomically
from ..length.kept_context import dropped_fraction
from ..length.length_eval import evaluate_model, select_documents
from ..setup.baselines import max_supported_length, restore_position_encoding
from ..setup.eval_arms import arm_model, is_alibi, parse_arm
from ..setup.launch import check_process_group, output_dir_lock
from ..training.recipe_data import heldout_bytes_per_token, prepare_data
from ..training.runner import check_output_dir, run_metadata
from ..training.train_model import final_dir, train_one
from .copy_curve import CURVE_FILE, CopyCurve, read_curve
from .passkey import (
    PasskeyTemplate,
    filler_stream,
    passkey_blocks,
    probe_examples,
    score_examples,
    wilson_interval,
)
from .retrieval_results import write_retrieval
from .retrieval_seeds import pool_seeds, read_seed, seed_training, seeded_metadata

logger = logging.getLogger(__name__)


def run_retrieval(experiment, training, callbacks=None) -> dict[str, dict]:
    """Train every model with passkey documents, evaluate every arm, write the results (module docstring).
    Returns `{arm: record}` (on the main process; {} elsewhere)."""
    _ = training.device  # TrainingArguments sets up the process group first
    state = PartialState()
    check_process_group(state, use_cpu=training.use_cpu)
    with output_dir_lock(training.output_dir, state):
        if experiment.seeds:
            return _run_seeds(experiment, training, state, callbacks)
        return _run_locked(experiment, training, state, callbacks)


def _run_seeds(experiment, training, state, callbacks) -> dict[str, dict]:
    """Every seed's whole run in its own folder (a finished one read back), then the pooled results at the top
    (`retrieval_seeds`). Returns the pooled `{arm: record}` (on the main process; {} elsewhere)."""
    records, metadata = {}, {}
    for seed in experiment.seeds:
        finished = read_seed(training.output_dir, seed)
        if finished is None:
            _run_locked(experiment, seed_training(training, seed), state, callbacks)
            state.wait_for_everyone()
            finished = read_seed(training.output_dir, seed)
        records[seed], metadata[seed] = finished
    pooled = {}
    if state.is_main_process:
        pooled = pool_seeds(records)
        write_retrieval(Path(training.output_dir), pooled, seeded_metadata(metadata))
    state.wait_for_everyone()
    return pooled


def with_passkeys(blocks: Dataset, template: PasskeyTemplate, length: int, share: float, seed: int) -> Dataset:
    """`blocks` with passkey documents replacing `share` of them: each is built on a corpus block's own tokens
    (filler), so the training tokens per step and the corpus stay the recipe's."""
    count = round(share * len(blocks))
    if count == 0:
        return blocks
    rng = random.Random(f"passkey-blocks-{seed}")
    chosen = sorted(rng.sample(range(len(blocks)), count))
    fillers = blocks.select(chosen)["input_ids"]
    documents = passkey_blocks(fillers, template, length, seed)
    passkeys = Dataset.from_dict(
        {"input_ids": documents, "labels": [list(d) for d in documents]}, features=blocks.features
    )
    kept = blocks.select(sorted(set(range(len(blocks))) - set(chosen)))
    return concatenate_datasets([kept, passkeys])


def arms_of(experiment) -> dict[str, list[str]]:
    """`{model: [its arms]}`: `eval_arms`, or every model as it is."""
    arms = experiment.eval_arms or list(experiment.models)
    return {name: [arm for arm in arms if parse_arm(arm, experiment.models)[0] == name] for name in experiment.models}


def _run_locked(experiment, training, state, callbacks) -> dict[str, dict]:
    check_output_dir(experiment, training)
    corpus, tokenizer, train_blocks, heldout = prepare_data(experiment, state)
    template = PasskeyTemplate.from_tokenizer(tokenizer, experiment.passkey_digits)
    if template.overhead >= experiment.train_length:
        raise ValueError(
            f"train_length {experiment.train_length} leaves no filler around the passkey template's "
            f"{template.overhead} tokens: raise it"
        )
    train_blocks = {
        length: with_passkeys(blocks, template, length, experiment.passkey_share, training.seed)
        for length, blocks in train_blocks.items()
    }
    output_dir = Path(training.output_dir)
    metadata = run_metadata(experiment, training, state, corpus, train_blocks, heldout)
    metadata["load_average_at_start"] = os.getloadavg()
    probe = Probe(experiment, template, filler_stream(heldout, tokenizer.eos_token_id), heldout)
    if experiment.copy_curve_steps:  # the very probes of the 1x evaluation, step by step
        examples = probe.examples_at(experiment.train_length)
        callbacks = [*(callbacks or []), CopyCurve(examples, experiment.copy_curve_steps)]
    records: dict[str, dict] = {}
    for name, arms in arms_of(experiment).items():
        model, metadata[f"{name}_training"] = _trained(
            name, experiment, training, tokenizer, train_blocks, state, callbacks
        )
        if experiment.copy_curve_steps:
            metadata[f"{name}_copy_curve"] = read_curve(output_dir / name / CURVE_FILE)
        if state.is_main_process:
            for arm in arms:
                if model is None and not (output_dir / "arms" / f"{arm}.json").exists():
                    model = load_trained(output_dir, name)
                records[arm] = _arm_record(output_dir, arm, model, probe)
        state.wait_for_everyone()
        del model
    if state.is_main_process:
        metadata["load_average_at_end"] = os.getloadavg()
        metadata["bytes_per_token"] = heldout_bytes_per_token(heldout, tokenizer, experiment)  # bits per byte
        write_retrieval(output_dir, records, metadata)
    state.wait_for_everyone()
    return records if state.is_main_process else {}


def _trained(name, experiment, training, tokenizer, train_blocks, state, callbacks):
    """`(model or None, training facts)`: model `name` trained now, or None with the facts of an earlier run that
    finished training it (`<name>/evaluation.json`)."""
    record = Path(training.output_dir) / name / "evaluation.json"
    if record.exists():
        return None, json.loads(record.read_text())["training"]
    model, facts = train_one(name, experiment, training, tokenizer, train_blocks, state, callbacks)
    if state.is_main_process:
        write_text_atomically(record, json.dumps({"training": facts}, indent=2) + "\n")
    return model, facts


def _arm_record(output_dir: Path, arm: str, model, probe) -> dict:
    """Arm `arm`'s results: read back from `arms/<arm>.json`, else measured on `model` and saved there."""
    path = output_dir / "arms" / f"{arm}.json"
    if path.exists():
        return json.loads(path.read_text())
    record = probe.evaluate(model, arm)
    write_text_atomically(path, json.dumps(record, indent=2) + "\n")
    return record


def load_trained(output_dir: Path, name: str):
    """Model `name` of a retrieval run as `from_pretrained` gives it back (position encoding restored)."""
    model = AutoModelForCausalLM.from_pretrained(final_dir(output_dir, name))
    return restore_position_encoding(model).float().eval()


def experiment_probes(experiment, stream, template: PasskeyTemplate, length: int) -> list:
    """A run's passkey probes of `length` tokens cut from `stream`: `passkey_samples` per depth, the same every call."""
    return probe_examples(stream, template, length, experiment.passkey_depths, experiment.passkey_samples, seed=0)


class Probe:
    """Everything an arm is measured on, made once: the perplexity documents, the passkey examples per length."""

    def __init__(self, experiment, template: PasskeyTemplate, stream: torch.Tensor, heldout):
        self.experiment = experiment
        lengths = experiment.eval_lengths
        # every length scores the same tokens: selected once for the longest, then evaluated one length at a time
        self.documents, _ = select_documents(heldout, lengths, experiment.eval_max_documents)
        self.stream, self.template = stream, template
        self.examples = {length: self.examples_at(length) for length in lengths}

    def examples_at(self, length: int) -> list:
        """The passkey probes of `length` tokens (`experiment_probes`)."""
        return experiment_probes(self.experiment, self.stream, self.template, length)

    def evaluate(self, model, arm: str) -> dict:
        """One arm's perplexity, retrieval (and, for ALiBi, dropped keys) at every evaluation length."""
        experiment, train_length = self.experiment, self.experiment.train_length
        lengths, retrieval, dropped = [], {}, {}
        for length in experiment.eval_lengths:
            variant = arm_model(model, arm, train_length, length)
            evaluation = evaluate_model(
                variant,
                self.documents,
                [length],
                name=arm,
                train_length=train_length,
                batch_tokens=experiment.eval_batch_tokens,
                max_length=max_supported_length(variant),
                sliding=False,
            )
            lengths += evaluation.lengths
            if evaluation.lengths[0].unsupported:
                continue
            retrieval[str(length)] = self._retrieval(variant, length)  # str: the keys JSON gives back
            if is_alibi(variant):
                ids = torch.tensor(
                    [
                        self.examples[length][i * experiment.passkey_samples].input_ids
                        for i in range(len(experiment.passkey_depths))
                    ]
                )  # one probe per depth
                dropped[str(length)] = dropped_fraction(variant, ids, eps=experiment.kept_eps)
            logger.info(
                "%s at %d: perplexity %.3f, retrieval %s",
                arm,
                length,
                evaluation.lengths[0].ppl_nonoverlapping,
                retrieval[str(length)]["all"]["accuracy"],
            )
        evaluation.lengths = lengths
        return {"evaluation": evaluation.to_dict(), "retrieval": retrieval, "dropped": dropped}

    def _retrieval(self, model, length: int) -> dict:
        """`{depth or "all": {"correct", "n", "accuracy", "low", "high"}}` at `length`."""
        examples = self.examples[length]
        batch = max(1, self.experiment.eval_batch_tokens // length)
        correct = score_examples(model, examples, batch_size=batch)
        cells = {}
        for depth in [*self.experiment.passkey_depths, "all"]:
            hits = [c for c, e in zip(correct, examples) if depth == "all" or e.depth == depth]
            low, high = wilson_interval(sum(hits), len(hits))
            cells[str(depth)] = {
                "correct": sum(hits),
                "n": len(hits),
                "accuracy": sum(hits) / len(hits),
                "low": low,
                "high": high,
            }
        return cells


__all__ = ["Probe", "arms_of", "experiment_probes", "load_trained", "run_retrieval", "with_passkeys"]
