"""The harness of `bench_alibi`: its measurement cells, one worker process per contestant (`worker.Worker`), the
interleaved repeats or the rounds of fresh processes, and the report they make (`bench_alibi`'s docstring says how
each is measured).
"""

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from . import report as reporting
from .contestants import ALIBI_BACKENDS, unsupported_reason
from .targets import evaluate_targets
from .worker import Worker, WorkerFailure


def plan_cells(args) -> list[dict]:
    """The measurement cells in run order; `scale` orders the sizes within a suite (for skipping after OOM)."""
    cells = []
    for suite in args.suites:
        if suite == "train":  # the all-ones mask cells are what Trainer sends (its collator's attention_mask)
            for length, batch in args.train_shapes:
                for mask in args.train_masks:
                    name = f"train L={length} B={batch}" + (" mask=ones" if mask == "ones" else "")
                    cells.append(
                        {
                            "suite": suite,
                            "name": name,
                            "length": length,
                            "batch": batch,
                            "mask": mask,
                            "scale": length * batch,
                        }
                    )
        elif suite == "forward":
            for length in args.lengths:
                cells.append(
                    {"suite": suite, "name": f"forward L={length} B=1", "length": length, "batch": 1, "scale": length}
                )
        else:
            for batch in args.gen_batches:
                cells.append(
                    {
                        "suite": suite,
                        "name": f"generate B={batch} prefill {args.prefill} decode {args.decode}",
                        "batch": batch,
                        "prefill": args.prefill,
                        "decode": args.decode,
                        "scale": batch,
                    }
                )
    return cells


class Bench:
    """Runs the plan: one worker per contestant, restarted lazily after it dies."""

    def __init__(self, args, log_dir: Path):
        self.args, self.log_dir = args, log_dir
        self.workers: dict[str, Worker] = {}
        self.ready: dict[str, dict] = {}
        self.failed_at: dict[tuple[str, str], tuple[int, str]] = {}  # (contestant, suite) -> (scale, what)
        self.unbuildable: dict[str, dict] = {}  # contestant -> its failed start: never retried

    def _spec(self, name: str) -> dict:
        a = self.args
        return {
            "contestant": name,
            "shape": asdict(a.shape),
            "max_length": a.max_length,
            "device": a.device,
            "dtype": a.dtype,
            "threads": a.threads,
            "optimizer": a.optimizer,
            "native_flush": a.native_flush,
            "memory_limit_bytes": int(a.memory_limit_gb * 2**30) if a.device == "cpu" else 0,
        }

    def start(self, names: list[str]) -> dict[str, dict]:
        """Start the workers of `names` concurrently; returns the failures (contestant -> result)."""
        failures = {name: dict(self.unbuildable[name]) for name in names if name in self.unbuildable}
        names = [name for name in names if name not in failures]
        for name in names:
            if name not in self.workers or not self.workers[name].alive():
                if name in self.workers:
                    self.workers[name].close()  # the dead one's log handle
                argv = [sys.executable, "-m", "benchmarks.bench_alibi", "--worker", json.dumps(self._spec(name))]
                self.workers[name] = Worker(argv, self.log_dir / f"{name}.log")
                self.ready.pop(name, None)
        for name in names:
            if name in self.ready:
                continue
            try:
                self.ready[name] = self.workers[name].receive(max(self.args.timeout, 600))
            except WorkerFailure as failure:
                failures[name] = {"status": failure.status, "reason": f"while building the model: {failure.reason}"}
                self.unbuildable[name] = failures[name]
        return failures

    def _ask(self, name: str, message: dict, results: dict, cell: dict, calls: int = 1) -> dict | None:
        try:
            answer = self.workers[name].request(message, self.args.timeout * calls)
        except WorkerFailure as failure:
            answer = {"ok": False, "status": failure.status, "reason": failure.reason}
        if answer["ok"]:
            return answer
        results[name] = {"status": answer["status"], "reason": answer["reason"]}
        if answer["status"] in ("oom", "timeout", "crashed"):
            self.failed_at[(name, cell["suite"])] = (cell["scale"], f"{answer['status']} at {cell['name']}")
        return None

    def run_cell(self, cell: dict, names: list[str]) -> dict:
        results, active = {}, []
        for name in names:
            reason = unsupported_reason(name, cell["suite"], self.args.device)
            earlier = self.failed_at.get((name, cell["suite"]))
            if reason:
                results[name] = {"status": "unsupported", "reason": reason}
            elif earlier and cell["scale"] >= earlier[0]:
                results[name] = {"status": "skipped", "reason": earlier[1]}
            else:
                active.append(name)
        results.update(self.start(active))
        active = [name for name in active if name not in results]
        request = {k: v for k, v in cell.items() if k != "name"}
        for name in list(active):
            prepare = {"op": "prepare", "cell": request, "warmup": self.args.warmup}
            answer = self._ask(name, prepare, results, cell, calls=self.args.warmup + 1)
            if answer is None:
                active.remove(name)
                continue
            results[name] = {
                "status": reporting.OK,
                "peak_mem_bytes": answer["peak_mem_bytes"],
                "mem_method": answer["mem_method"],
            }
            for key in ("seconds", "prefill_s", "total_s"):
                results[name][key] = []
        for _ in range(self.args.repeats):
            for name in list(active):
                time.sleep(self.args.settle)  # let the previous worker's OpenMP threads go idle
                answer = self._ask(name, {"op": "time"}, results, cell)
                if answer is None:
                    active.remove(name)
                    continue
                for key in ("seconds", "prefill_s", "total_s"):
                    if key in answer:
                        results[name][key].append(answer[key])
                if self.args.processes and "process_peak_bytes" in answer:  # one cell per process: its own peak
                    results[name]["process_peak_bytes"] = answer["process_peak_bytes"]
        for result in results.values():
            for key in ("seconds", "prefill_s", "total_s"):
                if not result.get(key):
                    result.pop(key, None)
            reporting.summarise(cell, result)
        reporting.add_ratios(results, self.args.reference)
        return results

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()

    def run_cell_in_processes(self, cell: dict, names: list[str], round_index: int) -> dict:
        """One round of `--processes`: every contestant measures `cell` in a fresh process, which then exits.

        The contestants' order rotates with the round (A B C, B C A, ...), so no one always runs first.
        """
        shift = round_index % len(names)
        results = self.run_cell(cell, names[shift:] + names[:shift])
        self.close()  # the next cell (or round) starts every worker afresh
        self.workers = {}  # `ready` keeps each one's last announcement, for the report
        return {name: results[name] for name in names}


