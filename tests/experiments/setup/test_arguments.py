"""The recipe's arguments, split by concern: one object with every field in its old order, every YAML key and flag
in both spellings, `--help` grouped by part, each part checking its own fields, and the deprecated `init_from_gpt2`
still working with a FutureWarning that names its user."""

import warnings
from dataclasses import asdict

import pytest

from hf_alibi.experiments.commands.budget_sweep import SweepArguments
from hf_alibi.experiments.setup.arguments import (
    ComparisonArguments,
    DataArguments,
    EvaluationArguments,
    ExperimentArguments,
    ModelArguments,
    RunArguments,
    parse_args,
    resolve_config,
    shipped_configs,
)
from hf_alibi.models.alibi.transformers_compat import TENSOR_PARALLEL_TRANSFORMERS, transformers_at_least

# The order results.md's "experiment:" line and results.json's metadata have always listed the fields in.
RECORDED_ORDER = [
    "models",
    "all_models",
    "train_length",
    "model_max_steps",
    "eval_factors",
    "eval_stride",
    "eval_max_documents",
    "eval_batch_tokens",
    "eval_sliding",
    "window_eps",
    "window_length",
    "cost_steps",
    "cost_warmup_steps",
    "dataset_name",
    "dataset_config",
    "data_files",
    "text_column",
    "heldout_fraction",
    "tokenizer_name",
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "dropout",
    "init_from",
    "init_from_gpt2",
    "tp_size",
    "fsdp_size",
    "max_train_documents",
    "max_train_blocks",
    "smoke",
    "retrieval",
    "passkey_share",
    "passkey_digits",
    "passkey_depths",
    "passkey_samples",
    "eval_arms",
    "kept_eps",
    "seeds",
    "copy_curve_steps",
]


def test_experiment_arguments_hold_every_part_s_fields_in_the_recorded_order():
    assert list(asdict(ExperimentArguments())) == RECORDED_ORDER
    from_parts = [name for part in ExperimentArguments.parts for name in asdict(part())]
    assert from_parts == RECORDED_ORDER  # each field defined once, in exactly one part


@pytest.mark.parametrize("config", shipped_configs())
def test_every_shipped_config_parses_into_the_split_arguments(config, tmp_path):
    types = (ExperimentArguments, SweepArguments) if config == "budget_sweep" else (ExperimentArguments,)
    argv = ["--config", config, "--output_dir", str(tmp_path), "--use_cpu", "true"]  # bf16 configs parse on CPU
    experiment, *_, training = parse_args(argv, *types)
    assert isinstance(experiment, ExperimentArguments) and training.output_dir == str(tmp_path)
    assert all(isinstance(experiment, part) for part in ExperimentArguments.parts)


def test_a_config_is_a_file_or_a_bare_shipped_name_never_a_missing_folder_mapped_to_package_data(tmp_path):
    shipped = resolve_config("cpu_demo")
    assert resolve_config("cpu_demo.yaml") == shipped
    assert shipped.parent.parts[-3:] == ("hf_alibi", "experiments", "configs")
    assert resolve_config(str(shipped)) == shipped  # an existing file: taken as given
    with pytest.raises(
        ValueError,
        match=r"'recipes/configs/cpu_demo.yaml': no such file \(folder 'recipes/configs' "
        r"does not exist\).*cpu_demo, cpu_demo_bpe8k",
    ):
        resolve_config("recipes/configs/cpu_demo.yaml")
    with pytest.raises(ValueError, match=r"no such file\. Shipped configs.*smoke"):  # the folder exists, the file not
        resolve_config(str(tmp_path / "cpu_demo.yaml"))
    with pytest.raises(ValueError, match="'no_such_config': no such file, and not a shipped config"):
        resolve_config("no_such_config")


def test_snake_and_kebab_spellings_of_an_option_parse_the_same(tmp_path):
    snake = [
        "--train_length",
        "64",
        "--eval_factors",
        "1",
        "2",
        "--no_eval_sliding",
        "--max_steps",
        "3",
        "--per_device_train_batch_size",
        "4",
    ]
    kebab = [option.replace("_", "-") for option in snake]
    parsed = [
        parse_args(["--config", "smoke", "--output_dir", str(tmp_path), *argv], ExperimentArguments)
        for argv in (snake, kebab)
    ]
    (experiment, training), (experiment_kebab, training_kebab) = parsed
    assert asdict(experiment) == asdict(experiment_kebab)
    assert experiment.train_length == 64 and experiment.eval_factors == [1, 2] and not experiment.eval_sliding
    assert (training.max_steps, training.per_device_train_batch_size) == (3, 4)
    assert (training_kebab.max_steps, training_kebab.per_device_train_batch_size) == (3, 4)


