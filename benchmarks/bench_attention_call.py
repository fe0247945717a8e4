"""One attention call, ALiBi paths against plain causal SDPA: guides the split's chunk size.

    python -m benchmarks.bench_attention_call --lengths 4096,16384 --chunks 256,1024/256,1024/256/64 --repeats 5
    python -m benchmarks.bench_attention_call --lengths 256 --chunks 64 --repeats 1 --threads 1      # smoke
    python -m benchmarks.bench_attention_call --lengths 4096 --memory                               # peak RSS

Contestants on (B, H, L, D) fp32 inputs: `causal` (F.scaled_dot_product_attention, is_causal=True, no bias: the
target), `bank` (the plan's `sdpa_bank` path, bank built once as in a forward), `split-N/n` (`sdpa_alibi_split`
with chunks=(N, n)). Times are medians of `--repeats` rounds, each round timing every contestant once in turn
(interleaved), with the ratio of medians and of the fastest rounds (the latter less disturbed by other load);
`--mode train` times forward + backward. On a busy machine, `--threads 1 --clock cpu` (CPU time
of this process) is far steadier than wall time. `--memory` runs each contestant once in a fresh process
and reports the rise of its peak RSS over the inputs' (VmHWM, `measure.process_peak_bytes`), i.e. what the call
itself needs at its peak.
"""

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_sdpa_split import sdpa_alibi_split

from .measure import process_peak_bytes, time_calls


def make_call(name, heads, length, slopes):
    """A function (q, k, v) -> output for contestant `name`; any per-forward preparation is done here, once."""
    if name == "causal":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name == "bank":
        plan = plan_alibi_attention("sdpa", slopes, 1, length, length, sdpa_split=False)  # batch: no mask, any
        return lambda q, k, v: alibi_attention(q, k, v, plan, q.shape[-1] ** -0.5)[0]
    if name.startswith("split-"):
        chunks = tuple(int(rows) for rows in name.removeprefix("split-").split("/"))
        return lambda q, k, v: sdpa_alibi_split(q, k, v, slopes, 0, None, q.shape[-1] ** -0.5, chunks=chunks)
    raise ValueError(f"unknown contestant {name!r}")


def inputs(args, length, train):
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, length, args.dim)  # (B, H, L, D)
    return [torch.randn(shape, generator=generator).requires_grad_(train) for _ in range(3)]


def run_once(call, tensors, train):
    if train:
        call(*tensors).sum().backward()
    else:
        with torch.no_grad():
            call(*tensors)


def time_lengths(args, names):
    train = args.mode == "train"
    slopes = get_alibi_slopes(args.heads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for length in args.lengths:
        tensors = inputs(args, length, train)
        calls = {name: make_call(name, args.heads, length, slopes) for name in names}
        runs = {name: lambda call=call, tensors=tensors: run_once(call, tensors, train) for name, call in calls.items()}
        times = time_calls(runs, repeats=args.repeats, warmup=1, clock=clock)
        base, base_min = statistics.median(times["causal"]), min(times["causal"])
        for name in names:
            median, fastest = statistics.median(times[name]), min(times[name])
            spread = f"{fastest * 1e3:.1f}-{max(times[name]) * 1e3:.1f}"
            print(
                f"{args.mode} L={length:6d} {name:15s} {median * 1e3:9.1f} ms  ({spread})  {median / base:5.2f}x"
                f"  (fastest {fastest / base_min:5.2f}x)"
            )


def peak_rise(args, name, length):
    """In this process: the peak-RSS rise (MiB) of one call of `name` over its inputs."""
    train, slopes = args.mode == "train", get_alibi_slopes(args.heads)
    run_once(make_call(name, args.heads, 64, slopes), inputs(args, 64, train), train)  # loads the kernels' code
    tensors = inputs(args, length, train)
    before = process_peak_bytes("cpu")
    run_once(make_call(name, args.heads, length, slopes), tensors, train)  # the bank's construction counts too
    return (process_peak_bytes("cpu") - before) / 2**20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1024,4096,16384", help="comma-separated sequence lengths")
    parser.add_argument("--chunks", default="256,1024/256", help="comma-separated split chunk sizes, levels by /")
    parser.add_argument("--mode", choices=("forward", "train"), default="forward")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time, steadier than wall time on a shared machine (use --threads 1)",
    )
    parser.add_argument("--no-bank", action="store_true", help="leave out today's bank path")
    parser.add_argument("--memory", action="store_true", help="peak RSS rise per contestant, fresh processes")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    names = ["causal"] + ([] if args.no_bank else ["bank"]) + [f"split-{c}" for c in args.chunks.split(",")]
    if args.child:
        print(peak_rise(args, args.child, args.lengths[0]))
    elif args.memory:
        for length in args.lengths:
            for name in names:
                command = [sys.executable, "-m", "benchmarks.bench_attention_call", *(argv or sys.argv[1:])]
                command += ["--lengths", str(length), "--child", name]
                rise = float(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                print(f"{args.mode} L={length:6d} {name:15s} peak RSS rise {rise:8.1f} MiB")
    else:
        time_lengths(args, names)


if __name__ == "__main__":
    main()
