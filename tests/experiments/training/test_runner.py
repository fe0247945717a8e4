"""The train-short/test-long recipe end to end on its smoke budget: results, cards, resume, bad configs, Hub upload."""

import json
import sys
from pathlib import Path

import pytest
from transformers import TrainerCallback

from hf_alibi.experiments.setup.arguments import ExperimentArguments, apply_smoke, parse_args
from hf_alibi.experiments.setup.launch import LOCK_FILE
from hf_alibi.experiments.training.runner import run_experiment

REPO = Path(__file__).resolve().parents[3]
SMOKE_YAML = "smoke"  # the shipped config, by name


def _args(tmp_path, *extra):
    experiment, training = parse_args(
        ["--config", SMOKE_YAML, "--output_dir", str(tmp_path / "run"), *extra], ExperimentArguments
    )
    apply_smoke(experiment, training)
    return experiment, training


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke run of smoke.yaml's models (one at twice the training length), shared by the checks below."""
    tmp_path = tmp_path_factory.mktemp("smoke")
    experiment, training = _args(tmp_path)
    evaluations = run_experiment(experiment, training)
    return Path(training.output_dir), evaluations, experiment


@pytest.mark.slow
def test_smoke_run_writes_every_result_file_and_no_temporaries(smoke_run):
    output_dir, evaluations, experiment = smoke_run
    assert set(evaluations) == {"alibi", "learned", "sinusoidal", "rotary", "learned@64"}
    for name in (
        "results.json",
        "results.csv",
        "results.md",
        "perplexity_vs_length.png",
        "loss_by_position.png",
        "effective_window.json",
        "effective_window.png",
    ):
        assert (output_dir / name).stat().st_size > 0, name
    assert not list(output_dir.rglob("*.tmp")), "a temporary file was left behind"
    payload = json.loads((output_dir / "results.json").read_text())
    assert payload["metadata"]["corpus_fingerprint"], "the corpus hash must be recorded with the results"
    assert "(smoke run)" in (output_dir / "results.md").read_text().splitlines()[0], "a smoke run must say so"
    for name, evaluation in evaluations.items():
        lengths = [r.length for r in evaluation.lengths]
        assert lengths == experiment.eval_lengths, name
        for result in evaluation.lengths:
            assert result.unsupported is None and result.ppl_nonoverlapping > 1, (name, result)


@pytest.mark.slow
def test_smoke_run_saves_loadable_models_with_a_card_for_alibi(smoke_run):
    from transformers import AutoModelForCausalLM

    output_dir, evaluations, _ = smoke_run
    final = output_dir / "alibi" / "final"
    card = (final / "README.md").read_text()
    assert "model-index" in card and "perplexity_vs_length.png" in card
    assert "SMOKE RUN: tiny models trained 8 steps" in card, "a smoke model's card must say what it is"
    assert (final / "perplexity_vs_length.png").exists()
    assert (final / "modeling_alibi_gpt2.py").exists() and (final / "tokenizer.json").exists()
    assert (final / "alibi_bias.png").exists() and "alibi_bias.png" in card
    assert (final / "effective_window.png").exists() and "Effective attention window, measured" in card
    for name in evaluations:
        model = AutoModelForCausalLM.from_pretrained(output_dir / name / "final")
        assert model.config.train_length == (64 if name == "learned@64" else 32), name


@pytest.mark.slow
def test_models_at_twice_the_length_see_the_same_tokens_and_report_their_cost(smoke_run):
    output_dir, evaluations, experiment = smoke_run
    facts = {name: json.loads((output_dir / name / "evaluation.json").read_text())["training"] for name in evaluations}
    assert facts["learned@64"]["per_device_train_batch_size"] * 2 == facts["learned"]["per_device_train_batch_size"]
    assert len({f["train_tokens"] for f in facts.values()}) == 1, facts
    for name, f in facts.items():
        assert f["train_tokens_per_second"] > 0 and f["peak_memory_mib"] is not None, (name, f)
    assert evaluations["learned@64"].train_length == 64
    markdown = (output_dir / "results.md").read_text()
    assert "## Training cost" in markdown and "| learned@64 | 64 | 4 |" in markdown
    metadata = json.loads((output_dir / "results.json").read_text())["metadata"]
    for name, f in facts.items():  # the run's own clock, and every model timed again the same way
        assert f["step_seconds_median"] > 0 and f["step_seconds_mean"] > 0 and f["seconds_outside_steps"] >= 0, name
        cost = metadata[f"{name}_cost"]
        assert len(cost["step_seconds"]) == experiment.cost_steps, name
        assert cost["tokens_per_step"] == f["per_device_train_batch_size"] * f["train_length"], name
    assert "interleaved" in markdown and "Bits per byte" in markdown
    assert metadata["bytes_per_token"] > 1  # the smoke's 512-token BPE: several bytes a token
    window = json.loads((output_dir / "effective_window.json").read_text())["alibi"]
    assert window["length"] == experiment.window_length and len(window["measured"]) == experiment.n_layer


