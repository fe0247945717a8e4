"""Does the default path grow linearly with the context? Forward and one decoding step of a trained checkpoint at
doubling lengths, each length in a fresh process, and the largest context a machine of `--memory-gib` runs.

    python -m benchmarks.bench_length_scaling --checkpoint runs/cpu_demo/alibi/final \
        --lengths 16384,32768,65536,131072,262144 --rounds 3 --out results/length_scaling/demo
    python -m benchmarks.bench_length_scaling --checkpoint runs/cpu_demo/alibi/final --lengths 2048,4096 \
        --repeats 1 --decode-steps 2 --shape-lengths 0 --out /tmp/length_smoke                 # smoke, ~30 s
    python -m benchmarks.bench_length_scaling --train --checkpoint runs/cpu_demo/alibi/final \
        --lengths 16384,32768,65536,131072,262144 --repeats 2 --out results/length_scaling/demo_training_step

Per length L, fresh processes (no allocator state carries over): one for memory, `--rounds` for time (interleaved:
every length once per round, shortest first, so that a slow spell of a shared machine falls on all lengths alike).
Real held-out text of L tokens in the checkpoint's tokenizer (`measure_kept_fraction.heldout_stream`), the model as
`from_pretrained` gives it (the default `alibi_skip_eps="auto"`, SDPA), batch 1, no grad, the forward
`model(ids, attention_mask=ones, logits_to_keep=1)` (the all-ones mask `generate()` and Trainer send), warmed up once:
- working memory: the growth of the resident set's high-water mark over the state just before one forward
  (`measure.peak_memory`), in a process whose allocator returns every block of 64 KiB or more to the system when it is
  freed (`LIVE_ALLOCATOR`), so that the figure is the live tensors' peak, not what glibc's heap kept from before;
- time: the min of `--repeats` forwards per timed process, over its `--rounds` processes, and the median over the
  processes of each one's min (the host's speed drifts: on the machine behind BENCHMARKS.md a round's times moved by
  5-8% against the next, so the min of all rounds can catch a fast spell at one length and not at the next, and
  move a doubling's ratio by ~0.1; the median is robust to a spell either way); with several rounds, each doubling
  round by round too: the ratio of one round's two processes (run one after the other, so a spell of the host falls
  on both), its median over the rounds and a distribution-free interval for that median (`length_report.py`); the
  working memory under the default allocator too, for reference; then a prefill of L tokens into the `DynamicCache`
  `generate()` uses (untimed) and `--decode-steps` greedy steps, one token each, timed one by one (min and median over
  all rounds; with several rounds, each doubling round by round too): one token at L of context;
- `--profile`: `--repeats` more forwards per timed process, profiled: each operator's self CPU seconds per forward,
  its least over the rounds.
Each doubling's ratio is reported beside the figures: linear is 2.0.

Training (`--train`, instead of the above): one step as Trainer runs it, the model in train mode (the checkpoint's
dropouts are 0), `model(ids, attention_mask=ones, labels=ids)` and its backward, gradients zeroed before each step, no
optimizer; its working memory (under `LIVE_ALLOCATOR`) and the min of `--repeats` steps, in the same fresh
processes per length; `--profile`: one more step, profiled by operator. Two process-wide settings, off by default
(the caller's, not the model's): `--native-flush` runs each step inside `hf_alibi.native_flush.flushing_denormals()`
(denormal floats flushed to zero on every thread); `--keep-heap` gives the timed processes `KEEP_HEAP` (glibc maps no
block fresh from the system and trims nothing: without it, every tensor of 32 MiB or more is mapped, page-faulted
and unmapped at each allocation).

Memory (`--memory-gib`, default 24): the largest context the machine runs, from the process at rest (interpreter,
torch, the model: VmRSS before any forward) plus the working memory per token, fitted over the two longest lengths
measured (a line through them: the forward's memory is linear once the certificate bounds the keys each query reads).
Generation also holds the cache, 2 x layers x width x 4 bytes a token (fp32) on top of its prefill's memory. The same
for a 1.3B-shaped model (`--shape`: width 2048, 24 layers, 16 heads, GPT-2's 50,257 tokens; random weights, no
checkpoint of that size here): its weights are counted, not loaded, and its per-token working memory is measured on
one of its layers (no grad, no cache: layers run one after another, so the working memory is one layer's, whatever
the depth) at `--shape-lengths`.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.length_report import exactness_markdown, markdown
from benchmarks.length_training import profiled, training_markdown, training_step

GIB = 1 << 30
SHAPE_1_3B = dict(n_embd=2048, n_layer=24, n_head=16, vocab_size=50257)


def child(args) -> dict:
    """One length in this process: the forward's working memory (`--memory`, under `LIVE_ALLOCATOR`), or its time
    and a decoding step's; `--shape`: the 1.3B shape's one layer."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import hf_alibi  # noqa: F401  (registers the ALiBi classes)
    from benchmarks.measure import _status_kib, peak_memory, time_call, timed

    torch.manual_seed(0)
    if args.shape:
        model, ids = shaped_layer(args.length), torch.randint(0, SHAPE_1_3B["vocab_size"], (1, args.length))
    else:
        from benchmarks.skip_worker import text_ids

        model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
        ids = text_ids(args.checkpoint, args.length)  # (1, L)
    result = {"length": args.length, "resting_bytes": _status_kib("VmRSS") * 1024}
    if args.exact:
        return {"length": args.length, **exactness(model, ids)}
    if args.train:
        return {**result, **training_step(model, ids, args)}
    with torch.no_grad():
        ones = torch.ones(1, args.length + args.decode_steps + 1, dtype=torch.long)  # what generate/Trainer send
        forward = lambda: model(ids, attention_mask=ones[:, : args.length], logits_to_keep=1)  # noqa: E731
        forward()  # warm-up
        if args.memory:
            result["forward_bytes"] = peak_memory(forward, "cpu")[0]
            return result
        result["forward_s"] = time_call(forward, repeats=args.repeats, warmup=0)
        if args.profile:  # `--repeats` more forwards, profiled: each operator's self CPU seconds per forward
            result["profile"] = profiled(forward, args.repeats)
        result["forward_bytes_default_allocator"] = peak_memory(forward, "cpu")[0]
        cache = DynamicCache(config=model.config)
        prefill = model(ids, attention_mask=ones[:, : args.length], cache=cache, logits_to_keep=1)
        token = prefill.logits[:, -1:].argmax(-1)  # (1, 1)

        def step():  # the same token each step, the mask as generate() extends it
            return model(token, attention_mask=ones[:, : cache.get_seq_length() + 1], cache=cache, use_cache=True)

        result["decode_s"] = [timed(step)[0] for _ in range(args.decode_steps)]  # the cache grows a token a step
        result["threads"] = torch.get_num_threads()
    return result


