"""The recipe's code split by job (`training`, `recipe_data`, `publish`, `runner` the orchestration): every name the
runner exported before the split still imports from it, as the same object, for the benchmarks and users' scripts."""

import importlib

import pytest

# (name, the module that defines it now)
MOVED = [
    ("ExperimentArguments", "arguments"),
    ("apply_smoke", "arguments"),
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

