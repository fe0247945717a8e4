"""The benchmark harness (benchmarks/): structure and failure handling, never speed.

One end-to-end run in `--preset tiny` (two real worker processes) checks the JSON and markdown, that ratios are
against gpt2-sdpa, and that a contestant failing (injected fault) or unsupported is a recorded result. Timeouts and
crashes are checked on the worker protocol with a dummy worker that imports nothing.
"""

import json
import math
import statistics
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the installed package
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_alibi, report  # noqa: E402
from benchmarks.targets import evaluate_targets  # noqa: E402
from benchmarks.worker import FAULT_ENV, Worker, WorkerFailure  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """gpt2-sdpa + alibi-sdpa (fails every forward cell) + alibi-flash (unsupported on CPU), all suites, 1 repeat."""
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "--preset",
        "tiny",
        "--suite",
        "train,forward,generate",
        "--contestants",
        "alibi-sdpa,alibi-flash",
        "--train-lengths",
        "32",
        "--lengths",
        "32,64",
        "--prefill",
        "8",
        "--decode",
        "8",
        "--gen-batches",
        "1,2",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--settle",
        "0",
        "--out",
        str(out / "results.json"),
        "--markdown",
        str(out / "table.md"),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv(FAULT_ENV, "alibi-sdpa:forward:error")
        returned = bench_alibi.main(argv)
    return returned, json.loads((out / "results.json").read_text()), (out / "table.md").read_text()


@pytest.mark.slow
def test_results_json_has_every_cell_and_contestant(tiny_run):
    returned, results, _ = tiny_run
    assert results == json.loads(json.dumps(returned))  # the file is the final report
    assert results["contestants"] == ["gpt2-sdpa", "alibi-sdpa", "alibi-flash"]
    assert [cell["name"] for cell in results["cells"]] == [
        "train L=32 B=4",
        "forward L=32 B=1",
        "forward L=64 B=1",
        "generate B=1 prefill 8 decode 8",
        "generate B=2 prefill 8 decode 8",
    ]
    for cell in results["cells"]:
        assert set(cell["results"]) == {"gpt2-sdpa", "alibi-sdpa", "alibi-flash"}, cell["name"]
    assert results["machine"]["threads"] == 1
    assert {"cpu", "torch", "transformers", "date"} <= set(results["machine"])
    assert results["command"].startswith("python -m benchmarks.bench_alibi --preset tiny")
    assert results["settings"]["shape"] == {"n_embd": 96, "n_layer": 2, "n_head": 12, "vocab_size": 512}


@pytest.mark.slow
def test_ratios_are_against_gpt2_sdpa_of_the_same_cell(tiny_run):
    _, results, _ = tiny_run
    measured = [cell for cell in results["cells"] if cell["suite"] != "forward"]
    for cell in measured:
        reference, alibi = cell["results"]["gpt2-sdpa"], cell["results"]["alibi-sdpa"]
        assert reference["status"] == alibi["status"] == "ok", cell["name"]
        assert reference["time_ratio"] == 1.0
        assert math.isclose(alibi["time_ratio"], alibi["median_s"] / reference["median_s"])
        assert math.isclose(alibi["throughput_ratio"], 1 / alibi["time_ratio"])
        if reference["peak_mem_bytes"] > 0:
            assert math.isclose(alibi["mem_ratio"], alibi["peak_mem_bytes"] / reference["peak_mem_bytes"])
        assert alibi["tokens_per_s"] > 0 and alibi["peak_mem_bytes"] >= 0
    generate = measured[-1]["results"]["gpt2-sdpa"]
    assert math.isclose(generate["median_s"], generate["total_s"][0] - generate["prefill_s"][0])
    assert math.isclose(generate["tokens_per_s"], 2 * (8 - 1) / generate["median_s"])  # batch 2, decode 8


@pytest.mark.slow
def test_failing_and_unsupported_contestants_are_recorded_not_raised(tiny_run):
    _, results, markdown = tiny_run
    for cell in results["cells"]:
        flash = cell["results"]["alibi-flash"]
        assert flash["status"] == "unsupported" and "CUDA" in flash["reason"]
        if cell["suite"] == "forward":
            failed = cell["results"]["alibi-sdpa"]
            assert failed["status"] == "error" and "injected fault" in failed["reason"]
            assert cell["results"]["gpt2-sdpa"]["status"] == "ok"
    assert "**error** (RuntimeError: injected fault)" in markdown
    assert "alibi-flash" not in results["workers"]  # unsupported everywhere: its worker was never started


