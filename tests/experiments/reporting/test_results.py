"""hf_alibi.experiments.reporting.results: the files a person reads agree with results.json; writes are atomic; the recipe writes them."""

import csv
import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from hf_alibi.atomic_files import write_file_atomically
from hf_alibi.experiments.length.length_eval import evaluate_model
from hf_alibi.experiments.reporting import results as results_module
from hf_alibi.experiments.reporting.results import format_summary, load_results, write_results

LENGTHS = [8, 16, 32]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: thread hand-off on two busy cores costs more than the work
    yield
    torch.set_num_threads(threads)


def tiny_gpt2(n_positions: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=n_positions, bos_token_id=0, eos_token_id=0
    )
    return GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def evaluations():
    """Two models on the same documents: one runs every length, one stops at its 16-position table."""
    torch.manual_seed(1)
    docs = [torch.randint(0, 50, (n,)) for n in (70, 101)]
    return {
        "long": evaluate_model(tiny_gpt2(64), docs, LENGTHS, name="long", train_length=8),
        "short": evaluate_model(tiny_gpt2(16), docs, LENGTHS, name="short", train_length=8),
    }


@pytest.fixture(scope="module")
def written(evaluations, tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    return out, write_results(out, evaluations, metadata={"train_length": 8, "seed": 0, "steps": 3})


def test_write_results_creates_every_file_and_leaves_no_tmp(written):
    out, paths = written
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in paths.values())
    assert not list(out.glob("*.tmp"))


def test_results_json_holds_everything_and_loads_back(written, evaluations):
    out, paths = written
    payload = json.loads(paths["json"].read_text())
    assert payload["metadata"] == {"train_length": 8, "seed": 0, "steps": 3}
    loaded, metadata = load_results(out)
    assert loaded == evaluations and metadata["steps"] == 3


def test_csv_rows_match_json(written):
    _, paths = written
    models = json.loads(paths["json"].read_text())["models"]
    rows = list(csv.DictReader(paths["csv"].open()))
    assert len(rows) == sum(len(m["lengths"]) for m in models.values())
    for row in rows:
        expected = next(r for r in models[row["model"]]["lengths"] if r["length"] == int(row["length"]))
        for key in ("ppl_nonoverlapping", "ppl_sliding"):
            assert (float(row[key]) if row[key] else None) == expected[key], (row, key)
        assert int(row["tokens_nonoverlapping"]) == expected["tokens_nonoverlapping"]
        assert (row["unsupported"] or None) == expected["unsupported"]


def test_markdown_table_matches_json_and_marks_unsupported_as_na(written):
    _, paths = written
    models = json.loads(paths["json"].read_text())["models"]
    markdown = paths["markdown"].read_text()
    table = markdown.split("## Nonoverlapping windows")[1].split("##")[0]
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in table.splitlines()
        if line.startswith("| long") or line.startswith("| short")
    }
    header = next(line for line in table.splitlines() if line.startswith("| Model"))
    assert "8 (1x, train)" in header and "32 (4x)" in header
    for name, cells in rows.items():
        for cell, r in zip(cells, models[name]["lengths"]):
            assert cell == ("n/a" if r["unsupported"] else f"{r['ppl_nonoverlapping']:.2f}"), (name, r["length"])
    assert rows["short"][-1] == "n/a" and "exceeds position table of 16" in markdown


def test_plots_are_valid_png_images(written):
    from PIL import Image

    _, paths = written
    for key in ("plot", "position_plot"):
        assert paths[key].read_bytes()[:8] == PNG_MAGIC
        with Image.open(paths[key]) as image:
            image.verify()
            assert image.size[0] > 500 and image.size[1] > 300


def test_failed_write_keeps_the_old_file_and_leaves_no_tmp(tmp_path, monkeypatch):
    target = tmp_path / "results.md"
    results_module.atomic_write_text(target, "old")

    class Boom(Exception):
        pass

    def fail(f):
        f.write(b"half")
        raise Boom

    with pytest.raises(Boom):
        write_file_atomically(target, fail)
    assert target.read_text() == "old" and not list(tmp_path.glob("*.tmp"))


def test_summary_lists_every_model_and_length(evaluations):
    summary = format_summary(evaluations, "somewhere")
    assert "long" in summary and "short" in summary and "n/a / n/a" in summary
    assert all(f"{length} (" in summary for length in LENGTHS) and summary.endswith("results written to somewhere")
    long_16 = evaluations["long"].by_length()[16]
    assert f"{long_16.ppl_nonoverlapping:.2f} / {long_16.ppl_sliding:.2f}" in summary


