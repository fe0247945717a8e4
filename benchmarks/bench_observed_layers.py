"""What a hook on the attention modules costs a long forward: the layer in rows unobserved (the norm on c_attn's rows,
the residual and MLP added into the attention's output) against the same model with a no-op forward hook on every
attention module (the norm's whole output and the block's own, as hooks see them), paired in one process per length.

    python -m benchmarks.bench_observed_layers --checkpoint runs/cpu_demo/alibi/final \
        --lengths 16384,32768,65536 --processes 2 --repeats 6 --out results/length_scaling/observed_layers

Per length, `--processes` fresh processes; in each, the two alternate forward by forward (the order flipped every
round), so that the host's drift and the process's memory placement fall on both alike: the min and the median of
each, and the median of the per-round ratios (unobserved / hooked), over every process. The forward is the length
benchmark's (`bench_length_scaling`: held-out text, the default `"auto"`, batch 1, no grad, the all-ones mask,
`logits_to_keep=1`). Working memory: `bench_length_scaling` (one path per tree).
"""

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks.bench_length_scaling import command_line, write_report


def child(args) -> dict:
    """One length in this process: both paths' forward times, alternated."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_alibi  # noqa: F401  (registers the ALiBi classes)
    from benchmarks.measure import timed
    from benchmarks.skip_worker import text_ids

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    ids = text_ids(args.checkpoint, args.length)  # (1, L)
    ones = torch.ones_like(ids)
    forward = lambda: model(ids, attention_mask=ones, logits_to_keep=1)  # noqa: E731
    attention = [block.attn for block in model.transformer.h]

    def hooked():
        handles = [module.register_forward_hook(lambda *_: None) for module in attention]
        try:
            return timed(forward)[0]
        finally:
            for handle in handles:
                handle.remove()

    paths = {"unobserved": lambda: timed(forward)[0], "hooked": hooked}
    seconds = {name: [] for name in paths}
    with torch.no_grad():
        for path in paths.values():  # warm-up
            path()
        for round_ in range(args.repeats):
            for name in list(paths) if round_ % 2 == 0 else list(paths)[::-1]:
                seconds[name].append(paths[name]())
    return {"length": args.length, "seconds": seconds}


def markdown(cells: list[dict], command: str) -> str:
    lines = [
        "# A long forward with and without a hook on the attention modules",
        "",
        f"Command: `{command}`. Times in seconds over every process's forwards; the ratio is the median of the paired",
        "rounds' unobserved / hooked times (below 1: the unobserved rows are faster).",
        "",
        "| tokens | unobserved, min | median | hooked, min | median | paired ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for cell in cells:
        free, hooked = cell["seconds"]["unobserved"], cell["seconds"]["hooked"]
        ratio = statistics.median(a / b for a, b in zip(free, hooked))
        lines.append(
            f"| {cell['length']:,} | {min(free):.3f} | {statistics.median(free):.3f} | {min(hooked):.3f} | "
            f"{statistics.median(hooked):.3f} | {ratio:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final")
    parser.add_argument("--lengths", default="16384,32768,65536")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.processes < 1 or args.repeats < 1 or not lengths or min(lengths) < 1:
        raise SystemExit(f"--processes and --repeats must be at least 1 and --lengths positive, got {vars(args)}")
    cells = []
    for length in lengths:
        runs = []
        for _ in range(args.processes):
            command = [sys.executable, "-m", "benchmarks.bench_observed_layers", "--child", "--length", str(length)]
            done = subprocess.run(
                command + ["--checkpoint", args.checkpoint, "--repeats", str(args.repeats)],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                raise RuntimeError(f"length {length} failed:\n{done.stderr[-3000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        seconds = {name: sum((run["seconds"][name] for run in runs), []) for name in ("unobserved", "hooked")}
        cells.append({"length": length, "seconds": seconds})
        print(json.dumps(cells[-1]), flush=True)
    command = command_line(argv, "benchmarks.bench_observed_layers")
    text = markdown(cells, command)
    if args.out:
        write_report(args.out, {"command": command, "cells": cells}, text)  # (printed there too)
    else:
        print(text)


if __name__ == "__main__":
    main()