@pytest.mark.slow
def test_finished_run_is_not_overwritten_without_resume(smoke_run):
    output_dir, _, _ = smoke_run
    experiment, training = parse_args(["--config", SMOKE_YAML, "--output_dir", str(output_dir)], ExperimentArguments)
    apply_smoke(experiment, training)
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        run_experiment(experiment, training)


class _Interrupt(TrainerCallback):
    """Stops model `model`'s training like a killed job: after step `at`, with the checkpoint of step `at - 2` on
    disk (the models before it finished)."""

    def __init__(self, at, model):
        self.at = at
        self.model = model

    def on_step_end(self, args, state, control, **kwargs):
        if Path(args.output_dir).name == self.model and state.global_step == self.at:
            raise KeyboardInterrupt


@pytest.mark.slow
def test_interrupted_run_rerun_as_it_was_started_resumes_past_its_stale_lock_and_ends_like_an_uninterrupted_one(
    tmp_path, capsys
):
    """What an interrupted `make demo` does when run again: no flag to add (make cannot pass one); the finished model
    is kept, the interrupted one resumes from its checkpoint, and the results equal an uninterrupted run's."""
    models = ("--models", "alibi", "learned")
    straight_exp, straight_train = _args(tmp_path / "straight", *models)
    straight = run_experiment(straight_exp, straight_train)

    exp, train = _args(tmp_path / "interrupted", *models)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(exp, train, callbacks=[_Interrupt(at=6, model="learned")])
    output_dir = Path(train.output_dir)
    assert (output_dir / "learned" / "checkpoint-4").is_dir() and not (output_dir / "learned" / "final").exists()
    finished_before = (output_dir / "alibi" / "evaluation.json").read_text()
    lock = output_dir / LOCK_FILE
    assert not lock.exists(), "the interrupted run must release its output folder"
    lock.write_text(json.dumps({"pid": -1, "host": "killed-run"}))  # what a SIGKILLed run leaves: file, no flock

    capsys.readouterr()
    exp, train = _args(tmp_path / "interrupted", *models)  # the same command again
    resumed = run_experiment(exp, train)
    printed = capsys.readouterr().out
    assert f"{output_dir}: resuming the interrupted run of the same arguments" in printed, printed
    assert "alibi: finished earlier, kept" in printed and "learned: resumes from checkpoint-4" in printed, printed
    assert (output_dir / "alibi" / "evaluation.json").read_text() == finished_before, "a finished model was redone"
    for name in ("alibi", "learned"):
        facts = [
            json.loads((Path(t.output_dir) / name / "evaluation.json").read_text())["training"]
            for t in (straight_train, train)
        ]
        assert facts[0]["steps"] == facts[1]["steps"] == 8
        assert facts[1]["final_logged_loss"] == pytest.approx(facts[0]["final_logged_loss"], rel=1e-3), name
        ppl = [e[name].lengths[0].ppl_nonoverlapping for e in (straight, resumed)]
        assert ppl[1] == pytest.approx(ppl[0], rel=1e-3), name


@pytest.mark.slow
def test_rerun_with_other_arguments_into_an_unfinished_run_is_refused_naming_them(tmp_path):
    exp, train = _args(tmp_path, "--models", "alibi")
    with pytest.raises(KeyboardInterrupt):
        run_experiment(exp, train, callbacks=[_Interrupt(at=6, model="alibi")])
    exp, train = _args(tmp_path, "--models", "alibi", "--learning_rate", "0.5")
    with pytest.raises(ValueError, match=r"other arguments \(training.learning_rate: .* -> 0.5\)"):
        run_experiment(exp, train)


