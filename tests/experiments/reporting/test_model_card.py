"""hf_alibi.experiments.reporting.model_card: the card's metadata carries the measured perplexities and survives ModelCard.load."""

import math
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import GPT2Config, GPT2LMHeadModel

from hf_alibi.experiments.length.length_eval import evaluate_model
from hf_alibi.experiments.reporting import model_card
from hf_alibi.experiments.reporting.model_card import find_template, render_card, save_card
from hf_alibi.experiments.reporting.results import write_results

LENGTHS = [8, 16, 32]


@pytest.fixture(scope="module")
def evaluations():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: thread hand-off on two busy cores costs more than the work
    try:
        torch.manual_seed(0)
        docs = [torch.randint(0, 50, (n,)) for n in (70, 101)]
        found = {}
        for name, positions in (("alibi-tiny", 64), ("sinusoidal", 16)):
            config = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=positions)
            found[name] = evaluate_model(GPT2LMHeadModel(config), docs, LENGTHS, name=name, train_length=8)
        return found
    finally:
        torch.set_num_threads(threads)


def metric_values(card: ModelCard) -> dict[str, float]:
    return {result.metric_config: result.metric_value for result in card.data.eval_results}


def test_card_metadata_holds_perplexity_per_length(evaluations):
    evaluation = evaluations["alibi-tiny"]
    card = render_card(evaluation, model_name="alibi-tiny", repo_id="someone/alibi-tiny", training={"steps": 3})
    data = card.data.to_dict()
    assert data["license"] == "apache-2.0" and data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation" and "alibi" in data["tags"] and data["metrics"] == ["perplexity"]
    values = metric_values(card)
    for r in evaluation.lengths:
        assert values[f"nonoverlapping-{r.length}"] == r.ppl_nonoverlapping
        assert values[f"sliding-{r.length}"] == r.ppl_sliding
    assert {result.metric_type for result in card.data.eval_results} == {"perplexity"}
    assert 'from_pretrained("someone/alibi-tiny", trust_remote_code=True)' in card.text
    assert "import hf_alibi" in card.text and "- steps: 3" in card.text


def test_card_table_adds_baselines_with_na_but_model_index_only_this_model(evaluations):
    card = render_card(
        evaluations["alibi-tiny"], model_name="alibi-tiny", compare_with={"sinusoidal": evaluations["sinusoidal"]}
    )
    sinusoidal_row = next(line for line in card.text.splitlines() if line.startswith("| sinusoidal"))
    assert sinusoidal_row.rstrip(" |").endswith("n/a")
    assert card.data.to_dict()["model-index"][0]["name"] == "alibi-tiny"
    assert len(card.data.eval_results) == 2 * len(LENGTHS)


def test_saved_card_loads_back_with_its_plot_and_numbers(evaluations, tmp_path):
    paths = write_results(tmp_path / "eval", evaluations)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    readme = save_card(checkpoint, evaluations["alibi-tiny"], plot_path=paths["plot"], model_name="alibi-tiny")
    assert readme == checkpoint / "README.md"
    assert (checkpoint / "perplexity_vs_length.png").read_bytes() == paths["plot"].read_bytes()
    assert not list(checkpoint.glob("*.tmp"))
    card = ModelCard.load(readme)
    assert "](perplexity_vs_length.png)" in card.text  # relative: the plot ships in the folder
    for r in evaluations["alibi-tiny"].lengths:
        assert math.isclose(metric_values(card)[f"nonoverlapping-{r.length}"], r.ppl_nonoverlapping, rel_tol=1e-12)


def test_template_ships_in_the_package_and_a_missing_one_fails_with_a_clear_error(evaluations, tmp_path):
    assert find_template() == Path(model_card.__file__).resolve().parent / "templates" / "alibi_gpt2.md"  # package data
    with pytest.raises(FileNotFoundError, match="model card template not found at .*template_path="):
        render_card(evaluations["alibi-tiny"], model_name="x", template_path=tmp_path / "missing.md")


def test_card_of_a_model_with_no_measured_length_is_refused(evaluations):
    short_only = evaluations["sinusoidal"]
    short_only = type(short_only)(
        model="s",
        train_length=8,
        max_length=16,
        selection=short_only.selection,
        lengths=[r for r in short_only.lengths if r.unsupported],
    )
    with pytest.raises(ValueError, match="no measured length"):
        render_card(short_only, model_name="s")


def test_card_of_a_fine_tuned_model_names_its_base_and_says_when_the_licence_is_unknown(evaluations):
    card = render_card(evaluations["alibi-tiny"], model_name="alibi-tiny", base_model="org/source")
    assert card.data.base_model == "org/source"
    assert (card.data.license, card.data.license_name) == ("other", "unknown")  # never this project's apache-2.0
    assert "licence:\nunknown" in card.text
    card = render_card(
        evaluations["alibi-tiny"],
        model_name="alibi-tiny",
        base_model="org/source",
        source_license={"license": "openrail"},
    )
    assert card.data.license == "openrail" and "`openrail`" in card.text
    assert render_card(evaluations["alibi-tiny"], model_name="alibi-tiny").data.license == "apache-2.0"


def test_training_arguments_print_as_given(evaluations):
    card = render_card(evaluations["alibi-tiny"], model_name="t", training={"warmup_steps": 0.0, "lr": 0.0003})
    assert "- warmup_steps: 0\n" in card.text and "- lr: 0.0003" in card.text
