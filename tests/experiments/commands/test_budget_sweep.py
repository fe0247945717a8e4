"""The budget sweep: each budget a whole experiment in its own folder, the 16L/L ratio per model and budget in one
table, figure and JSON; bad budgets refused; the recipe end to end on the smoke budget."""

import json

import pytest
from transformers import TrainingArguments

from hf_alibi.experiments.commands.budget_sweep import SweepArguments, budget_training_args, position_use, write_sweep


def test_position_use_is_the_longest_over_the_training_length_perplexity(make_evaluation):
    row = position_use(make_evaluation("learned", {128: 8.0, 256: 12.0, 2048: 18.0}, train_length=128), 4096)
    assert row == {
        "train_tokens": 4096,
        "train_length": 128,
        "longest": 2048,
        "ppl_train_length": 8.0,
        "ppl_longest": 18.0,
        "ratio": 2.25,
    }


def test_sweep_table_and_figure_hold_every_budget_and_model(make_evaluation, tmp_path):
    table = {
        b: {
            n: position_use(make_evaluation(n, {128: 8.0, 2048: 8.0 * r}, 128), b * 4096)
            for n, r in (("alibi", 0.99), ("learned", 1.0 + b / 100))
        }
        for b in (60, 500)
    }
    write_sweep(tmp_path, table)
    markdown = (tmp_path / "budget_sweep.md").read_text()
    assert "| Model | 60 steps (0.25M tokens) | 500 steps (2.05M tokens) |" in markdown
    assert "| learned | 8.00 -> 12.80 (**1.60x**) | 8.00 -> 48.00 (**6.00x**) |" in markdown
    assert "at 2048 tokens (16x)" in markdown
    assert json.loads((tmp_path / "budget_sweep.json").read_text())["500"]["alibi"]["ratio"] == pytest.approx(0.99)
    assert (tmp_path / "budget_sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("budgets", [[], [0, 10], [10, 10]])
def test_bad_budgets_are_refused_naming_them(budgets):
    with pytest.raises(ValueError, match="budgets must be distinct positive"):
        SweepArguments(budgets=budgets)


def test_each_budget_trains_in_its_own_folder_with_its_own_steps(tmp_path):
    training = TrainingArguments(output_dir=str(tmp_path / "sweep"), max_steps=7, warmup_steps=0.05, report_to="none")
    args = budget_training_args(training, 180)
    assert args.max_steps == 180 and args.output_dir == str(tmp_path / "sweep" / "steps_180")
    assert args.get_warmup_steps(180) == 9, "a fractional warm-up scales with the budget"


@pytest.mark.slow
def test_budget_sweep_recipe_on_the_smoke_budget_writes_its_table(tmp_path):
    from hf_alibi.experiments.commands.budget_sweep import main

    out = tmp_path / "sweep"
    main(["--config", "budget_sweep", "--smoke", "--budgets", "2", "3", "--output_dir", str(out)])
    table = json.loads((out / "budget_sweep.json").read_text())
    assert list(table) == ["2", "3"]
    for budget, rows in table.items():
        assert set(rows) == {"alibi", "learned", "sinusoidal", "rotary"}, budget
        assert (out / f"steps_{budget}" / "results.json").exists()
        for name, row in rows.items():
            assert row["ratio"] == pytest.approx(row["ppl_longest"] / row["ppl_train_length"]), name
    assert "| alibi |" in (out / "budget_sweep.md").read_text()
