"""The model's share of serving cost without the server: transformers' continuous batching (`generate_batch`, what
`hf-alibi serve --continuous-batching` runs) and one-request `generate()` (what it runs without), hf_alibi against
GPT-2 of the same shape, in fresh interleaved processes.

    python -m benchmarks.bench_continuous_batching --checkpoint runs/cpu_demo/alibi/final --out results/serving/cb_demo
    python -m benchmarks.bench_continuous_batching --checkpoint runs/cpu_demo/alibi/final --rounds 1 --out /tmp/cb  # smoke

`bench_serve` measures what clients see, HTTP and the server's threads included; at the demo's size those cost as
much as the model and move by more than the few percent a model comparison needs. This takes them out. Contestants:
`alibi` (the checkpoint) and `gpt2` (transformers' GPT-2, learned positions, the checkpoint's width, depth, heads,
vocabulary; random weights: cost does not depend on them). Each process builds both, warms up once, then times
`--repeats` rounds in which every (contestant, workload) call runs once, in turn (calls this short move with the
machine from second to second, so only calls side by side compare; the order is reversed in every other process).
Workloads: `batch` = `generate_batch` of `--requests` greedy requests of
`--max-tokens` tokens after `--prompt-tokens`-token prompts of held-out text (paged cache sized as in bench_serve),
and `sequential` = `generate()` on the same requests one after the other. A cell is the median over `--rounds`
processes of each process's median, with [min, max], and the median of the processes' own hf_alibi / GPT-2 time
ratios (lower is better). hf_alibi's `batch` tokens must equal its `sequential` tokens.
Run alone: two cores, any other load shows in the figures.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "@@cb "
CONTESTANTS = ("alibi", "gpt2")


def child(args) -> dict:
    """In this process: build both contestants, time every (contestant, workload) call in turn, `--repeats` rounds
    (the order reversed in odd processes); return each one's median seconds, and hf_alibi's tokens."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        ContinuousBatchingConfig,
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
    )

    import hf_alibi  # noqa: F401  (registers the checkpoint's model type)

    from .bench_serve import text_prompts
    from .measure import time_calls

    torch.set_num_threads(args.threads)
    alibi = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    c = alibi.config
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head, vocab_size=c.vocab_size, n_positions=1024)
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompts = [
        tokenizer(text)["input_ids"] for text in text_prompts(args.checkpoint, args.prompt_tokens, args.requests)
    ]
    greedy = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    paged = ContinuousBatchingConfig(page_size=32, num_blocks=1024, max_batch_tokens=1024)

    def batch(model):
        outputs = model.generate_batch(
            inputs=prompts, generation_config=greedy, continuous_batching_config=paged, progress_bar=False
        )
        return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]

    def sequential(model):
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), generation_config=greedy)[0, len(p) :].tolist() for p in prompts]

    tokens = {"batch": batch(alibi), "sequential": sequential(alibi)}
    calls = {
        f"{name} {work.__name__}": (lambda work=work, model=model: work(model))
        for name, model in (("alibi", alibi), ("gpt2", gpt2))
        for work in (batch, sequential)
    }
    if args.order % 2:
        calls = dict(reversed(calls.items()))
    seconds = time_calls(calls, repeats=args.repeats, warmup=1)
    return {"median_s": {key: statistics.median(times) for key, times in seconds.items()}, "alibi_tokens": tokens}


def run_child(order: int, argv: list[str]) -> dict:
    command = [sys.executable, "-m", "benchmarks.bench_continuous_batching", *argv, "--child", "--order", str(order)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"process {order} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX) :])


def markdown(table: dict, args, command: str) -> str:
    tokens = args.requests * args.max_tokens
    lines = [
        f"`{command}`",
        "",
        f"{args.requests} requests x {args.max_tokens} tokens after {args.prompt_tokens}-token "
        f"prompts; medians over {args.rounds} processes each [min, max]",
        "",
        "| workload | gpt2 s | alibi s | alibi / gpt2 time (per process) | alibi tokens/s |",
        "|---|---|---|---|---|",
    ]
    for work in ("batch", "sequential"):
        g, a = table["gpt2"][work], table["alibi"][work]
        lines.append(
            f"| {work} | {g['median_s']:.3f} [{g['min_s']:.3f}, {g['max_s']:.3f}] | {a['median_s']:.3f} "
            f"[{a['min_s']:.3f}, {a['max_s']:.3f}] | {a['ratio']:.3f}x [{a['ratio_min']:.3f}, {a['ratio_max']:.3f}] | "
            f"{tokens / a['median_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final", help="a trained ALiBi GPT-2 folder")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each workload per process")
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes, the call order reversed in every other")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="writes OUT.json and OUT.md (atomically)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--order", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(PREFIX + json.dumps(child(args)), flush=True)
        return
    from hf_alibi.atomic_files import write_text_atomically

    runs = []
    for r in range(args.rounds):
        runs.append(run_child(r, argv))
        print(
            f"process {r + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in runs[-1]["median_s"].items()), file=sys.stderr
        )
        if runs[-1]["alibi_tokens"]["batch"] != runs[-1]["alibi_tokens"]["sequential"]:
            raise RuntimeError("hf_alibi's continuous-batching tokens differ from generate()'s")
    table = {}
    for name in CONTESTANTS:
        table[name] = {}
        for work in ("batch", "sequential"):
            times = [run["median_s"][f"{name} {work}"] for run in runs]
            table[name][work] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
    for work in ("batch", "sequential"):  # each process's own ratio: the machine's drift between processes cancels
        ratios = [run["median_s"][f"alibi {work}"] / run["median_s"][f"gpt2 {work}"] for run in runs]
        table["alibi"][work].update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
    command = "python -m benchmarks.bench_continuous_batching " + " ".join(argv)
    text = markdown(table, args, command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": command,
            "date": time.strftime("%Y-%m-%d"),
            "table": table,
            "processes": [run["median_s"] for run in runs],
        }
        write_text_atomically(args.out.with_suffix(".json"), json.dumps(report, indent=1))
        write_text_atomically(args.out.with_suffix(".md"), text)


if __name__ == "__main__":
    main()
