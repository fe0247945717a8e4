"""Turning raw measurements into results: medians, ratios against gpt2-sdpa, issue 4's targets and a markdown table.

Every ratio is against `gpt2-sdpa` in the same cell of the same run. `time_ratio` = contestant time / gpt2-sdpa time
(lower is better); for generation the time is the decode time, so `throughput_ratio` = 1 / `time_ratio` is the
decode tokens/s ratio. `mem_ratio` = contestant peak memory growth / gpt2-sdpa's.
"""

import os
import platform
import statistics
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .contestants import REFERENCE

OK = "ok"


def summarise(cell: dict, result: dict) -> None:
    """Fill `result`'s medians and tokens/s from its raw repeats (in place); a cell's time is its median."""
    if result.get("status") != OK:
        return
    if cell["suite"] == "generate":
        decode = [total - prefill for prefill, total in zip(result["prefill_s"], result["total_s"])]
        result["decode_s"] = decode
        result["median_s"] = statistics.median(decode)
        result["prefill_median_s"] = statistics.median(result["prefill_s"])
        tokens = cell["batch"] * (cell["decode"] - 1)
    else:
        result["median_s"] = statistics.median(result["seconds"])
        tokens = cell["batch"] * cell["length"]
    result["tokens_per_s"] = tokens / result["median_s"] if result["median_s"] > 0 else None


def add_ratios(results: dict) -> None:
    """Ratios of every contestant of one cell against `gpt2-sdpa` of that cell (None when it has no result)."""
    reference = results.get(REFERENCE, {})
    for result in results.values():
        if result.get("status") != OK:
            continue
        ok = reference.get("status") == OK
        # A decode time can come out <= 0 when the decode is shorter than the timer's noise: no ratio then.
        comparable = ok and reference["median_s"] > 0 and result["median_s"] > 0
        time_ratio = result["median_s"] / reference["median_s"] if comparable else None
        result["time_ratio"] = time_ratio
        result["throughput_ratio"] = 1 / time_ratio if time_ratio else None
        ref_mem = reference.get("peak_mem_bytes") if ok else None
        result["mem_ratio"] = result["peak_mem_bytes"] / ref_mem if ref_mem and ref_mem > 0 else None


def _find(cells: list[dict], suite: str, **match) -> dict | None:
    for cell in cells:
        if cell["suite"] == suite and all(cell.get(key) == value for key, value in match.items()):
            return cell
    return None


def _ratio_target(result: dict, key: str, limit: float, at_least: bool = False) -> tuple[str, str]:
    value = result.get(key)
    if value is None:
        return "n/a", f"no {REFERENCE} result"
    met = value >= limit if at_least else value <= limit
    return ("met" if met else "not met"), f"{value:.2f}x"


def _bloom_target(result: dict, bloom: dict, speedup_min: float = 3, memory_max: float = 0.5) -> tuple[str, str]:
    """>= `speedup_min` x faster than bloom-eager with < `memory_max` of its peak memory."""
    if bloom.get("status") != OK:
        return "n/a", f"bloom-eager: {bloom.get('status', 'not run')}"
    speedup = bloom["median_s"] / result["median_s"]
    memory = result["peak_mem_bytes"] / bloom["peak_mem_bytes"] if bloom["peak_mem_bytes"] > 0 else float("inf")
    met = speedup >= speedup_min and memory <= memory_max
    return ("met" if met else "not met"), f"{speedup:.2f}x faster, {memory:.2f}x its memory"


