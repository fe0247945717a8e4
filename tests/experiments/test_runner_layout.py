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


@pytest.mark.parametrize(
    "module, name, home", [("runner", *moved) for moved in MOVED] + [("arguments", *moved) for moved in ARGUMENTS_MOVED]
)
def test_split_modules_still_export_what_they_exported_before_the_split(module, name, home):
    before = importlib.import_module(f"hf_alibi.experiments.{module}")
    defined = importlib.import_module(f"hf_alibi.experiments.{home}")
    assert getattr(before, name) is getattr(defined, name), f"{module}.{name} is not {home}.{name}"
    assert name in before.__all__, name
