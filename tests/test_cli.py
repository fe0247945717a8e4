"""`hf-alibi`: every bad invocation is one line `hf-alibi: error: ...` naming the path or value at fault, exit
status 2, no traceback and nothing written; `--debug` / HF_ALIBI_DEBUG=1 raise instead; train/evaluate dispatch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, GPT2Config, GPT2LMHeadModel

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi._transformers_compat import SERVING_MINIMUM, transformers_at_least
from hf_alibi.cli import main

SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocabulary: no config warnings


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Checkpoint folders the cases read (never write): GPT-2, ALiBi (plain / BLOOM-shaped), broken ones."""
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    tiny = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=50, **SPECIAL)
    GPT2LMHeadModel(GPT2Config(**tiny, n_positions=16)).save_pretrained(root / "gpt2")
    AlibiGPT2LMHeadModel(AlibiGPT2Config(**tiny)).save_pretrained(root / "alibi")
    AlibiGPT2LMHeadModel(AlibiGPT2Config(**tiny, embedding_layernorm=True)).save_pretrained(root / "alibi_bloomish")
    BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32).save_pretrained(
        root / "bert"
    )
    weights = (root / "gpt2" / "model.safetensors").read_bytes()
    for name, broken in {"truncated": weights[: len(weights) // 2], "corrupt": b"\x07" * len(weights)}.items():
        (root / name).mkdir()
        (root / name / "config.json").write_bytes((root / "gpt2" / "config.json").read_bytes())
        (root / name / "model.safetensors").write_bytes(broken)
    (root / "not_a_checkpoint").mkdir()
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    (root / "a_file").write_text("not a folder")
    return root


# (case, argv with {src} = the sources folder and {out} = an empty folder, text the error must name)
CASES = [
    ("missing_folder", ["convert", "{src}/no_such_folder", "{out}/x"], "no_such_folder"),
    ("hub_id_offline", ["convert", "someone/not-cached-model", "{out}/x"], "'someone/not-cached-model'"),
    ("source_is_a_file", ["convert", "{src}/a_file", "{out}/x"], "a_file' is a file"),
    ("folder_without_config", ["convert", "{src}/not_a_checkpoint", "{out}/x"], "not_a_checkpoint' has no config.json"),
    ("unsupported_model_type", ["convert", "{src}/bert", "{out}/x"], "'bert'"),
    ("truncated_safetensors", ["convert", "{src}/truncated", "{out}/x"], "truncated/model.safetensors"),
    ("corrupt_safetensors", ["convert", "{src}/corrupt", "{out}/x"], "corrupt/model.safetensors"),
    ("destination_not_empty", ["convert", "{src}/gpt2", "{src}/taken"], "taken' exists and is not empty"),
    ("destination_is_a_file", ["convert", "{src}/gpt2", "{src}/a_file"], "a_file' is a file"),
    ("bad_max_bias", ["convert", "{src}/gpt2", "{out}/x", "--alibi-max-bias", "-1"], "got -1.0"),
    ("extra_argument", ["convert", "{src}/gpt2", "{out}/x", "surplus"], "surplus"),
    ("export_missing_source", ["export", "{src}/no_such_folder", "{out}/x", "--to", "mpt"], "no_such_folder"),
    ("export_not_alibi", ["export", "{src}/gpt2", "{out}/x", "--to", "mpt"], "model_type='gpt2'"),
    ("export_bloom_refused", ["export", "{src}/alibi", "{out}/x", "--to", "bloom"], "embedding_layernorm=True"),
    ("export_mpt_refused", ["export", "{src}/alibi", "{out}/x", "--to", "mpt"], "bias=False"),
    ("export_gguf_refused", ["export", "{src}/alibi_bloomish", "{out}/x.gguf", "--to", "gguf"], "embedding_layernorm"),
    ("export_gguf_suffix", ["export", "{src}/alibi", "{out}/x.bin", "--to", "gguf"], "x.bin' should end in .gguf"),
    ("export_destination_taken", ["export", "{src}/alibi", "{src}/taken", "--to", "mpt"], "taken' exists"),
    (
        "export_bloom_max_seq_len",
        ["export", "{src}/alibi", "{out}/x", "--to", "bloom", "--max-seq-len", "8"],
        "max_seq_len=8",
    ),
    ("export_unknown_layout", ["export", "{src}/alibi", "{out}/x", "--to", "onnx"], "'onnx'"),
    ("plot_bias_no_source", ["plot-bias", "--output", "{out}/x.png"], "not both or neither"),
    ("plot_bias_not_alibi", ["plot-bias", "{src}/gpt2", "--output", "{out}/x.png"], "'gpt2' config"),
    ("train_unknown_config", ["train", "--config", "no_such_config"], "'no_such_config'"),
    ("train_unknown_option", ["train", "--config", "smoke", "--train_lenght", "3"], "--train_lenght"),
    (
        "train_bad_value",
        ["train", "--config", "smoke", "--models", "transformer-xl", "--output_dir", "{out}/run"],
        "'transformer-xl'",
    ),
    (
        "train_missing_init_from",
        [
            "train",
            "--config",
            "smoke",
            "--models",
            "alibi",
            "--output_dir",
            "{out}/run",
            "--init_from",
            "{src}/no_such_model",
        ],
        "no_such_model",
    ),
    (
        "evaluate_missing_model",
        ["evaluate", "--model", "{src}/no_such_folder", "--output_dir", "{out}/eval"],
        "no_such_folder",
    ),
    ("unknown_command", ["bogus"], "'bogus'"),
]


def _argv(template: list[str], sources: Path, out: Path) -> list[str]:
    return [arg.format(src=sources, out=out) for arg in template]


def _listing(*folders: Path) -> list[str]:
    return sorted(str(path) for folder in folders for path in folder.rglob("*"))


@pytest.mark.parametrize("template, names", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_invocation_is_one_error_line_naming_the_value_with_status_2_and_writes_nothing(
    sources, tmp_path, capfd, template, names
):
    out = tmp_path / "out"
    out.mkdir()
    before = _listing(sources, out)
    status = main(_argv(template, sources, out))
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2, captured
    assert len(lines) == 1 and lines[0].startswith("hf-alibi: error: "), captured.err
    assert names in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out
    assert _listing(sources, out) == before, "something was written"


def test_debug_flag_and_environment_variable_raise_with_the_traceback(sources, tmp_path, monkeypatch):
    argv = ["convert", str(sources / "bert"), str(tmp_path / "x")]
    with pytest.raises(ValueError, match="'bert'"):
        main(["--debug", *argv])
    monkeypatch.setenv("HF_ALIBI_DEBUG", "1")
    with pytest.raises(ValueError, match="'bert'"):
        main(argv)


def test_unexpected_errors_name_their_type_and_point_to_debug(sources, tmp_path, capfd, monkeypatch):
    from hf_alibi import cli

    def broken(*args, **kwargs):
        raise RuntimeError("an internal failure")

    monkeypatch.setattr(cli, "convert_checkpoint", broken)
    assert main(["convert", str(sources / "gpt2"), str(tmp_path / "x")]) == 2
    expected = "hf-alibi: error: RuntimeError: an internal failure (rerun with --debug for the traceback)\n"
    assert capfd.readouterr().err == expected


def test_version_prints_the_installed_version_and_exits_0(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"hf-alibi {version('hf_alibi')}\n"


def test_train_and_evaluate_help_list_their_arguments_and_exit_0(capsys):
    assert main(["train", "--help"]) == 0
    train_help = capsys.readouterr().out
    assert train_help.startswith("usage: hf-alibi train") and "--eval_factors" in train_help
    assert "cpu_demo" in train_help  # the shipped configs, by name
    assert main(["evaluate", "--help"]) == 0
    assert "--length_factors" in capsys.readouterr().out


@pytest.mark.parametrize("spelling", ["snake", "kebab"])
def test_trainer_commands_take_snake_and_kebab_case_flags_alike(sources, tmp_path, capfd, spelling):
    """The Trainer family documents --snake_case; HfArgumentParser's --kebab-case spellings keep working (cli.py)."""

    def flag(name):
        return f"--{name}" if spelling == "snake" else f"--{name.replace('_', '-')}"

    runs = {  # each parses every option, then refuses the value its test names: nothing is trained or written
        "train": (
            [
                "train",
                "--config",
                "smoke",
                flag("output_dir"),
                str(tmp_path / "run"),
                flag("train_length"),
                "64",
                flag("max_steps"),
                "2",
                flag("eval_factors"),
                "1",
                "0",
            ],
            "eval_factors must all be >= 1",
        ),
        "evaluate": (
            [
                "evaluate",
                "--model",
                str(sources / "no_such_folder"),
                flag("output_dir"),
                str(tmp_path / "e"),
                flag("length_factors"),
                "1",
                "2",
                flag("batch_tokens"),
                "64",
            ],
            "no_such_folder",
        ),
        "sweep": (
            ["sweep", "--config", "smoke", flag("output_dir"), str(tmp_path / "s"), "--budgets", "0"],
            "budgets must be distinct positive step counts",
        ),
    }
    for argv, message in runs.values():
        assert main(argv) == 2
        error = capfd.readouterr().err
        assert message in error and "not used by the HfArgumentParser" not in error, error
    assert not any(tmp_path.iterdir()), "something was written"


@pytest.mark.slow
def test_console_command_prints_one_line_and_a_traceback_only_with_debug(tmp_path):
    """The real process: status 2 and one stderr line; HF_ALIBI_DEBUG=1 prints Python's traceback."""
    command = [sys.executable, "-m", "hf_alibi.cli", "convert", str(tmp_path / "missing"), str(tmp_path / "x")]
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"hf-alibi: error: {str(tmp_path / 'missing')!r}: no such folder"]
    done = subprocess.run(command, capture_output=True, text=True, env=env | {"HF_ALIBI_DEBUG": "1"}, timeout=300)
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr
    assert not (tmp_path / "x").exists()


# A mistyped checkpoint folder that is a valid Hub id ("typo"): every command that reads a checkpoint.
TYPO_COMMANDS = {
    "evaluate": ["evaluate", "--model", "typo", "--output_dir", "{out}/eval"],
    "serve": pytest.param(
        ["serve", "typo"],
        marks=pytest.mark.skipif(
            not transformers_at_least(SERVING_MINIMUM),
            reason=f"hf-alibi serve needs transformers>={SERVING_MINIMUM}: older ones refuse it before reading the "
            "source (tests/serving/test_serve_cli.py)",
        ),
    ),
    "convert": ["convert", "typo", "{out}/x"],
    "export": ["export", "typo", "{out}/x", "--to", "mpt"],
}


@pytest.mark.parametrize("template", TYPO_COMMANDS.values(), ids=TYPO_COMMANDS.keys())
def test_a_typo_that_names_no_folder_fails_in_one_line_at_once_when_the_hub_cannot_be_reached(
    tmp_path, capfd, monkeypatch, template
):
    """Online mode (HF_HUB_OFFLINE unset) with the Hub unreachable (a closed local port as its endpoint): the Hub
    client's retries took 36-40 s and a dozen lines before the error; the check before them fails at once."""
    import socket
    import time

    from huggingface_hub import constants

    with socket.socket() as probe:  # a port nobody listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed}")
    (tmp_path / "out").mkdir()
    start = time.monotonic()
    status = main(_argv(template, tmp_path, tmp_path / "out"))
    elapsed = time.monotonic() - start
    captured = capfd.readouterr()
    expected = (
        f"hf-alibi: error: 'typo': no such folder, and the Hub (http://127.0.0.1:{closed}) cannot be reached "
        "to look for a model of that id"
    )
    assert status == 2 and captured.err.strip().splitlines() == [expected], captured
    assert elapsed < 10, f"{elapsed:.1f} s before the error"