@pytest.mark.slow
def test_markdown_has_machine_command_tables_and_targets(tiny_run):
    _, results, markdown = tiny_run
    assert results["command"] in markdown and results["machine"]["cpu"] in markdown
    header = "| measurement | `gpt2-sdpa` | `alibi-sdpa` | `alibi-flash` |"
    assert markdown.count(header) == 3  # train, forward, generate
    assert "| train L=32 B=4 | " in markdown and " tok/s) · 1.00x · " in markdown
    assert "## Budget targets" in markdown
    targets = {row["target"]: row for row in results["targets"] if row["contestant"] == "alibi-sdpa"}
    assert len(targets) == 9
    assert targets["forward L=8192 <= 1.3x gpt2-sdpa time"]["status"] == "n/a"  # not measured at tiny lengths
    assert targets["decode tokens/s batch 1 >= 0.95x gpt2-sdpa"]["status"] in ("met", "not met")


def _result(median_s, peak, status="ok"):
    return {"status": status, "median_s": median_s, "peak_mem_bytes": peak}


def test_targets_met_and_not_met_from_known_numbers():
    forward = {
        "suite": "forward",
        "length": 8192,
        "results": {
            "gpt2-sdpa": _result(1.0, 100),
            "bloom-eager": _result(4.0, 300),
            "alibi-sdpa": _result(1.2, 140),
        },
    }
    report.add_ratios(forward["results"])
    rows = {row["target"]: row for row in evaluate_targets([forward], "alibi-sdpa")}
    assert rows["forward L=8192 <= 1.3x gpt2-sdpa time"]["status"] == "met"
    assert rows["peak memory L=8192 <= 1.25x gpt2-sdpa"]["status"] == "not met"  # 1.40x
    assert rows["forward L=8192 >= 3x faster than bloom-eager, < 0.5x its memory"]["status"] == "met"  # 3.33x, 0.47x
    assert rows["forward L=4096 >= 3x faster than bloom-eager, < 0.5x its memory"]["status"] == "n/a"
    forward["results"]["bloom-eager"] = {"status": "oom", "reason": "x"}
    rows = {row["target"]: row for row in evaluate_targets([forward], "alibi-sdpa")}
    assert rows["forward L=8192 >= 3x faster than bloom-eager, < 0.5x its memory"]["detail"] == "bloom-eager: oom"