@pytest.mark.parametrize(
    "override, message",
    [
        (["--models", "alibi", "transformer-xl"], "transformer-xl"),
        (["--models", "learned@0"], "learned@0"),
        (["--models", "learned@48"], "48"),  # 48 does not divide a batch of 8 x 32 tokens
        (["--train_length", "0"], "train_length"),
        (["--eval_factors", "1", "0"], "eval_factors"),
        (["--data_files", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    ],
)
def test_bad_config_fails_at_once_naming_the_value_and_writes_nothing(tmp_path, override, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        experiment, training = _args(tmp_path, *override)
        run_experiment(experiment, training)
    assert not (tmp_path / "run").exists()


def test_dataset_without_the_text_column_fails_naming_the_columns(tmp_path):
    data = tmp_path / "data.json"
    data.write_text("\n".join(json.dumps({"body": f"document {i} " * 50}) for i in range(20)))
    experiment, training = _args(tmp_path, "--data_files", str(data), "--text_column", "text")
    with pytest.raises(ValueError, match="body"):
        run_experiment(experiment, training)
    assert not (tmp_path / "run").exists()


def test_unknown_yaml_key_is_rejected(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("output_dir: x\ntrain_lenght: 128\n")
    with pytest.raises(ValueError, match="train_lenght"):
        parse_args(["--config", str(config)], ExperimentArguments)


@pytest.mark.slow
def test_push_to_hub_uploads_exactly_the_final_alibi_folder(smoke_run, monkeypatch):
    from huggingface_hub import HfApi

    from hf_alibi.experiments.reporting.publish import push_alibi_model

    output_dir, _, experiment = smoke_run
    calls = {}
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.setdefault("repo", repo_id))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kw: calls.setdefault("upload", kw))
    _, training = parse_args(
        ["--output_dir", str(output_dir), "--push_to_hub", "true", "--hub_model_id", "user/alibi-smoke"],
        ExperimentArguments,
    )
    push_alibi_model(experiment, training)
    assert calls["repo"] == "user/alibi-smoke"
    folder = Path(calls["upload"]["folder_path"])
    assert folder == output_dir / "alibi" / "final"
    uploaded = {p.name for p in folder.iterdir()}
    needed = {
        "config.json",
        "model.safetensors",
        "modeling_alibi_gpt2.py",
        "configuration_alibi_gpt2.py",
        "README.md",
        "tokenizer.json",
        "perplexity_vs_length.png",
    }
    assert needed <= uploaded, needed - uploaded


@pytest.mark.slow
def test_recipe_main_smoke_prints_the_summary(tmp_path, capsys, monkeypatch):
    from recipes import train_short_test_long

    monkeypatch.setattr(sys, "argv", ["train_short_test_long"])
    train_short_test_long.main(["--config", SMOKE_YAML, "--output_dir", str(tmp_path / "main"), "--models", "alibi"])
    out = capsys.readouterr().out
    assert "alibi" in out and "results written to" in out


@pytest.mark.slow
def test_two_process_ddp_training_runs_two_ranks(tmp_path):
    """`torchrun --nproc_per_node 2` on CPU is real 2-process gloo DDP (accelerate's --cpu flag would run one)."""
    import subprocess

    output_dir = tmp_path / "ddp"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        "-m",
        "recipes.train_short_test_long",
        "--config",
        SMOKE_YAML,
        "--output_dir",
        str(output_dir),
        "--models",
        "alibi",
        "--use_cpu",
        "true",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    metadata = json.loads((output_dir / "results.json").read_text())["metadata"]
    assert metadata["world_size"] == 2
    assert (output_dir / "alibi" / "final" / "model.safetensors").exists()


def test_headline_config_under_smoke_keeps_each_model_s_length_ratio_and_token_budget():
    from hf_alibi.experiments.setup.arguments import batch_size_at

    experiment, training = parse_args(
        ["--config", str(REPO / "hf_alibi/experiments/configs/headline.yaml")], ExperimentArguments
    )
    assert experiment.model_specs()["learned@512"] == ("learned", 4 * experiment.train_length)
    tokens = {batch_size_at(experiment, training, length) * length for length in experiment.train_lengths()}
    assert tokens == {training.per_device_train_batch_size * experiment.train_length}  # same tokens at every length
    apply_smoke(experiment, training)
    assert {"alibi", "learned@64", "learned@128", "rotary@128"} <= set(experiment.models)
    assert experiment.train_lengths() == [32, 64, 128]


def test_peak_memory_sees_a_64_mib_tensor_allocated_and_freed_inside_the_block():
    import torch

    from hf_alibi.experiments.training.peak_memory import PeakMemory

    with PeakMemory("cpu") as peak:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB of float32, touched
        del block
    if peak.peak_mib is None:
        pytest.skip(peak.source)
    assert 60 <= peak.peak_mib <= 80, peak.result()