def exactness(model, ids) -> dict:
    """Every position's logits under the default against dense attention (`alibi_skip_eps=0`): the largest
    difference and the share of positions whose greedy token agrees."""
    import torch

    eps = model.config.alibi_skip_eps
    with torch.no_grad():
        default = model(ids).logits  # (1, L, V)
        model.config.alibi_skip_eps = 0.0
        try:
            dense = model(ids).logits
        finally:
            model.config.alibi_skip_eps = eps
    return {
        "max_abs_logit_difference": float((default - dense).abs().max()),
        "largest_logit": float(dense.abs().max()),
        "greedy_agreement": float((default.argmax(-1) == dense.argmax(-1)).double().mean()),
    }


def shaped_layer(length: int):
    """A 1.3B-shaped ALiBi causal LM with one of its layers (random weights), for the per-token working memory."""
    from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

    config = AlibiGPT2Config(**{**SHAPE_1_3B, "n_layer": 1}, n_positions=length)
    return AlibiGPT2LMHeadModel(config).eval()


def shaped_weights_bytes(n_layer: int = SHAPE_1_3B["n_layer"]) -> int:
    """fp32 bytes of the 1.3B-shaped model's parameters with `n_layer` layers, counted on the meta device."""
    import torch

    from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

    with torch.device("meta"):
        model = AlibiGPT2LMHeadModel(AlibiGPT2Config(**{**SHAPE_1_3B, "n_layer": n_layer}))
    return 4 * sum(p.numel() for p in model.parameters())


