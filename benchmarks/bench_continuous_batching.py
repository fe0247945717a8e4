"""The model's share of serving cost without the server: transformers' continuous batching (`generate_batch`, what
`hf-alibi serve --continuous-batching` runs) and one-request `generate()` (what it runs without), hf_alibi against
GPT-2 of the same shape, in fresh interleaved processes.

    python -m benchmarks.bench_continuous_batching --checkpoint runs/cpu_demo/alibi/final --out results/serving/cb_demo
    python -m benchmarks.bench_continuous_batching --checkpoint runs/cpu_demo/alibi/final --rounds 1 --out /tmp/cb  # smoke

`bench_serve` measures what clients see, HTTP and the server's threads included; at the demo's size those cost as
much as the model and move by more than the few percent a model comparison needs. This takes them out. Contestants:
`alibi` (the checkpoint) and `gpt2` (transformers' GPT-2, learned positions, the checkpoint's width, depth, heads,
vocabulary; random weights: cost does not depend on them). Each process builds one contestant, warms up once, then
times `--repeats` calls of each workload: `batch` = `generate_batch` of `--requests` greedy requests of
`--max-tokens` tokens after `--prompt-tokens`-token prompts of held-out text (paged cache sized as in bench_serve),
and `sequential` = `generate()` on the same requests one after the other. Processes alternate contestants for
`--rounds` rounds; a cell is the median over processes of each process's median, with [min, max], and hf_alibi's
ratio to GPT-2 (time: lower is better). hf_alibi's `batch` tokens must equal its `sequential` tokens.
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
    """In this process: build `args.child`, time both workloads, return the medians (and alibi's tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, GPT2Config
    from transformers import GPT2LMHeadModel

    import hf_alibi  # noqa: F401  (registers the checkpoint's model type)

    from .bench_serve import text_prompts
    from .measure import time_call

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint).eval()
    if args.child == "gpt2":
        c = model.config
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
                                           vocab_size=c.vocab_size, n_positions=1024)).eval()  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompts = [tokenizer(text)["input_ids"] for text in text_prompts(args.checkpoint, args.prompt_tokens, args.requests)]
    greedy = GenerationConfig(max_new_tokens=args.max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    paged = ContinuousBatchingConfig(page_size=32, num_blocks=1024, max_batch_tokens=1024)

    def batch():
        outputs = model.generate_batch(inputs=prompts, generation_config=greedy, continuous_batching_config=paged,
                                       progress_bar=False)  # fmt: skip
        return [outputs[f"req_{i}"].generated_tokens for i in range(len(prompts))]

    def sequential():
        with torch.no_grad():
            return [model.generate(torch.tensor([p]), generation_config=greedy)[0, len(p) :].tolist() for p in prompts]

    results = {}
    for name, work in (("batch", batch), ("sequential", sequential)):
        tokens = work()  # warm-up, and the tokens to compare
        results[name] = {"median_s": statistics.median(time_call(work, repeats=args.repeats, warmup=0)),
                         "tokens": tokens}  # fmt: skip
    return results


def run_child(name: str, argv: list[str]) -> dict:
    command = [sys.executable, "-m", "benchmarks.bench_continuous_batching", *argv, "--child", name]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX) :])


def markdown(table: dict, args, command: str) -> str:
    tokens = args.requests * args.max_tokens
    lines = [f"`{command}`", "", f"{args.requests} requests x {args.max_tokens} tokens after {args.prompt_tokens}-token "
             f"prompts; medians over {args.rounds} processes each [min, max]", "",
             "| workload | gpt2 s | alibi s | alibi / gpt2 time | alibi tokens/s |", "|---|---|---|---|---|"]  # fmt: skip
    for work in ("batch", "sequential"):
        g, a = table["gpt2"][work], table["alibi"][work]
        lines.append(f"| {work} | {g['median_s']:.3f} [{g['min_s']:.3f}, {g['max_s']:.3f}] | {a['median_s']:.3f} "
                     f"[{a['min_s']:.3f}, {a['max_s']:.3f}] | {a['median_s'] / g['median_s']:.3f}x | "
                     f"{tokens / a['median_s']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final", help="a trained ALiBi GPT-2 folder")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each workload per process")
    parser.add_argument("--rounds", type=int, default=5, help="processes per contestant, alternating")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="writes OUT.json and OUT.md (atomically)")
    parser.add_argument("--child", choices=CONTESTANTS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        print(PREFIX + json.dumps(child(args)), flush=True)
        return
    from hf_alibi.atomic_files import write_text_atomically

    runs = {name: [] for name in CONTESTANTS}
    for r in range(args.rounds):
        for name in CONTESTANTS if r % 2 == 0 else CONTESTANTS[::-1]:
            runs[name].append(run_child(name, argv))
            print(f"round {r + 1}: {name} {runs[name][-1]['batch']['median_s']:.3f} s batch", file=sys.stderr)
    for run in runs["alibi"]:
        if run["batch"]["tokens"] != run["sequential"]["tokens"]:
            raise RuntimeError("hf_alibi's continuous-batching tokens differ from generate()'s")
    table = {name: {work: {"median_s": statistics.median(t := [run[work]["median_s"] for run in results]),
                           "min_s": min(t), "max_s": max(t)} for work in ("batch", "sequential")}
             for name, results in runs.items()}  # fmt: skip
    command = "python -m benchmarks.bench_continuous_batching " + " ".join(argv)
    text = markdown(table, args, command)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {"command": command, "date": time.strftime("%Y-%m-%d"), "table": table,
                  "runs": {name: [{w: run[w]["median_s"] for w in run} for run in results] for name, results in runs.items()}}
        write_text_atomically(args.out.with_suffix(".json"), json.dumps(report, indent=1))
        write_text_atomically(args.out.with_suffix(".md"), text)


if __name__ == "__main__":
    main()