def word_tokenizer(texts) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")


@pytest.mark.slow
def test_evaluate_length_recipe_writes_results_for_a_saved_checkpoint(tmp_path, capsys):
    from recipes.evaluate_length import main

    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(60 + 10 * i)) for i in range(6)]
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    checkpoint = tmp_path / "tiny"
    tokenizer = word_tokenizer(texts)
    tokenizer.save_pretrained(checkpoint)
    model = tiny_gpt2(16)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(checkpoint)
    out = tmp_path / "eval"
    main(
        [
            "--model",
            str(checkpoint),
            "--data_files",
            str(tmp_path / "doc*.txt"),
            "--heldout_fraction",
            "0.99",
            "--train_length",
            "8",
            "--length_factors",
            "1",
            "2",
            "4",
            "--output_dir",
            str(out),
        ]
    )
    loaded, metadata = load_results(out)
    result = loaded["tiny"].by_length()
    assert result[8].ppl_nonoverlapping > 1 and result[16].ppl_sliding > 1
    assert result[32].unsupported == "unsupported: exceeds position table of 16"
    assert metadata["lengths"] == [8, 16, 32] and metadata["corpus_fingerprint"]["tiny"]
    assert (out / "perplexity_vs_length.png").is_file() and not list(out.glob("*.tmp"))
    assert "results written to" in capsys.readouterr().out


def test_models_trained_at_several_lengths_keep_their_own_length_in_every_file(tmp_path):
    torch.manual_seed(1)
    docs = [torch.randint(0, 50, (n,)) for n in (70, 101)]
    mixed = {
        "long@8": evaluate_model(tiny_gpt2(64), docs, LENGTHS, name="long@8", train_length=8),
        "long@16": evaluate_model(tiny_gpt2(64), docs, LENGTHS, name="long@16", train_length=16),
    }
    facts = {
        "train_length": 16,
        "per_device_train_batch_size": 2,
        "train_tokens": 96,
        "train_tokens_per_second": 1e3,
        "peak_memory_mib": 12.0,
        "train_seconds": 0.1,
    }
    paths = write_results(tmp_path, mixed, metadata={"long@16_training": facts})
    rows = list(csv.DictReader(paths["csv"].open()))
    assert {(row["model"], row["train_length"]) for row in rows} == {("long@8", "8"), ("long@16", "16")}
    factors = {(row["model"], row["length"]): float(row["factor"]) for row in rows}
    assert factors[("long@16", "32")] == 2.0 and factors[("long@8", "32")] == 4.0  # relative to each own length
    markdown = paths["markdown"].read_text()
    assert "long@8 at 8, long@16 at 16" in markdown and "(1x, train)" not in markdown  # no single "train" column
    # the cost row of the model with facts; without an interleaved measurement, the run's own clock, marked so
    assert "| long@16 | 16 | 2 | 96 | 1,000 (run clock) | - | - | 12 | 0.1 |" in markdown
    loaded, _ = load_results(tmp_path)
    assert {name: ev.train_length for name, ev in loaded.items()} == {"long@8": 8, "long@16": 16}
    assert paths["plot"].read_bytes().startswith(PNG_MAGIC)


def test_a_smoke_run_says_so_in_its_table_and_on_every_plot_and_a_real_run_does_not(evaluations, tmp_path, monkeypatch):
    """Untrained tiny models on auto-scaled axes look like results: a smoke run's files carry `run_caveat`."""
    from hf_alibi.experiments.reporting import plots

    titles = {}
    save = plots.save_figure

    def recording(figure, path):  # records each figure's title as written, then writes it
        titles[Path(path).name] = figure.get_suptitle()
        return save(figure, path)

    monkeypatch.setattr(plots, "save_figure", recording)
    smoke = {"experiment": {"smoke": True}, "training": {"max_steps": 8}}
    for kind, metadata in (("smoke", smoke), ("real", {"experiment": {"smoke": False}, "training": {"max_steps": 8}})):
        paths = write_results(tmp_path / kind, evaluations, metadata=metadata)
        markdown = paths["markdown"].read_text()
        caveat = "SMOKE RUN: tiny models trained 8 steps, a check of the pipeline, not results"
        if kind == "smoke":
            assert markdown.startswith("# Perplexity vs evaluation length (smoke run)\n\n> **" + caveat), markdown
            assert all(caveat in titles[name] for name in ("perplexity_vs_length.png", "loss_by_position.png")), titles
        else:
            assert "SMOKE" not in markdown and not any("SMOKE" in title for title in titles.values()), titles
        titles.clear()
