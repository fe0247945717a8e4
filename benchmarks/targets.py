"""The targets a `bench_alibi` run holds its ALiBi contestants to: the overhead budgets (`budget_targets`) or parity
with the reference (`parity_targets`), each read from the cells' ratios (`report.add_ratios`) by `evaluate_targets`.
"""

from collections.abc import Callable
from typing import NamedTuple

from .contestants import REFERENCE
from .report import OK


def _find(cells: list[dict], suite: str, **match) -> dict | None:
    for cell in cells:
        if cell["suite"] == suite and all(cell.get(key) == value for key, value in match.items()):
            return cell
    return None


def _ratio_target(result: dict, key: str, limit: float, at_least: bool = False) -> tuple[str, str]:
    value = result.get(key)
    if value is None:
        return "n/a", "no reference result"
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


def _within(result: dict, limit: float) -> tuple[str, str]:
    """Time and whole-process peak memory (peak growth without `--processes`) both <= `limit` x the reference."""
    memory_key = "process_mem_ratio" if "process_mem_ratio" in result else "mem_ratio"
    time_ratio, memory_ratio = result.get("time_ratio"), result.get(memory_key)
    if time_ratio is None or memory_ratio is None:
        return "n/a", "no reference result"
    met = time_ratio <= limit and memory_ratio <= limit
    memory = "whole-process peak" if memory_key == "process_mem_ratio" else "peak growth"
    return ("met" if met else "not met"), f"time {time_ratio:.3f}x, {memory} {memory_ratio:.3f}x"


def _bloom_slower(result: dict, bloom: dict, factor: float = 3) -> tuple[str, str]:
    if bloom.get("status") == "oom":
        return "met", "bloom-eager ran out of memory"
    if bloom.get("status") != OK:
        return "n/a", f"bloom-eager: {bloom.get('status', 'not run')}"
    slower = bloom["median_s"] / result["median_s"]
    return ("met" if slower >= factor else "not met"), f"bloom-eager {slower:.2f}x our time"


class Target(NamedTuple):
    """One target to check: its name, the suite and cell (`match`) it reads, and `check(result, cell results)`,
    which returns (status, detail)."""

    name: str
    suite: str
    match: dict
    check: Callable[[dict, dict], tuple[str, str]]


def _ratio_check(key: str, limit: float, at_least: bool = False) -> Callable[[dict, dict], tuple[str, str]]:
    return lambda result, results: _ratio_target(result, key, limit, at_least)


def _vs_bloom(speedup_min: float = 3, memory_max: float = 0.5) -> Callable[[dict, dict], tuple[str, str]]:
    return lambda result, results: _bloom_target(result, results.get("bloom-eager", {}), speedup_min, memory_max)


def _runs(result: dict, results: dict) -> tuple[str, str]:
    return "met", f"{result['median_s']:.2f} s"


def parity_targets(cells: list[dict], reference: str = REFERENCE) -> list[Target]:
    """Parity: within 1.05x of the reference in time and whole-process peak memory; BLOOM >= 3x slower from 4k."""
    targets = []
    for cell in cells:
        name, suite, length = cell["name"], cell["suite"], cell.get("length")
        if suite == "forward" and 512 <= length <= 32768 or suite == "train" and 128 <= length <= 2048:
            targets.append(Target(f"{name} within 1.05x {reference}", suite, {"name": name}, _within_check))
        if suite == "forward" and length >= 4096 and "bloom-eager" in cell["results"]:
            targets.append(Target(f"{name}: bloom-eager >= 3x slower", suite, {"length": length}, _bloom_slower_check))
    return targets


def _within_check(result: dict, results: dict) -> tuple[str, str]:
    return _within(result, 1.05)


def _bloom_slower_check(result: dict, results: dict) -> tuple[str, str]:
    return _bloom_slower(result, results.get("bloom-eager", {}))


def evaluate_targets(
    cells: list[dict], contestant: str, which: str = "budget", reference: str = REFERENCE
) -> list[dict]:
    """Targets (`budget` or `parity`) for one ALiBi contestant: one row each, `met`/`not met`/`n/a` and numbers;
    the cells' ratios must be against `reference` (`add_ratios`)."""
    targets = parity_targets(cells, reference) if which == "parity" else budget_targets(contestant, reference)
    rows = []
    for target, suite, match, check in targets:
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


def budget_targets(contestant: str, reference: str = REFERENCE) -> list[Target]:
    """Overhead budgets: training <= 1.10x, forward <= 1.3x time and <= 1.25x memory at 8k-16k, BLOOM >= 3x slower,
    decoding >= 0.95x (and BLOOM's own weights for `alibi-from-bloom`)."""
    train, forward, generate = "train", "forward", "generate"
    targets = [
        Target(f"train step L={n} <= 1.10x {reference}", train, {"length": n}, _ratio_check("time_ratio", 1.10))
        for n in (512, 1024)
    ]
    targets.append(
        Target(f"forward L=8192 <= 1.3x {reference} time", forward, {"length": 8192}, _ratio_check("time_ratio", 1.3))
    )
    targets += [
        Target(f"peak memory L={n} <= 1.25x {reference}", forward, {"length": n}, _ratio_check("mem_ratio", 1.25))
        for n in (8192, 16384)
    ]
    targets += [
        Target(f"forward L={n} >= 3x faster than bloom-eager, < 0.5x its memory", forward, {"length": n}, _vs_bloom())
        for n in (4096, 8192)
    ]
    if contestant == "alibi-from-bloom":  # BLOOM's own weights, imported
        name = "forward L=8192 >= 4x faster than bloom-eager, <= 1/8 its memory"
        targets.append(Target(name, forward, {"length": 8192}, _vs_bloom(4, 1 / 8)))
        targets += [Target(f"forward L={n} runs", forward, {"length": n}, _runs) for n in (16384, 32768)]
    decode = _ratio_check("throughput_ratio", 0.95, at_least=True)
    targets += [
        Target(f"decode tokens/s batch {b} >= 0.95x {reference}", generate, {"batch": b}, decode) for b in (1, 8)
    ]
    return targets
