"""Certified key skipping (`alibi_skip_eps`) on a trained checkpoint: forward and decoding against GPT-2 SDPA and
our dense path, in fresh interleaved processes, with the certified kept fraction per head beside every figure.

    python -m benchmarks.bench_skip --checkpoint runs/cpu_demo/alibi/final             # writes results/skip/bench.{json,md}
    python -m benchmarks.bench_skip --checkpoint runs/cpu_demo/alibi/final --forward 2048 --decode 0 \
        --processes 1 --repeats 1 --out /tmp/skip_smoke                                      # smoke, ~20 s
    python -m benchmarks.bench_skip --forward 0 --decode 0 --train 4096,8192 --out results/skip/training_step_4k_8k
    python -m benchmarks.bench_skip --forward 0 --decode 0 --cb-decode 16384,32768 --packed-train 8192,16384 \
        --processes 2 --repeats 1 --out results/skip/auto_cb_decode_packed_train

Contestants: `gpt2-sdpa` (transformers' GPT-2, learned positions, the checkpoint's width, depth, heads and
vocabulary, random weights: dense cost does not depend on them), `alibi-dense` (the checkpoint,
`alibi_skip_eps=0`), `alibi-skip` (the checkpoint, `alibi_skip_eps=--eps`) and `alibi-auto` (the checkpoint with
the default, `alibi_skip_eps="auto"`: skipping where its rule says it pays, dense elsewhere). Inputs are real text:
the recipe's held-out standard-library documents in the checkpoint's own tokenizer (what the certificate's gain
depends on; random ids would say little). Forward: batch 1, no grad, no cache, `logits_to_keep=1`. Decoding: a static cache (its steps
copy nothing: a dynamic cache's concatenation costs more than attention at these widths), one prefill untimed,
then calls of `--steps` greedy steps each, timed per step; tokens are checked equal to the dense path's. Training
(`--train`): one step is a forward with `labels` and its backward (gradients zeroed, no optimizer), the model in
train mode (the checkpoint's dropouts are 0, so the split and its skipping serve it); the process's peak resident
memory is reported beside it (`alibi-auto` skips in training where its rule says it pays, as at inference). Each
process builds one contestant, warms up once and times `--repeats` calls (median); processes rotate over
contestants, `--processes` rounds; a cell reports the median over processes and [min, max]. The skipping process
also reports the kept fraction of causal key work per head: the key ranges its layers certified and used, recorded
in one more forward.
Two suites hold `"auto"` to dense where `generate()` is not the caller (`alibi-dense` and `alibi-auto`; a packed row
also against `gpt2-sdpa`, whose one document mask spans the whole row):
`--cb-decode`, continuous batching (`generate_batch`, what `hf-alibi serve --continuous-batching` runs) of the long
context and a 128-token request side by side, seconds per decoding step of the long one from its token timestamps
(its prefill, in 4096-token chunks, not counted; tokens checked equal to dense); `--packed-train`, a training step on
one packed row (`DataCollatorWithFlattening`'s layout: documents of 1/2, 1/4, 1/8 and 1/8 of the row, positions
restarting, each document's first label -100).
Run alone: two cores, any other load shows in the figures.

Under load (`--load N`): N busy processes (`benchmarks.measure.competing_load`) run beside each contestant's process
for its whole life, and `--threads T` gives every contestant T torch threads (default: torch's own, one per core):
what "auto" meets on a shared machine. The 1-minute load average at each process's start is recorded beside the
figures. `--contestants` picks a subset (e.g. `alibi-dense,alibi-auto`: auto against dense, side by side).

    python -m benchmarks.bench_skip --checkpoint runs/cpu_demo/alibi/final --forward 2048,8192,32768 --decode 0 \
        --contestants gpt2-sdpa,alibi-dense,alibi-auto --load 2 --out results/skip/auto_under_load
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.skip_worker import AUTO_SUITES, REFERENCES, child, is_encoder

CONTESTANTS = ("gpt2-sdpa", "bert-sdpa", "alibi-dense", "alibi-skip", "alibi-auto")
# glibc returns the top of its heap to the kernel when a free leaves more than its (adaptive) trim threshold there;
# the MLP's 16 MiB activations at 8k then fault their pages in again in the next layer (~1 us per 4 KiB page). How
# often depends on where each process's earlier allocations landed: 0 to 120k faults per 8k forward measured, for
# GPT-2 and hf_alibi alike. A fixed mmap threshold and no trimming (what jemalloc or tcmalloc, PyTorch's advice for
# CPU inference, do anyway) take that out of every contestant's figures; the default leaves it in.
NO_TRIM = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def run_cell(args, suite: str, length: int) -> dict:
    from benchmarks.measure import competing_load

    contestants = AUTO_SUITES.get(suite, args.contestants)
    results, load_averages = {name: [] for name in contestants}, []
    for round_ in range(args.processes):
        turn = round_ % len(contestants)
        order = contestants[turn:] + contestants[:turn]  # rotate who goes first
        for name in order:
            command = [sys.executable, "-m", "benchmarks.bench_skip", "--child", name, "--suite", suite]
            command += ["--length", str(length), "--checkpoint", args.checkpoint, "--eps", str(args.eps)]
            command += ["--repeats", str(args.repeats), "--steps", str(args.steps), "--threads", str(args.threads)]
            command += ["--native-flush"] if args.native_flush else []
            env = {**os.environ, **(NO_TRIM if args.no_trim else {})}
            with competing_load(args.load):
                load_averages.append(os.getloadavg()[0])
                done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            line = done.stdout.strip().splitlines()[-1]
            results[name].append(json.loads(line))
    cell = {
        "suite": suite,
        "length": length,
        "load": args.load,
        "load_average": [min(load_averages), max(load_averages)],
    }
    for name, runs in results.items():
        times = [r["median_s"] for r in runs]
        cell[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
        if "peak_bytes" in runs[0]:
            cell[name]["peak_bytes"] = statistics.median(r["peak_bytes"] for r in runs)
        if "kept_per_head" in runs[0]:
            cell[name]["kept_per_head"] = runs[0]["kept_per_head"]
        if "threads" in runs[0]:
            cell[name]["threads"] = runs[0]["threads"]
    if suite in ("decode", "cb_decode") and "alibi-dense" in results:
        dense = results["alibi-dense"][0]["tokens"]
        others = results.get("alibi-skip", []) + results.get("alibi-auto", [])
        cell["same_tokens"] = all(r["tokens"] == dense for r in others)
    return cell


def auto_markdown(cells: list[dict]) -> list[str]:
    """The `"auto"`-against-dense suites' table (GPT-2's column where the suite ran it: `-` elsewhere)."""
    names = ("gpt2-sdpa", "alibi-dense", "alibi-auto")
    lines = ["", "| cell | " + " | ".join(f"`{n}`" for n in names) + " | auto / dense | auto / GPT-2 | |"]
    lines.append("|---" * 7 + "|")
    for cell in cells:
        unit, scale = ("ms per decoding step", 1e3) if cell["suite"] == "cb_decode" else ("s per step", 1.0)
        ran = [n for n in names if n in cell]
        shown = [
            f"{cell[n]['median_s'] * scale:.3f} [{cell[n]['min_s'] * scale:.3f}, {cell[n]['max_s'] * scale:.3f}]"
            if n in cell
            else "-"
            for n in names
        ]
        auto = cell["alibi-auto"]["median_s"]
        ratios = [f"{auto / cell[n]['median_s']:.2f}x" if n in cell else "-" for n in ("alibi-dense", "gpt2-sdpa")]
        extra = (
            f"tokens equal dense: {cell['same_tokens']}"
            if "same_tokens" in cell
            else "peak " + " / ".join(f"{cell[n]['peak_bytes'] / 2**20:.0f}" for n in ran) + " MiB"
        )
        lines.append(f"| {cell['suite']} L={cell['length']} ({unit}) | {' | '.join(shown + ratios)} | {extra} |")
    return lines


def dense_row(cell: dict, names, reference: str, ratios, kept, unit: dict) -> list[str]:
    """One row of the contestants' table: each contestant's time [min, max] and ratio, the ratios, kept work, load."""
    scale = 1e3 if cell["suite"] == "decode" else 1.0

    def show(name):
        r = cell[name]
        peak = f" · {r['peak_bytes'] / 2**20:.0f} MiB peak" if "peak_bytes" in r else ""
        return (
            f"{r['median_s'] * scale:.3f} [{r['min_s'] * scale:.3f}, {r['max_s'] * scale:.3f}] · "
            f"{r['median_s'] / cell[reference]['median_s']:.2f}x{peak}"
        )

    def kept_by(name):
        return ", ".join(f"{k:.3f}" for k in cell[name].get("kept_per_head", [])) or "dense"

    if cell["suite"] == "forward":
        extra = "; ".join(kept_by(name) for name in kept)
    else:
        extra = f"tokens equal dense: {cell['same_tokens']}" if "same_tokens" in cell else ""
    low, high = cell.get("load_average", (float("nan"),) * 2)
    return [
        f"{cell['suite']} L={cell['length']} ({unit[cell['suite']]})",
        *(show(name) for name in names),
        *(f"{cell[a]['median_s'] / cell[b]['median_s']:.2f}x" for a, b in ratios),
        extra,
        f"{low:.1f}-{high:.1f}",
    ]


def markdown(cells: list[dict], args) -> str:
    unit = {"forward": "s per forward", "decode": "ms per token", "train": "s per step"}
    allocator = "glibc without heap trimming (`--no-trim`)" if args.no_trim else "default glibc malloc"
    names = args.contestants
    reference = next((name for name in names if name in REFERENCES), names[0])
    ratios = [(a, b) for a, b in (("alibi-skip", "alibi-dense"), ("alibi-auto", "alibi-dense")) if {a, b} <= set(names)]
    kept = [name for name in ("alibi-skip", "alibi-auto") if name in names]
    threads = f"{args.threads} torch threads" if args.threads else "torch's default threads"
    load = f"{args.load} busy competing processes beside each" if args.load else "no added load"
    header = [
        "cell",
        *(f"`{name}`" for name in names),
        *(f"{a[6:]} / {b[6:]}" for a, b in ratios),
        f"kept per head ({'; '.join(name[6:] for name in kept)})",
        "load average (1 min)",
    ]
    lines = [
        f"Checkpoint `{args.checkpoint}`, eps {args.eps:g}, {allocator}, {threads}, {load}; {args.processes} fresh "
        f"processes per contestant, {args.repeats} timed call(s) each (median); ratios of medians against "
        f"`{reference}`.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    dense_suites = [cell for cell in cells if cell["suite"] not in AUTO_SUITES]
    if not dense_suites:  # only the auto-against-dense suites: their table alone
        lines = [lines[0].replace(f"against `{reference}`", "of `alibi-auto` to `alibi-dense`"), ""]
    for cell in dense_suites:
        lines.append("| " + " | ".join(dense_row(cell, names, reference, ratios, kept, unit)) + " |")
    auto_cells = [cell for cell in cells if cell["suite"] in AUTO_SUITES]  # their own table, after the dense one
    lines += auto_markdown(auto_cells) if auto_cells else []
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, its contestants and process counts checked (a ValueError names the bad value)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final", help="a trained ALiBi checkpoint folder")
    parser.add_argument("--forward", default="2048,8192,32768,65536", help="forward lengths (comma-separated)")
    parser.add_argument("--decode", help="decoding context lengths; 0: none (default 8192,16384,32768; 0 for encoders)")
    parser.add_argument("--train", default="0", help="training step lengths (forward + backward); 0: none")
    parser.add_argument("--cb-decode", default="0", help="continuous-batching decoding contexts; 0: none")
    parser.add_argument("--packed-train", default="0", help="packed-row training step lengths; 0: none")
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16, help="decoding steps timed per call")
    parser.add_argument(
        "--no-trim",
        action="store_true",
        help="every contestant's process with glibc's heap kept "
        "(NO_TRIM): no page faults from trimming, whose count depends on each process's heap layout",
    )
    parser.add_argument(
        "--native-flush",
        action="store_true",
        help="every process runs inside "
        "hf_alibi.native_flush.flushing_denormals() (the opt-in switch: denormals flushed on every thread)",
    )
    parser.add_argument(
        "--contestants",
        help=f"comma-separated subset of {', '.join(CONTESTANTS)} (default: all but the other kind's reference)",
    )
    parser.add_argument("--load", type=int, default=0, help="busy processes run beside each contestant's process")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per contestant (0: torch's default)")
    parser.add_argument("--out", default="results/skip/bench", help="writes <out>.json and <out>.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--suite", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    encoder = args.child is None and is_encoder(args.checkpoint)  # an encoder: bidirectional rows, no decoding
    reference = "bert-sdpa" if encoder else "gpt2-sdpa"
    mine = [name for name in CONTESTANTS if name not in REFERENCES or name == reference]
    args.contestants = tuple(args.contestants.split(",")) if args.contestants else tuple(mine)
    if not args.contestants or not set(args.contestants) <= set(CONTESTANTS):
        raise ValueError(
            f"--contestants must name some of {', '.join(CONTESTANTS)}, got {','.join(args.contestants)!r}"
        )
    args.decode = args.decode if args.decode is not None else ("0" if encoder else "8192,16384,32768")
    decodes = [n for n in (args.decode, args.cb_decode, args.packed_train) if any(int(x) for x in n.split(",") if x)]
    if encoder and decodes:
        raise ValueError(f"{args.checkpoint} is an encoder: --decode, --cb-decode and --packed-train serve causal LMs")
    if args.load < 0 or args.threads < 0:
        raise ValueError(f"--load and --threads must be >= 0, got {args.load} and {args.threads}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        args.contestant = args.child
        from hf_alibi.native_flush import flushing_denormals

        with flushing_denormals() if args.native_flush else contextlib.nullcontext():
            print(json.dumps(child(args)))
        return
    from hf_alibi.atomic_files import write_text_atomically  # the parent only: children load just their model

    cells = [
        (suite, int(n))
        for suite, lengths in (
            ("forward", args.forward),
            ("decode", args.decode),
            ("train", args.train),
            ("cb_decode", args.cb_decode),
            ("packed_train", args.packed_train),
        )
        for n in lengths.split(",")
        if n and int(n)
    ]
    results = []
    for suite, length in cells:
        results.append(run_cell(args, suite, length))
        print(json.dumps(results[-1]), flush=True)
        out = Path(args.out)
        write_text_atomically(out.with_suffix(".json"), json.dumps({"command": sys.argv, "cells": results}, indent=1))
        write_text_atomically(out.with_suffix(".md"), markdown(results, args))


if __name__ == "__main__":
    main()
