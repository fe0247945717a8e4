"""`bench_skip`'s command line for an encoder checkpoint (its reference is `BertModel`, it has no decoding suites),
and `rerun_summary`, which re-runs the commands the BENCHMARKS.md summary cites into one dated folder."""

import json
from pathlib import Path

import pytest

from benchmarks.bench_skip import auto_markdown, parse_args
from benchmarks.rerun_summary import main as rerun_main
from benchmarks.rerun_summary import redirected, summary_commands

ROOT = Path(__file__).resolve().parents[2]


def checkpoint(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(tmp_path)


def test_an_encoder_checkpoint_is_measured_against_bert_without_decoding(tmp_path):
    args = parse_args(["--checkpoint", checkpoint(tmp_path, "alibi_bert"), "--forward", "4096"])
    assert args.contestants == ("bert-sdpa", "alibi-dense", "alibi-skip", "alibi-auto")
    assert args.decode == "0"
    with pytest.raises(ValueError, match="is an encoder"):
        parse_args(["--checkpoint", checkpoint(tmp_path, "alibi_bert"), "--decode", "8192"])


def test_a_decoder_checkpoint_keeps_gpt2_and_its_decoding_suite(tmp_path):
    args = parse_args(["--checkpoint", checkpoint(tmp_path, "alibi_gpt2")])
    assert args.contestants == ("gpt2-sdpa", "alibi-dense", "alibi-skip", "alibi-auto")
    assert args.decode == "8192,16384,32768"


def test_the_auto_table_puts_gpt2_beside_a_packed_row_and_a_dash_where_it_did_not_run():
    def timed(seconds, peak=None):
        return {"median_s": seconds, "min_s": seconds, "max_s": seconds, **({"peak_bytes": peak} if peak else {})}

    decode = {"suite": "cb_decode", "length": 16384, "same_tokens": True}
    decode.update({"alibi-dense": timed(0.04), "alibi-auto": timed(0.02)})
    packed = {"suite": "packed_train", "length": 8192}
    packed.update({"gpt2-sdpa": timed(8.0, 2**32), "alibi-dense": timed(2.0, 2**30), "alibi-auto": timed(2.0, 2**30)})
    _, header, _, decoding, training = auto_markdown([decode, packed])
    assert "`gpt2-sdpa`" in header and "auto / GPT-2" in header
    assert decoding.split(" | ")[1:6] == ["-", "40.000 [40.000, 40.000]", "20.000 [20.000, 20.000]", "0.50x", "-"]
    assert training.split(" | ")[4:7] == ["1.00x", "0.25x", "peak 4096 / 1024 / 1024 MiB |"]


def test_the_summary_commands_are_found_and_redirected_under_one_folder(tmp_path):
    commands = summary_commands(ROOT / "BENCHMARKS.md")
    assert len(commands) >= 20 and len(set(commands)) == len(commands)
    assert all("python -m benchmarks." in command for command in commands)
    words = redirected(
        "python -m benchmarks.bench_alibi --checkpoint runs/x --out results/a.json --markdown results/a.md",
        tmp_path,
        [("runs/x", "/ckpt/x")],
    )
    assert words[words.index("--checkpoint") + 1] == "/ckpt/x"
    assert words[words.index("--out") + 1] == str(tmp_path / "results/a.json")
    assert words[words.index("--markdown") + 1] == str(tmp_path / "results/a.md")


def test_the_rerun_lists_and_refuses_unknown_numbers_by_name(capsys):
    rerun_main(["--page", str(ROOT / "BENCHMARKS.md"), "--list"])
    assert " 1. python -m benchmarks." in capsys.readouterr().out
    with pytest.raises(ValueError, match="--only names command 999"):
        rerun_main(["--page", str(ROOT / "BENCHMARKS.md"), "--only", "999"])
    with pytest.raises(ValueError, match="OLD=NEW"):
        rerun_main(["--replace", "no-equals-sign", "--list"])
