"""The recipe's code split by job (`training`, `recipe_data`, `publish`, `runner` the orchestration; `parsing` and
`token_budget` beside `arguments`): every name `runner` and `arguments` exported before the split still imports from
them, as the same object, for the benchmarks and users' scripts."""

import importlib

import pytest

# (name, the module that defines it now)
MOVED = [
    ("ExperimentArguments", "arguments"),
    ("apply_smoke", "token_budget"),
    ("make_model", "training"),
    ("train_one", "training"),
    ("measure_costs", "training"),
    ("model_training_args", "training"),
    ("StepClock", "training"),
    ("prepare_data", "recipe_data"),
    ("heldout_bytes_per_token", "recipe_data"),
    ("write_cards", "publish"),
    ("push_alibi_model", "publish"),
    ("fine_tuned_from", "publish"),
]


@pytest.mark.parametrize("name, home", MOVED)
def test_runner_still_exports_what_it_exported_before_the_split(name, home):
    runner = importlib.import_module("hf_alibi.experiments.runner")
    defined = importlib.import_module(f"hf_alibi.experiments.{home}")
    assert getattr(runner, name) is getattr(defined, name), f"runner.{name} is not {home}.{name}"
    assert name in runner.__all__, name



# Names `arguments` held before parsing and the token budget got modules of their own (benchmarks import them).
ARGUMENTS_MOVED = [
    ("parse_args", "parsing"),
    ("resolve_config", "parsing"),
    ("shipped_configs", "parsing"),
    ("ArgumentParser", "parsing"),
    ("CONFIGS_DIR", "parsing"),
    ("batch_size_at", "token_budget"),
    ("apply_smoke", "token_budget"),
    ("SMOKE_OVERRIDES", "token_budget"),
]


@pytest.mark.parametrize("name, home", ARGUMENTS_MOVED)
def test_arguments_still_exports_what_it_exported_before_the_split(name, home):
    arguments = importlib.import_module("hf_alibi.experiments.arguments")
    defined = importlib.import_module(f"hf_alibi.experiments.{home}")
    assert getattr(arguments, name) is getattr(defined, name), f"arguments.{name} is not {home}.{name}"