# The memory processes' allocator: glibc hands every block of 64 KiB or more to mmap and back to the system when
# freed, so the resident set follows the live tensors (the default keeps up to 32 MiB blocks in its heap and reuses
# them, which makes the high-water growth depend on what the process allocated before)
LIVE_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# `--keep-heap`: every block from glibc's heap, which is never trimmed (no page faults once it has grown)
KEEP_HEAP = {"MALLOC_MMAP_THRESHOLD_": str(2**32), "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def run_child(args, length: int, memory: bool, shape: bool = False, exact: bool = False) -> dict:
    """One fresh process for one length: its JSON result."""
    command = [sys.executable, "-m", "benchmarks.bench_length_scaling", "--child", "--length", str(length)]
    command += ["--checkpoint", args.checkpoint, "--repeats", str(args.repeats)]
    command += ["--decode-steps", str(args.decode_steps)] + (["--shape"] if shape else [])
    command += ["--memory"] if memory else []
    command += ["--exact"] if exact else []
    command += ["--train"] if args.train else []
    command += ["--native-flush"] if args.native_flush else []
    command += ["--profile"] if args.profile and not memory else []
    env = {**os.environ, **(LIVE_ALLOCATOR if memory else KEEP_HEAP if args.keep_heap else {})}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"length {length}{' (shape)' if shape else ''} failed:\n{done.stderr[-3000:]}")
    cell = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(cell), flush=True)
    return cell


def timed_cells(args, lengths: list[int]) -> list[dict]:
    """Per length, its memory process and `--rounds` timed ones, the rounds interleaved (every length once per round,
    shortest first), so that a slow spell of the machine falls on every length alike: the timed processes' lists of
    seconds joined (their min is over rounds x repeats), their other figures the first round's."""
    memory = [run_child(args, n, memory=True) for n in lengths]
    rounds = [[run_child(args, n, memory=False) for n in lengths] for _ in range(args.rounds)]
    cells = []
    for index, first in enumerate(memory):
        timed = [round_[index] for round_ in rounds]
        joined = {key: sum((t[key] for t in timed), []) for key, value in timed[0].items() if isinstance(value, list)}
        if "profile" in timed[0]:  # each operator's least over the rounds (those every round profiled)
            names = [name for name in timed[0]["profile"] if all(name in t["profile"] for t in timed)]
            joined["profile"] = {name: min(t["profile"][name] for t in timed) for name in names}
        cells.append({**first, **timed[0], **joined, "rounds": args.rounds})
    return cells