def evaluate_targets(cells: list[dict], contestant: str) -> list[dict]:
    """Issue 4's targets for one ALiBi contestant: one row each, status `met`, `not met` or `n/a` and the numbers."""
    checks = []  # (target, suite, cell match, check(result, cell results) -> (status, detail))
    for length in (512, 1024):
        checks.append((f"train step L={length} <= 1.10x {REFERENCE}", "train", {"length": length},
                       lambda r, rs: _ratio_target(r, "time_ratio", 1.10)))
    checks.append((f"forward L=8192 <= 1.3x {REFERENCE} time", "forward", {"length": 8192},
                   lambda r, rs: _ratio_target(r, "time_ratio", 1.3)))
    for length in (8192, 16384):
        checks.append((f"peak memory L={length} <= 1.25x {REFERENCE}", "forward", {"length": length},
                       lambda r, rs: _ratio_target(r, "mem_ratio", 1.25)))
    for length in (4096, 8192):
        checks.append((f"forward L={length} >= 3x faster than bloom-eager, < 0.5x its memory", "forward",
                       {"length": length}, lambda r, rs: _bloom_target(r, rs.get("bloom-eager", {}))))
    if contestant == "alibi-from-bloom":  # issue 8: BLOOM's own weights, imported
        checks.append(("forward L=8192 >= 4x faster than bloom-eager, <= 1/8 its memory", "forward", {"length": 8192},
                       lambda r, rs: _bloom_target(r, rs.get("bloom-eager", {}), 4, 1 / 8)))
        for length in (16384, 32768):
            checks.append((f"forward L={length} runs", "forward", {"length": length},
                           lambda r, rs: ("met", f"{r['median_s']:.2f} s")))
    for batch in (1, 8):
        checks.append((f"decode tokens/s batch {batch} >= 0.95x {REFERENCE}", "generate", {"batch": batch},
                       lambda r, rs: _ratio_target(r, "throughput_ratio", 0.95, at_least=True)))
    rows = []
    for target, suite, match, check in checks:
        cell = _find(cells, suite, **match)
        result = cell["results"].get(contestant, {}) if cell else {}
        if cell is None:
            status, detail = "n/a", "not measured"
        elif result.get("status") != OK:
            status, detail = "n/a", f"{contestant}: {result.get('status', 'not run')}"
        else:
            status, detail = check(result, cell["results"])
        rows.append({"target": target, "contestant": contestant, "status": status, "detail": detail})
    return rows


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
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
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
    if cell["suite"] == "generate":
        tokens = "?" if result["tokens_per_s"] is None else f"{result['tokens_per_s']:.1f}"
        speed = f"{tokens} tok/s · {_ratio(result['throughput_ratio'])}"
    elif cell["suite"] == "train":
        speed = f"{result['median_s']:.3f} s ({result['tokens_per_s']:.0f} tok/s) · {_ratio(result['time_ratio'])}"
    else:
        speed = f"{result['median_s']:.3f} s · {_ratio(result['time_ratio'])}"
    return f"{speed} · {_bytes(result['peak_mem_bytes'])} · {_ratio(result['mem_ratio'])}"


SUITE_TITLES = {
    "train": "Training step ({optimizer}): median time per step (tokens/s) · time ratio · peak memory growth (activations and "
    "gradients) · memory ratio",
    "forward": "Inference forward (no_grad, `logits_to_keep=1`, no cache): median time · time ratio · peak memory "
    "growth · memory ratio",
    "generate": "Generation (greedy, left-padded, cache): decode tokens/s · tokens/s ratio · peak memory growth of "
    "the whole generate call · memory ratio",
}


def render_markdown(report: dict) -> str:
    machine, settings = report["machine"], report["settings"]
    names = report["contestants"]
    lines = [
        "# hf_alibi benchmark (issue 4)",
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
        f"every dropout 0, random init. Timing: {settings['warmup']} warm-up call(s), then {settings['repeats']} "
        f"repeats interleaved across contestants (ABCABC...), median. Ratios are against `{REFERENCE}` in the same "
        f"cell. Memory: {settings['memory_method']}.",
    ]
    for suite in settings["suites"]:
        cells = [cell for cell in report["cells"] if cell["suite"] == suite]
        if not cells:
            continue
        lines += ["", "## " + SUITE_TITLES[suite].format(optimizer=settings["optimizer_description"]), ""]
        lines.append("| measurement | " + " | ".join(f"`{name}`" for name in names) + " |")
        lines.append("|---" * (len(names) + 1) + "|")
        for cell in cells:
            row = [format_result(cell, cell["results"].get(name, {})) for name in names]
            lines.append(f"| {cell['name']} | " + " | ".join(row) + " |")
    if report["targets"]:
        alibi = sorted({row["contestant"] for row in report["targets"]}, key=names.index)
        lines += ["", "## Issue 4 targets", "", "| target | " + " | ".join(f"`{n}`" for n in alibi) + " |",
                  "|---" * (len(alibi) + 1) + "|"]
        for target in dict.fromkeys(row["target"] for row in report["targets"]):
            by_name = {row["contestant"]: row for row in report["targets"] if row["target"] == target}
            cells = [f"{by_name[n]['status']} ({by_name[n]['detail']})" for n in alibi]
            lines.append(f"| {target} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` via a temporary file in the same folder and `os.replace`: readers never see half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
