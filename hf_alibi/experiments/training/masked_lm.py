"""Masked-LM training of the ALiBi encoder (`AlibiBertForMaskedLM`) on the recipe's corpus, with `transformers.Trainer`.

The recipe's data path as is (`recipe_data.prepare_data`: the offline Python-stdlib corpus by default, its cached
tokenizer, blocks of `train_length` tokens packed across documents), `DataCollatorForLanguageModeling` masking
`mlm_probability` of the tokens (BERT's 80/10/10), and the model saved atomically with its tokenizer to
`<output_dir>/final`. The byte-level tokenizer gets one more special token, `<|mask|>`. Launch it with
`python -m recipes.train_mlm --config mlm_demo` (the module docstring of `recipes/train_mlm.py`).
"""

import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments, set_seed

from ...atomic_files import replace_folder, write_text_atomically
from ...models.alibi.configuration_alibi_bert import AlibiBertConfig
from ...models.alibi.modeling_alibi_bert import AlibiBertForMaskedLM
from ..setup.arguments import ExperimentArguments
from .recipe_data import prepare_data

MASK_TOKEN = "<|mask|>"
MLM_PROBABILITY = 0.15  # BERT's


def masked_lm_model(experiment: ExperimentArguments, tokenizer) -> AlibiBertForMaskedLM:
    """A fresh encoder of the experiment's size: GLU MLP `4 * n_embd` wide (jina-embeddings-v2's ratio)."""
    config = AlibiBertConfig(
        vocab_size=len(tokenizer),
        hidden_size=experiment.n_embd,
        num_hidden_layers=experiment.n_layer,
        num_attention_heads=experiment.n_head,
        intermediate_size=4 * experiment.n_embd,
        hidden_dropout_prob=experiment.dropout,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=experiment.train_length,  # informational: the length it was trained at
    )
    return AlibiBertForMaskedLM(config)


def heldout_masked_loss(model, collator, heldout, length: int, blocks: int = 8) -> float:
    """Mean masked-LM loss over `blocks` held-out blocks of `length` tokens (the first of each long enough
    document), the collator's random masks drawn from a fixed seed."""
    docs = [doc[:length] for doc in heldout if doc.numel() >= length][:blocks]
    if not docs:
        raise ValueError(f"no held-out document has {length} tokens")
    torch.manual_seed(0)
    losses = []
    model.eval()
    with torch.inference_mode():
        for doc in docs:
            batch = collator([{"input_ids": doc.tolist()}])
            losses.append(model(**batch).loss.item())
    return sum(losses) / len(losses)


def train_masked_lm(experiment: ExperimentArguments, training: TrainingArguments) -> dict:
    """Train, save `<output_dir>/final` (model and tokenizer) atomically, write `results.json`; returns the facts."""
    state = PartialState()
    _, tokenizer, train_blocks, heldout = prepare_data(experiment, state)
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    blocks = train_blocks[experiment.train_length].remove_columns("labels")  # the collator makes the labels
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=MLM_PROBABILITY)
    set_seed(training.seed)
    model = masked_lm_model(experiment, tokenizer)
    trainer = Trainer(
        model=model, args=training, train_dataset=blocks, data_collator=collator, processing_class=tokenizer
    )
    result = trainer.train()
    output = Path(training.output_dir)
    staging = output / ".final.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    trainer.save_model(str(staging))  # model, config (with auto_map) and tokenizer
    replace_folder(staging, output / "final")
    losses = {n: heldout_masked_loss(model, collator, heldout, n) for n in experiment.eval_lengths}
    facts = {
        "steps": result.global_step,
        "train_loss": result.training_loss,
        "heldout_masked_loss": losses,
        "heldout_masked_perplexity": {n: math.exp(loss) for n, loss in losses.items()},
        "train_seconds": round(result.metrics.get("train_runtime", 0.0), 1),
        "experiment": {k: v for k, v in asdict(experiment).items() if not k.startswith("passkey")},
    }
    write_text_atomically(output / "results.json", json.dumps(facts, indent=1, default=str) + "\n")
    return facts


__all__ = ["MASK_TOKEN", "MLM_PROBABILITY", "heldout_masked_loss", "masked_lm_model", "train_masked_lm"]