def largest_context(resting: float, per_token: float, fixed: float, budget: float) -> int:
    """Tokens that fit in `budget` bytes: `resting` + `fixed` + L x `per_token` <= budget."""
    return max(0, int((budget - resting - fixed) // per_token)) if per_token > 0 else 0


def per_token(cells: list[dict]) -> float:
    """Working bytes per token: the slope through the two longest lengths."""
    a, b = cells[-2], cells[-1]
    return (b["forward_bytes"] - a["forward_bytes"]) / (b["length"] - a["length"])


def memory_limits(cells, shaped, config, budget) -> dict:
    """The largest forward and generation context of the checkpoint and of the 1.3B shape in `budget` bytes."""
    cache = 2 * config["n_layer"] * config["n_embd"] * 4  # K and V, fp32, per token
    demo_slope = per_token(cells)
    limits = {
        "checkpoint": {
            "resting_bytes": cells[-1]["resting_bytes"],
            "working_bytes_per_token": demo_slope,
            "cache_bytes_per_token": cache,
            "forward_tokens": largest_context(cells[-1]["resting_bytes"], demo_slope, 0, budget),
            "generate_tokens": largest_context(cells[-1]["resting_bytes"], demo_slope + cache, 0, budget),
        }
    }
    if shaped:
        weights = shaped_weights_bytes()
        other_layers = weights - shaped_weights_bytes(n_layer=1)  # beside the one layer measured
        slope = per_token(shaped)
        layer_weights = shaped[-1]["resting_bytes"]  # the one-layer model's process at rest: torch + its weights
        shape_cache = 2 * SHAPE_1_3B["n_layer"] * SHAPE_1_3B["n_embd"] * 4
        limits["1.3B-shaped"] = {
            **SHAPE_1_3B,
            "weights_bytes": weights,
            "resting_bytes_one_layer": layer_weights,
            "working_bytes_per_token": slope,
            "cache_bytes_per_token": shape_cache,
            # at rest: the one-layer process, plus the other layers' weights (counted)
            "forward_tokens": largest_context(layer_weights, slope, other_layers, budget),
            "generate_tokens": largest_context(layer_weights, slope + shape_cache, other_layers, budget),
        }
    return limits


def command_line(argv, module: str = "benchmarks.bench_length_scaling") -> str:
    """The command that ran (`python -m module`, then `argv` or the process's arguments), as the reports quote it."""
    return f"python -m {module} " + " ".join(sys.argv[1:] if argv is None else argv)


def write_report(out: str, report: dict, text: str) -> None:
    """`<out>.json` (the report) and `<out>.md` (its text), each written whole; the text printed."""
    from hf_alibi.atomic_files import write_text_atomically

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out.with_suffix(".json"), json.dumps(report, indent=2) + "\n")
    write_text_atomically(out.with_suffix(".md"), text)
    print(text)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final")
    parser.add_argument("--lengths", default="16384,32768,65536,131072,262144")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="timed fresh processes per length, interleaved")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--shape-lengths", default="4096,8192", help="1.3B-shaped memory lengths; 0: none")
    parser.add_argument("--memory-gib", type=float, default=24.0)
    parser.add_argument("--out", default="results/length_scaling/bench")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--exact", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--exactness", action="store_true", help="instead: every position's logits against dense at --lengths"
    )
    parser.add_argument("--train", action="store_true", help="instead: one training step's time and memory")
    parser.add_argument("--native-flush", action="store_true", help="--train: denormals flushed on every thread")
    parser.add_argument("--keep-heap", action="store_true", help="timed processes under KEEP_HEAP")
    parser.add_argument("--profile", action="store_true", help="more calls profiled, by operator")
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    if len(lengths) < 2 or lengths != sorted(lengths):
        raise SystemExit(f"--lengths must name at least two increasing lengths, got {args.lengths}")
    if args.rounds < 1 or args.repeats < 1:
        raise SystemExit(f"--rounds and --repeats must be at least 1, got {args.rounds} and {args.repeats}")
    if not args.train and args.native_flush:
        raise SystemExit("--native-flush measures the training step: add --train")
    command = command_line(argv)
    if args.exactness:
        cells = [run_child(args, n, memory=False, exact=True) for n in lengths]
        write_report(args.out, {"command": command, "cells": cells}, exactness_markdown(cells, command))
        return
    cells = timed_cells(args, lengths)
    if args.train:
        write_report(args.out, {"command": command, "cells": cells}, training_markdown(args, cells, command))
        return
    shape_lengths = [int(n) for n in args.shape_lengths.split(",") if int(n)]
    shaped = [run_child(args, n, memory=True, shape=True) for n in shape_lengths] if len(shape_lengths) > 1 else []
    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    report = {
        "checkpoint_name": Path(args.checkpoint).parent.name + "/" + Path(args.checkpoint).name,
        "command": command,
        "memory_gib": args.memory_gib,
        "repeats": args.repeats,
        "cells": cells,
        "shaped": shaped,
        "limits": memory_limits(cells, shaped, config, args.memory_gib * GIB),
    }
    write_report(args.out, report, markdown(report))


if __name__ == "__main__":
    main()