def test_help_lists_the_options_grouped_by_concern(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"], ExperimentArguments, prog="hf-alibi train")
    text = capsys.readouterr().out
    headings = [part._argument_group_name for part in ExperimentArguments.parts]
    positions = [text.index(f"\n{heading}:\n") for heading in headings]
    assert positions == sorted(positions), headings
    for part, start, end in zip(ExperimentArguments.parts, positions, [*positions[1:], len(text)]):
        for name in asdict(part()):
            assert f"--{name} " in text[start:end] or f"--{name}\n" in text[start:end], (part.__name__, name)


@pytest.mark.parametrize(
    "part, values, message",
    [
        (ComparisonArguments, {"models": ["alibi", "alibi"]}, "twice"),
        (ComparisonArguments, {"train_length": 0}, "train_length must be positive, got 0"),
        (ComparisonArguments, {"model_max_steps": ["nope:32000"]}, "entry 'nope:32000' is not MODEL=STEPS"),
        (ComparisonArguments, {"model_max_steps": ["nope=0"]}, "entry 'nope=0' is not MODEL=STEPS"),
        (ComparisonArguments, {"model_max_steps": ["rope=100"]}, "unknown model name 'rope'"),
        (ComparisonArguments, {"model_max_steps": ["nope=1", "nope=2"]}, "names 'nope' twice"),
        (EvaluationArguments, {"window_eps": 1.5}, "window_eps must be in \\(0, 1\\), got 1.5"),
        (EvaluationArguments, {"eval_factors": [1, 0]}, "eval_factors"),
        (RunArguments, {"tp_size": 0}, "tp_size must be a positive integer, got 0"),
        (ModelArguments, {"init_from": "a", "init_from_gpt2": "b"}, "init_from='a' and init_from_gpt2='b'"),
    ],
)
def test_each_part_refuses_a_bad_value_of_its_own_naming_it(part, values, message):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # init_from_gpt2's deprecation: another test's subject
        with pytest.raises(ValueError, match=message):
            part(**values)
        with pytest.raises(ValueError, match=message):
            ExperimentArguments(**values)


def test_checks_across_parts_are_made_by_the_whole():
    DataArguments(), EvaluationArguments(eval_stride=999), ModelArguments(init_from="gpt2")  # each fine alone
    with pytest.raises(ValueError, match=r"eval_stride must be in \[1, train_length=64\], got 999"):
        ExperimentArguments(train_length=64, eval_stride=999)
    with pytest.raises(ValueError, match="init_from fine-tunes one ALiBi model"):
        ExperimentArguments(init_from="gpt2")


@pytest.mark.skipif(
    not transformers_at_least(TENSOR_PARALLEL_TRANSFORMERS),
    reason=f"sharding needs transformers>={TENSOR_PARALLEL_TRANSFORMERS}; older ones refuse it in RunArguments first",
)
def test_sharding_a_baseline_is_refused_by_the_whole():
    RunArguments(fsdp_size=2)  # fine alone
    with pytest.raises(ValueError, match="fsdp_size=2 shard ALiBi models only"):
        ExperimentArguments(fsdp_size=2)


def test_init_from_gpt2_warns_that_it_is_deprecated_naming_the_caller_and_still_sets_init_from(tmp_path):
    with pytest.warns(FutureWarning, match="init_from_gpt2='gpt2' is deprecated.*use --init_from") as caught:
        experiment, _ = parse_args(
            ["--output_dir", str(tmp_path), "--models", "alibi", "--init_from_gpt2", "gpt2"], ExperimentArguments
        )
    assert experiment.init_from == "gpt2" and experiment.init_from_gpt2 == "gpt2"  # recorded as given
    assert [w.filename for w in caught] == [__file__]  # the line that used the old name, not hf_alibi's
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert ExperimentArguments(models=["alibi"], init_from="gpt2").init_from_gpt2 is None  # the new name: silent


@pytest.fixture
def transformers_5_23(monkeypatch):
    """The installed transformers as hf_alibi's version check sees it, faked to 5.23 (older than TP and FSDP2 need)."""
    import transformers
    from packaging.version import Version

    from hf_alibi import _transformers_compat

    monkeypatch.setattr(_transformers_compat, "TRANSFORMERS_VERSION", Version("5.23.0"))
    monkeypatch.setattr(transformers, "__version__", "5.23.0")


@pytest.mark.parametrize("size", ["tp_size", "fsdp_size"])
def test_sharding_on_a_transformers_older_than_5_24_is_refused_with_the_arguments(transformers_5_23, size):
    RunArguments()  # one process: nothing to refuse
    with pytest.raises(ImportError, match=rf"{size}=2.* needs transformers>=5\.24; this environment has 5\.23\.0"):
        ExperimentArguments(models=["alibi"], **{size: 2})


def test_hf_alibi_train_with_tp_size_on_an_old_transformers_prints_one_line_and_writes_nothing(
    transformers_5_23, tmp_path, capsys
):
    from hf_alibi.cli import main

    out = tmp_path / "run"
    assert main(["train", "--config", "smoke", "--models", "alibi", "--tp_size", "2", "--output_dir", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("hf-alibi: error: tp_size=2, fsdp_size=1") and error.count("\n") == 1, error
    assert "transformers>=5.24" in error and not out.exists()


def test_model_max_steps_gives_only_the_named_model_its_own_schedule_and_smoke_clears_it(tmp_path):
    from hf_alibi.experiments.setup.token_budget import apply_smoke
    from hf_alibi.experiments.training.train_model import model_training_args

    experiment, training = parse_args(
        ["--config", "retrieval", "--output_dir", str(tmp_path), "--model_max_steps", "nope=32000", "learned@128=5"],
        ExperimentArguments,
    )
    assert experiment.model_steps() == {"nope": 32000, "learned@128": 5}  # learned@128 is not trained: allowed
    steps = {name: model_training_args(name, experiment, training)[3].max_steps for name in experiment.models}
    assert steps == {name: 32000 if name == "nope" else training.max_steps for name in experiment.models}
    apply_smoke(experiment, training)
    assert experiment.model_max_steps == [] and model_training_args("nope", experiment, training)[3].max_steps == 8
