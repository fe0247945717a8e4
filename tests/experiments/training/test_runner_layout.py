"""The recipe's code split by job (`training.train_model`, `training.recipe_data`, `reporting.publish`, `training.runner`
the orchestration; `setup.parsing` and `setup.token_budget` beside `setup.arguments`): every name `runner` and `arguments` exported before the split still imports from
them, as the same object, for the benchmarks and users' scripts."""

import importlib

import pytest

# (name, the module that defines it now)
MOVED = [
    ("ExperimentArguments", "setup.arguments"),
    ("apply_smoke", "setup.token_budget"),
    ("make_model", "training.train_model"),
    ("train_one", "training.train_model"),
    ("measure_costs", "training.train_model"),
    ("model_training_args", "training.train_model"),
    ("StepClock", "training.train_model"),
    ("prepare_data", "training.recipe_data"),
    ("heldout_bytes_per_token", "training.recipe_data"),
    ("write_cards", "reporting.publish"),
    ("push_alibi_model", "reporting.publish"),
    ("fine_tuned_from", "reporting.publish"),
]


# Names `arguments` held before parsing and the token budget got modules of their own (benchmarks import them).
ARGUMENTS_MOVED = [
    ("parse_args", "setup.parsing"),
    ("resolve_config", "setup.parsing"),
    ("shipped_configs", "setup.parsing"),
    ("ArgumentParser", "setup.parsing"),
    ("CONFIGS_DIR", "setup.parsing"),
    ("batch_size_at", "setup.token_budget"),
    ("apply_smoke", "setup.token_budget"),
    ("SMOKE_OVERRIDES", "setup.token_budget"),
]


# Names that moved down a layer when the experiments got sub-packages (docs/contributing.md): (module, (name, home))
LATER_MOVES = [
    ("training.train_model", ("final_dir", "setup.launch")),
    ("reporting.results", ("bits_unit", "reporting.axes")),
    ("reporting.results", ("evaluated_lengths", "reporting.axes")),
    ("reporting.results", ("reference_train_length", "reporting.axes")),
    ("reporting.results", ("mixed_train_lengths", "reporting.axes")),
]


@pytest.mark.parametrize(
    "module, name, home",
    [("training.runner", *moved) for moved in MOVED]
    + [("setup.arguments", *moved) for moved in ARGUMENTS_MOVED]
    + [(module, *moved) for module, moved in LATER_MOVES],
)
def test_split_modules_still_export_what_they_exported_before_the_split(module, name, home):
    before = importlib.import_module(f"hf_alibi.experiments.{module}")
    defined = importlib.import_module(f"hf_alibi.experiments.{home}")
    assert getattr(before, name) is getattr(defined, name), f"{module}.{name} is not {home}.{name}"
    assert name in before.__all__, name
