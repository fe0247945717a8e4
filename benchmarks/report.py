"""Turning raw measurements into results: medians, ratios against the reference and a markdown table (the targets
they are held to: `targets.py`).

Every ratio is against the reference (`gpt2-sdpa` unless `--reference` names another no-bias GPT-2) in the same cell
of the same run. `time_ratio` = contestant time / reference time (lower is better); for generation the time is the
decode time, so `throughput_ratio` = 1 / `time_ratio` is the decode tokens/s ratio. `mem_ratio` = contestant peak
memory growth / the reference's; with `--processes`,
`process_mem_ratio` = the whole-process peak's ratio (torch, model and the call: what the machine must have).
"""

import argparse
import json
import os
import platform
import statistics
import sys
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .contestants import ATTENTION_ONLY, REFERENCE

OK = "ok"


def standalone_parser(module: str, doc: str, what: str, child: tuple[str, str]) -> argparse.ArgumentParser:
    """The command line of a standalone benchmark that measures in fresh child processes (`benchmarks.<module>`):
    `--help` prints its docstring `doc`; `--out` and `--markdown` are what `write_outputs` writes (every `what`'s
    figures); the hidden `--child A B` (metavars `child`) is how the parent starts a child."""
    parser = argparse.ArgumentParser(
        prog=f"python -m benchmarks.{module}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help=f"write every {what}'s figures and the table's rows as JSON")
    parser.add_argument("--markdown", type=Path, help="write the table to this file too")
    parser.add_argument("--child", nargs=2, metavar=child, help=argparse.SUPPRESS)
    return parser


def write_outputs(args: argparse.Namespace, table: str, runs: list[dict], rows: list[dict]) -> None:
    """Print the markdown `table`; write it to `--markdown`, and the command, every run's figures and the table's
    rows as JSON to `--out` (the options of `standalone_parser`)."""
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.out:
        args.out.write_text(json.dumps({"command": sys.argv, "runs": runs, "rows": rows}, indent=1) + "\n")


def summarise(cell: dict, result: dict) -> None:
    """Fill `result`'s medians and tokens/s from its raw repeats (in place); a cell's time is its median."""
    if result.get("status") != OK:
        return
    if cell["suite"] == "generate":
        decode = [total - prefill for prefill, total in zip(result["prefill_s"], result["total_s"])]
        result["decode_s"] = decode
        result["median_s"] = statistics.median(decode)
        result["prefill_median_s"] = statistics.median(result["prefill_s"])
    else:
        result["median_s"] = statistics.median(result["seconds"])
    result["tokens_per_s"] = _tokens_per_s(cell, result["median_s"])


def _tokens_per_s(cell: dict, seconds: float) -> float | None:
    """Tokens a timed call handles (decoded tokens for generation) per second; None for a non-positive time."""
    tokens = cell["batch"] * (cell["decode"] - 1 if cell["suite"] == "generate" else cell["length"])
    return tokens / seconds if seconds > 0 else None


def combine_processes(cell: dict, rounds: list[dict], reference: str = REFERENCE) -> dict:
    """One cell's result per contestant from its per-process results (`rounds`: one {contestant: result} each).

    A contestant that failed in any process gets that failure (the first one that is not a skip after it). Otherwise
    its time, peak growth and whole-process peak are the medians over processes of each process's own figure (its
    time being the median of its repeats), with the [min, max] over processes as `*_spread`.
    """
    combined = {}
    for name in rounds[0]:
        runs = [results[name] for results in rounds]
        failures = [run for run in runs if run.get("status") != OK]
        if failures:
            combined[name] = dict(next((run for run in failures if run.get("status") != "skipped"), failures[0]))
            combined[name]["processes_ok"] = len(runs) - len(failures)
            continue
        result = {
            "status": OK,
            "processes": [
                {
                    key: run[key]
                    for key in ("median_s", "seconds", "decode_s", "peak_mem_bytes", "process_peak_bytes")
                    if key in run
                }
                for run in runs
            ],
            "mem_method": runs[0].get("mem_method"),
        }
        for key, spread in (
            ("median_s", "time_spread_s"),
            ("peak_mem_bytes", "mem_spread_bytes"),
            ("process_peak_bytes", "process_peak_spread_bytes"),
        ):
            values = [run[key] for run in runs if run.get(key) is not None]
            if values:
                result[key], result[spread] = statistics.median(values), [min(values), max(values)]
        result["tokens_per_s"] = _tokens_per_s(cell, result["median_s"])
        combined[name] = result
    add_ratios(combined, reference)
    return combined


def add_ratios(results: dict, reference: str = REFERENCE) -> None:
    """Ratios of every contestant of one cell against `reference` of that cell (None when it has no result)."""
    base = results.get(reference, {})
    for result in results.values():
        if result.get("status") != OK:
            continue
        ok = base.get("status") == OK
        # A decode time can come out <= 0 when the decode is shorter than the timer's noise: no ratio then.
        comparable = ok and base["median_s"] > 0 and result["median_s"] > 0
        time_ratio = result["median_s"] / base["median_s"] if comparable else None
        result["time_ratio"] = time_ratio
        result["throughput_ratio"] = 1 / time_ratio if time_ratio else None
        ref_mem = base.get("peak_mem_bytes") if ok else None
        result["mem_ratio"] = result["peak_mem_bytes"] / ref_mem if ref_mem and ref_mem > 0 else None
        ref_process = base.get("process_peak_bytes") if ok else None
        if result.get("process_peak_bytes") is not None and ref_process:
            result["process_mem_ratio"] = result["process_peak_bytes"] / ref_process


def machine_description(device: str, threads: int | None, device_name: str | None, torch_version: str | None) -> dict:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass

    def package(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "device": device,
        "device_name": device_name,
        "torch": torch_version or package("torch"),
        "transformers": package("transformers"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _bytes(value) -> str:
    if value is None:
        return "?"
    return f"{value / 2**30:.2f} GiB" if abs(value) >= 2**30 else f"{value / 2**20:.0f} MiB"


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_result(cell: dict, result: dict) -> str:
    status = result.get("status", "not run")
    if status != OK:
        reason = result.get("reason", "").replace("|", "/")  # a pipe would end the table cell
        return f"**{status}**" + (f" ({reason[:80]}{'...' if len(reason) > 80 else ''})" if reason else "")
    if "processes" in result:
        return _format_processes(cell, result)
    if cell["suite"] == "generate":
        speed = _decode_speed(result)
    elif cell["suite"] == "train":
        speed = f"{result['median_s']:.3f} s ({result['tokens_per_s']:.0f} tok/s) · {_ratio(result['time_ratio'])}"
    else:
        speed = f"{result['median_s']:.3f} s · {_ratio(result['time_ratio'])}"
    return f"{speed} · {_bytes(result['peak_mem_bytes'])} · {_ratio(result['mem_ratio'])}"


def _decode_speed(result: dict) -> str:
    tokens = "?" if result["tokens_per_s"] is None else f"{result['tokens_per_s']:.1f}"
    return f"{tokens} tok/s · {_ratio(result['throughput_ratio'])}"


def _format_processes(cell: dict, result: dict) -> str:
    """median [min, max over processes] · ratio · whole-process peak [min, max] · ratio · peak growth."""
    low, high = result["time_spread_s"]
    if cell["suite"] == "generate":
        speed = _decode_speed(result)
    else:
        speed = f"{result['median_s']:.3f} s [{low:.3f}, {high:.3f}] · {_ratio(result['time_ratio'])}"
    if result.get("process_peak_bytes") is None:
        return f"{speed} · {_bytes(result['peak_mem_bytes'])} · {_ratio(result['mem_ratio'])}"
    low, high = result["process_peak_spread_bytes"]
    return (
        f"{speed} · {_bytes(result['process_peak_bytes'])} [{_bytes(low)}, {_bytes(high)}] · "
        f"{_ratio(result.get('process_mem_ratio'))} · +{_bytes(result['peak_mem_bytes'])}"
    )


SUITE_TITLES = {
    "train": "Training step ({optimizer}): median time per step (tokens/s) · time ratio · peak memory growth (activations and "
    "gradients) · memory ratio",
    "forward": "Inference forward (no_grad, `logits_to_keep=1`, no cache): median time · time ratio · peak memory "
    "growth · memory ratio",
    "generate": "Generation (greedy, left-padded, cache): decode tokens/s · tokens/s ratio · peak memory growth of "
    "the whole generate call · memory ratio",
}


PROCESS_COLUMNS = {
    suite: f": {speed} [min, max over processes] · ratio · whole-process peak memory [min, max] · ratio · +peak growth"
    for suite, speed in (
        ("train", "median time per step"),
        ("forward", "median time"),
        ("generate", "decode tokens/s (time spread not shown)"),
    )
}


def render_markdown(report: dict) -> str:
    machine, settings = report["machine"], report["settings"]
    names = report["contestants"]
    lines = [
        "# hf_alibi benchmark",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {machine['cpu']} ({machine['cpu_count']} CPUs), device {machine['device']}"
        + (f" ({machine['device_name']})" if machine.get("device_name") else "")
        + f", {machine['threads']} torch threads, torch {machine['torch']}, transformers {machine['transformers']}, "
        f"Python {machine['python']}, {machine['date']}.",
        "",
        f"Models: n_embd={settings['shape']['n_embd']}, {settings['shape']['n_layer']} layers, "
        f"{settings['shape']['n_head']} heads, vocab {settings['shape']['vocab_size']}, {settings['dtype']}, "
        f"every dropout 0, random init. " + _method(settings),
    ]
    for twin, shipped in ATTENTION_ONLY.items():
        if twin in names:
            lines += [
                "",
                f"`{shipped}` is hf_alibi as shipped (its MLP's tanh GELU fused) against GPT-2 as shipped "
                f"(`NewGELUActivation`, unfused); `{twin}` is the same model with GPT-2's unfused GELU in every "
                f"MLP, so its ratio is the attention-only one (ALiBi's attention and no position table).",
            ]
    for suite in settings["suites"]:
        cells = [cell for cell in report["cells"] if cell["suite"] == suite]
        if not cells:
            continue
        title = SUITE_TITLES[suite].format(optimizer=settings["optimizer_description"])
        if settings.get("processes"):  # the figures after the label differ: see `_format_processes`
            title = title.split(":")[0] + PROCESS_COLUMNS[suite]
        lines += ["", "## " + title, ""]
        lines.append("| measurement | " + " | ".join(f"`{name}`" for name in names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        for cell in cells:
            row = [format_result(cell, cell["results"].get(name, {})) for name in names]
            lines.append(f"| {cell['name']} | " + " | ".join(row) + " |")
    if report["targets"]:
        alibi = sorted({row["contestant"] for row in report["targets"]}, key=names.index)
        title = "Parity targets" if report.get("target_set") == "parity" else "Budget targets"
        lines += [
            "",
            f"## {title}",
            "",
            "| target | " + " | ".join(f"`{n}`" for n in alibi) + " |",
            "|---" * (len(alibi) + 1) + "|",
        ]
        for target in dict.fromkeys(row["target"] for row in report["targets"]):
            by_name = {row["contestant"]: row for row in report["targets"] if row["target"] == target}
            cells = [f"{by_name[n]['status']} ({by_name[n]['detail']})" for n in alibi]
            lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _method(settings: dict) -> str:
    processes, reference = settings.get("processes"), settings.get("reference", REFERENCE)
    if not processes:
        return (
            f"Timing: {settings['warmup']} warm-up call(s), then {settings['repeats']} repeats interleaved across "
            f"contestants (ABCABC...), median. Ratios are against `{reference}` in the same cell. Memory: "
            f"{settings['memory_method']}."
        )
    return (
        f"Each cell ran in {processes} fresh processes per contestant, interleaved (round by round over all "
        f"cells, the contestants' order rotating each round); in each process {settings['warmup']} warm-up "
        f"call(s), one memory probe, then {settings['repeats']} timed call(s) (their median). A cell shows the "
        f"median over its processes [min, max over processes] · ratio · the whole-process peak memory (VmHWM: "
        f"torch, model, build and calls) [min, max] · ratio · +the call's own peak growth "
        f"({settings['memory_method']}). Ratios are of medians, against `{reference}` in the same cell."
    )