def build_report(args, cells: list[dict], bench: Bench) -> dict:
    cells = [cell for cell in cells if "results" in cell]  # a partial report holds the cells done so far
    ready = next(iter(bench.ready.values()), {})
    threads = sorted({info["threads"] for info in bench.ready.values()})
    memory = next((r["mem_method"] for c in cells for r in c.get("results", {}).values() if "mem_method" in r), "?")
    optimizer = "forward + backward + SGD step" if args.optimizer == "sgd" else "forward + backward, no optimizer step"
    alibi = [name for name in args.contestants if name in ALIBI_BACKENDS]
    report = {
        "schema": "hf_alibi.benchmark/1",
        "command": args.command,
        "machine": reporting.machine_description(
            args.device,
            threads[0] if len(threads) == 1 else threads or args.threads,
            ready.get("device_name"),
            ready.get("torch"),
        ),
        "settings": {
            "shape": asdict(args.shape),
            "dtype": args.dtype,
            "device": args.device,
            "suites": args.suites,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "processes": args.processes,
            "optimizer": args.optimizer,
            "reference": args.reference,
            "optimizer_description": optimizer,
            "memory_method": f"{memory}, the peak growth over the state just before the call (model weights excluded)",
            "max_length": args.max_length,
            "timeout_s": args.timeout,
            "memory_limit_gb": args.memory_limit_gb if args.device == "cpu" else None,
        },
        "contestants": args.contestants,
        "workers": bench.ready,
        "cells": cells,
        "targets": [row for name in alibi for row in evaluate_targets(cells, name, args.targets, args.reference)],
        "target_set": args.targets,
    }
    return report


def log_cell(cell: dict) -> None:
    """One line per contestant of a measured cell, on stderr."""
    for name, result in cell["results"].items():
        print(f"[bench]   {name}: {reporting.format_result(cell, result)}", file=sys.stderr, flush=True)


def run_in_processes(args, cells: list[dict], bench: Bench) -> None:
    """`--processes N`: N rounds; in each, every cell in every contestant's own fresh process (see `Bench`).

    Rounds go over all cells before the next round starts, so slow drifts of the machine spread over all of them;
    each cell's result combines its N processes (`report.combine_processes`) and is rewritten after every round.
    """
    from hf_alibi.atomic_files import write_text_atomically  # not at the top: workers import this module

    rounds = {id(cell): [] for cell in cells}
    for round_index in range(args.processes):
        for cell in cells:
            print(f"[bench] round {round_index + 1}/{args.processes}: {cell['name']}", file=sys.stderr, flush=True)
            rounds[id(cell)].append(bench.run_cell_in_processes(cell, args.contestants, round_index))
            cell["results"] = reporting.combine_processes(cell, rounds[id(cell)], args.reference)
            log_cell(cell)
            if args.out:
                write_text_atomically(args.out, json.dumps(build_report(args, cells, bench), indent=1))