DUMMY_WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    print("@@bench " + json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        op = json.loads(line)["op"]
        if op == "hang":
            time.sleep(60)
        if op == "crash":
            os._exit(137)
        if op == "raise":
            raise SystemExit("boom")
        print("noise a library printed", flush=True)
        print("@@bench " + json.dumps({"ok": True, "op": op}), flush=True)
    """
)


@pytest.mark.slow  # a worker process per case
@pytest.mark.parametrize("op, status", [("hang", "timeout"), ("crash", "crashed"), ("raise", "error")])
def test_worker_timeout_crash_and_exception_become_statuses(tmp_path, op, status):
    worker = Worker([sys.executable, "-c", DUMMY_WORKER], tmp_path / "worker.log")
    try:
        assert worker.receive(timeout=30) == {"event": "ready"}
        assert worker.request({"op": "ping"}, timeout=30) == {"ok": True, "op": "ping"}  # noise lines skipped
        with pytest.raises(WorkerFailure) as failure:
            worker.request({"op": op}, timeout=1.0)
        assert failure.value.status == status
        assert not worker.alive()
    finally:
        worker.close()


def test_cli_rejects_unknown_names_with_the_valid_ones():
    with pytest.raises(SystemExit):
        bench_alibi.parse_args(["--contestants", "alibi-sdpa,rwkv"])
    args = bench_alibi.parse_args(["--preset", "tiny", "--contestants", "alibi-eager", "--n-layer", "3"])
    assert args.contestants == ["gpt2-sdpa", "alibi-eager"] and args.shape.n_layer == 3
    assert args.max_length == max(args.lengths + args.train_lengths + [args.prefill + args.decode])


def test_reference_flag_names_the_model_every_ratio_is_against(capsys):
    args = bench_alibi.parse_args(["--preset", "tiny", "--contestants", "alibi-sdpa"])
    assert args.reference == "gpt2-sdpa" and args.contestants == ["gpt2-sdpa", "alibi-sdpa"]
    # FlashAttention-2 without ALiBi is the GPU reference; asked for on a CPU it is refused before any worker starts
    with pytest.raises(SystemExit):
        bench_alibi.parse_args(["--preset", "tiny", "--reference", "gpt2-flash"])
    assert "--reference gpt2-flash cannot run here: FlashAttention-2 needs CUDA" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_alibi.parse_args(["--preset", "tiny", "--reference", "alibi-sdpa"])  # ours: never what ours is held to
    # an import is held to the source's own code, which then also runs as a contestant
    argv = ["--preset", "tiny", "--suite", "forward", "--reference", "baichuan-eager", "--contestants", "alibi-sdpa"]
    args = bench_alibi.parse_args(argv)
    assert args.reference == "baichuan-eager" and args.contestants == ["baichuan-eager", "alibi-sdpa"]


def test_prepared_gpu_script_passes_valid_arguments(monkeypatch):
    """benchmarks/gpu_parity.sh runs where no CI does (a lent GPU): its commands must at least parse here."""
    import re
    import shlex

    script = (ROOT / "benchmarks" / "gpu_parity.sh").read_text().replace("\\\n", " ")
    base = shlex.split(re.search(r'^B="python -m benchmarks.bench_alibi (.*?)"$', script, re.M | re.S).group(1))
    lines = [line[3:].replace('"$dest', '"/tmp') for line in script.splitlines() if line.startswith("$B ")]
    commands = [shlex.split(line) for line in lines]
    assert len(commands) == 2
    monkeypatch.setattr(bench_alibi, "unsupported_reason", lambda *args: None)  # no CUDA or flash-attn here
    for command in commands:
        args = bench_alibi.parse_args(base + command)
        assert (args.device, args.dtype, args.reference, args.targets) == ("cuda", "bf16", "gpt2-flash", "parity")
        assert args.contestants[0] == "gpt2-flash" and "alibi-flash" in args.contestants


def test_ratios_and_targets_follow_the_named_reference():
    results = {"gpt2-sdpa": _result(2.0, 100), "gpt2-flash": _result(1.0, 50), "alibi-flash": _result(1.04, 52)}
    report.add_ratios(results, "gpt2-flash")
    assert math.isclose(results["alibi-flash"]["time_ratio"], 1.04)
    assert math.isclose(results["alibi-flash"]["mem_ratio"], 52 / 50)
    assert math.isclose(results["gpt2-sdpa"]["time_ratio"], 2.0)
    cell = {"suite": "forward", "length": 4096, "batch": 1, "name": "forward L=4096 B=1", "results": results}
    rows = evaluate_targets([cell], "alibi-flash", "parity", "gpt2-flash")
    assert [(row["target"], row["status"]) for row in rows] == [("forward L=4096 B=1 within 1.05x gpt2-flash", "met")]
    rows = evaluate_targets([cell], "alibi-flash", "budget", "gpt2-flash")
    assert "forward L=8192 <= 1.3x gpt2-flash time" in {row["target"] for row in rows}


def _run(median_s, growth, process_peak, seconds=None):
    return {
        "status": "ok",
        "median_s": median_s,
        "seconds": seconds or [median_s],
        "peak_mem_bytes": growth,
        "process_peak_bytes": process_peak,
    }


def test_processes_combine_to_medians_with_their_spread():
    cell = {"suite": "forward", "length": 4096, "batch": 1}
    rounds = [
        {"gpt2-sdpa": _run(1.0, 10, 100), "alibi-sdpa": _run(1.2, 8, 90), "bloom-eager": {"status": "oom"}},
        {
            "gpt2-sdpa": _run(1.2, 12, 104),
            "alibi-sdpa": _run(1.1, 9, 95),
            "bloom-eager": {"status": "skipped", "reason": "oom at forward L=4096 B=1"},
        },
        {"gpt2-sdpa": _run(0.9, 11, 102), "alibi-sdpa": _run(1.0, 7, 99), "bloom-eager": {"status": "skipped"}},
    ]
    combined = report.combine_processes(cell, rounds)
    gpt2, alibi = combined["gpt2-sdpa"], combined["alibi-sdpa"]
    assert gpt2["median_s"] == 1.0 and gpt2["time_spread_s"] == [0.9, 1.2]
    assert alibi["median_s"] == 1.1 and alibi["time_spread_s"] == [1.0, 1.2]
    assert alibi["process_peak_bytes"] == 95 and alibi["process_peak_spread_bytes"] == [90, 99]
    assert math.isclose(alibi["time_ratio"], 1.1) and math.isclose(alibi["process_mem_ratio"], 95 / 102)
    assert math.isclose(alibi["mem_ratio"], 8 / 11) and len(alibi["processes"]) == 3
    assert combined["bloom-eager"]["status"] == "oom"  # the failure itself, not the skips it caused
    assert combined["bloom-eager"]["processes_ok"] == 0


def test_parity_targets_need_time_and_whole_process_memory_within_5_percent():
    def cell(suite, length, alibi, bloom=None):
        results = {"gpt2-sdpa": _run(1.0, 10, 100), "alibi-sdpa": alibi}
        if bloom is not None:
            results["bloom-eager"] = bloom
        report.add_ratios(results)
        return {"suite": suite, "length": length, "batch": 1, "name": f"{suite} L={length} B=1", "results": results}

    cells = [
        cell("forward", 512, _run(1.04, 30, 104)),  # growth 3x is fine: the target is on the whole process
        cell("forward", 4096, _run(1.06, 10, 100), bloom=_run(3.3, 500, 900)),
        cell("forward", 16384, _run(1.0, 10, 106), bloom={"status": "oom"}),
        cell("train", 2048, _run(1.0, 10, 100)),
        cell("train", 64, _run(2.0, 10, 100)),  # below the lengths: no target
    ]
    rows = {row["target"]: row for row in evaluate_targets(cells, "alibi-sdpa", "parity")}
    assert set(rows) == {
        "forward L=512 B=1 within 1.05x gpt2-sdpa",
        "forward L=4096 B=1 within 1.05x gpt2-sdpa",
        "forward L=4096 B=1: bloom-eager >= 3x slower",
        "forward L=16384 B=1 within 1.05x gpt2-sdpa",
        "forward L=16384 B=1: bloom-eager >= 3x slower",
        "train L=2048 B=1 within 1.05x gpt2-sdpa",
    }
    assert rows["forward L=512 B=1 within 1.05x gpt2-sdpa"]["status"] == "met"
    assert rows["forward L=4096 B=1 within 1.05x gpt2-sdpa"]["status"] == "not met"  # time 1.06x
    assert rows["forward L=16384 B=1 within 1.05x gpt2-sdpa"]["status"] == "not met"  # memory 1.06x
    bloom_4k = rows["forward L=4096 B=1: bloom-eager >= 3x slower"]
    assert (bloom_4k["status"], bloom_4k["detail"]) == ("met", "bloom-eager 3.11x our time")  # 3.3 s / 1.06 s
    assert rows["forward L=16384 B=1: bloom-eager >= 3x slower"]["status"] == "met"  # it ran out of memory


@pytest.mark.slow
def test_processes_mode_measures_each_cell_in_fresh_processes(tmp_path):
    out = tmp_path / "results.json"
    argv = [
        "--preset",
        "tiny",
        "--suite",
        "forward",
        "--contestants",
        "alibi-sdpa",
        "--lengths",
        "32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--settle",
        "0",
        "--processes",
        "2",
        "--targets",
        "parity",
        "--out",
        str(out),
        "--markdown",
        str(tmp_path / "table.md"),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        results = bench_alibi.main(argv)
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    (cell,) = results["cells"]
    for name in ("gpt2-sdpa", "alibi-sdpa"):
        result = cell["results"][name]
        assert result["status"] == "ok" and len(result["processes"]) == 2
        assert result["median_s"] == statistics.median(p["median_s"] for p in result["processes"])
        # the whole process (torch, model, call) holds far more than the call's own growth
        assert result["process_peak_bytes"] > 50 * 2**20 > result["peak_mem_bytes"]
    assert results["settings"]["processes"] == 2 and results["target_set"] == "parity"
    assert "[min, max over processes]" in (tmp_path / "table.md").read_text()


def test_bench_parallel_on_a_transformers_older_than_5_24_refuses_before_its_first_launch(monkeypatch, capsys):
    import transformers
    from packaging.version import Version

    from benchmarks import bench_parallel
    from hf_alibi import _transformers_compat

    monkeypatch.setattr(_transformers_compat, "TRANSFORMERS_VERSION", Version("5.23.0"))
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    monkeypatch.setattr(bench_parallel, "build", lambda *args: pytest.fail("a checkpoint was built"))
    with pytest.raises(ImportError, match=r"fsdp and tp modes needs transformers>=5\.24"):
        bench_parallel.main(["--launches", "1"])
