"""The masked-LM recipe (`recipes/train_mlm.py`, `hf_alibi.experiments.training.masked_lm`) on a few steps: it trains an
`AlibiBertForMaskedLM` with BERT's 15% masking on the demo corpus and saves a folder the Auto classes load back."""

import json
import math

import pytest
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, DataCollatorForLanguageModeling

from hf_alibi.experiments.setup.arguments import ExperimentArguments, apply_smoke, parse_args
from hf_alibi.experiments.training.masked_lm import MASK_TOKEN, heldout_masked_loss, train_masked_lm


def test_mlm_demo_trains_a_few_steps_and_saves_a_loadable_masked_lm(tmp_path):
    experiment, training = parse_args(
        ["--config", "mlm_demo", "--output_dir", str(tmp_path / "run")], ExperimentArguments
    )
    apply_smoke(experiment, training)
    training.max_steps = 2  # the smoke budget's tiny model and data, two steps
    facts = train_masked_lm(experiment, training)
    final = tmp_path / "run" / "final"
    model = AutoModelForMaskedLM.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert type(model).__name__ == "AlibiBertForMaskedLM" and model.config.model_type == "alibi_bert"
    assert tokenizer.mask_token == MASK_TOKEN and model.config.vocab_size == len(tokenizer)
    assert facts["steps"] == 2 and json.loads((tmp_path / "run" / "results.json").read_text())["steps"] == 2
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    batch = collator([{"input_ids": list(range(3, 67))}])
    masked = batch["labels"] != -100
    assert bool(masked.any()) and bool((batch["input_ids"][masked] != batch["labels"][masked]).any())
    # held-out masked loss at every evaluation length, near log(V) after two steps (chance), a real number
    assert set(facts["heldout_masked_loss"]) == set(experiment.eval_lengths)
    assert all(0 < loss < 2 * math.log(len(tokenizer)) for loss in facts["heldout_masked_loss"].values())
    with pytest.raises(ValueError, match="no held-out document has 64 tokens"):
        heldout_masked_loss(model, collator, [torch.arange(3, 40)], 64)
