"""The recipe fine-tunes any checkpoint `hf_alibi.convert` imports (here a BLOOM), not only GPT-2."""

import pytest
import torch
from huggingface_hub import ModelCard
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM, PreTrainedTokenizerFast

from hf_alibi import AlibiGPT2LMHeadModel, convert
from hf_alibi.experiments.setup.arguments import ExperimentArguments, apply_smoke, parse_args
from hf_alibi.experiments.training.runner import run_experiment

SMOKE_YAML = "smoke"  # the shipped config, by name


@pytest.fixture
def bloom_folder(tmp_path):
    """A tiny BLOOM checkpoint with a real byte-level BPE tokenizer, as a Hub BLOOM folder has."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["def f(x):\n    return x + 1\n", "import os, sys\n"] * 30,
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    bloom = BloomForCausalLM(
        BloomConfig(vocab_size=320, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    )
    folder = tmp_path / "bloom"
    bloom.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: bigscience-bloom-rail-1.0\n---\n# a tiny BLOOM\n")
    return folder


@pytest.mark.slow
def test_recipe_fine_tunes_an_imported_bloom_with_its_own_tokenizer_and_a_true_card(bloom_folder, tmp_path):
    experiment, training = parse_args(
        [
            "--config",
            SMOKE_YAML,
            "--output_dir",
            str(tmp_path / "run"),
            "--models",
            "alibi",
            "--init_from",
            str(bloom_folder),
        ],
        ExperimentArguments,
    )
    apply_smoke(experiment, training)
    training.warmup_steps = 0.0  # what argparse makes of "--warmup_steps 0"
    evaluations = run_experiment(experiment, training)
    assert set(evaluations) == {"alibi"}
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "alibi" / "final")
    start = convert(str(bloom_folder))
    assert type(tuned) is AlibiGPT2LMHeadModel and tuned.config.embedding_layernorm  # BLOOM's architecture kept
    torch.testing.assert_close(tuned.transformer.alibi_slopes, start.transformer.alibi_slopes, atol=0, rtol=0)
    assert not torch.equal(tuned.transformer.wte.weight, start.transformer.wte.weight)  # it was trained
    assert (tmp_path / "run" / "alibi" / "final" / "tokenizer.json").exists()
    card = ModelCard.load(tmp_path / "run" / "alibi" / "final" / "README.md")
    assert card.data.base_model == "bloom" and card.data.license == "bigscience-bloom-rail-1.0"
    assert str(tmp_path) not in str(card.data.to_dict())
    for line in ("- n_embd: 32", "- n_layer: 2", "- n_head: 4", "- vocab_size: 320", "- warmup_steps: 0\n"):
        assert line in card.text, line  # the model's own architecture, not the recipe's sizes; arguments as given
    assert "under the source's licence:\n`bigscience-bloom-rail-1.0`" in card.text


def test_old_init_from_gpt2_name_still_works_and_conflicts_are_refused(tmp_path):
    experiment, _ = parse_args(
        ["--output_dir", str(tmp_path), "--models", "alibi", "--init_from_gpt2", "gpt2"], ExperimentArguments
    )
    assert experiment.init_from == "gpt2"
    with pytest.raises(ValueError, match="init_from"):
        ExperimentArguments(models=["alibi"], init_from="a", init_from_gpt2="b")
    with pytest.raises(ValueError, match="init_from"):
        ExperimentArguments(models=["alibi", "learned"], init_from="a")
