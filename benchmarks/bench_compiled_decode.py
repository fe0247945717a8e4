"""Compiled static-cache decoding: hf_alibi (SDPA) against GPT-2 (SDPA, learned positions), side by side.

    python -m benchmarks.bench_compiled_decode                      # GPT-2 small width, 4 layers, CPU, ~10 min
    python -m benchmarks.bench_compiled_decode --n-layer 1 --n-embd 96 --n-head 12 --vocab 512 --decode 8 --repeats 1

What transformers runs when a model declares `_can_compile_fullgraph`: `generate(cache_implementation="static")`
with a `CompileConfig(fullgraph=True)`, the decoding step compiled once and replayed (on CPU transformers compiles
only when asked: `compile_config._compile_all_devices = True`). Both models live in this one process and are timed
interleaved (A B A B ...). Each repeat is one generate(`--decode` new tokens) call whose stopping criterion stamps
the clock after every token: decode tokens/s = `batch * (decode - 1)` over the time from the first token (the
prefill's) to the last, so neither the prefill nor its noise enters the figure. Batches > 1 are left-padded
(prompts from `--prefill` down to half of it). Prints a markdown table with medians, spreads and the
tokens/s ratio alibi / gpt2; `--out` writes the raw timings as JSON.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import CompileConfig, GPT2Config, GPT2LMHeadModel, StoppingCriteria, StoppingCriteriaList

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi.atomic_files import write_text_atomically

from .contestants import NO_DROPOUT, TOKEN_IDS, add_shape_arguments, exact_generation_config, shape_fields


def build(name: str, args) -> torch.nn.Module:
    shape = shape_fields(args)
    common = {**NO_DROPOUT, **TOKEN_IDS}
    torch.manual_seed(0)
    if name == "gpt2":
        config = GPT2Config(n_positions=args.prefill + args.decode, **shape, **common)
        return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    config = AlibiGPT2Config(n_positions=args.prefill, **shape, **common)
    return AlibiGPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()


def prompts(batch: int, prefill: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.linspace(prefill, prefill // 2, batch).round().long() if batch > 1 else torch.tensor([prefill])
    ids = torch.randint(3, vocab, (batch, prefill), generator=torch.Generator().manual_seed(batch))
    mask = (torch.arange(prefill)[None] >= prefill - lengths[:, None]).long()  # (B, prefill), left padding
    return ids.masked_fill(mask == 0, 0), mask


class StepClock(StoppingCriteria):
    """Never stops generation; records the time after each generated token."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate(model, ids, mask, new_tokens: int, compile_config) -> float:
    """Decoding tokens/s of one generate call: the steps after the first token, from the first token to the last."""
    clock = StepClock()
    with torch.no_grad():
        config = exact_generation_config(new_tokens, cache_implementation="static", compile_config=compile_config)
        out = model.generate(
            ids, attention_mask=mask, generation_config=config, stopping_criteria=StoppingCriteriaList([clock])
        )
    assert out.shape[1] == ids.shape[1] + new_tokens and len(clock.times) == new_tokens
    return ids.shape[0] * (new_tokens - 1) / (clock.times[-1] - clock.times[0])


def measure(args) -> dict:
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles on CPU only when asked
    models = {name: build(name, args) for name in ("gpt2", "alibi")}
    results = {}
    for batch in args.batches:
        ids, mask = prompts(batch, args.prefill, args.vocab)
        for name, model in models.items():  # warm-up: compiles the decoding step for this batch
            generate(model, ids, mask, args.decode, compile_config)
            if not hasattr(model, "_compiled_call"):  # transformers keeps its compiled step there (5.x)
                raise RuntimeError(f"generate() did not compile {name}'s decoding step: the figures would be eager")
        rates = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():  # interleaved, so drifts in machine load hit both alike
                rates[name].append(generate(model, ids, mask, args.decode, compile_config))
        results[batch] = rates
    return results


def table(results: dict, args) -> str:
    lines = [
        f"Compiled static-cache greedy decoding, prefill {args.prefill}, {args.decode} new tokens, d={args.n_embd}, "
        f"{args.n_layer} layers, {args.n_head} heads, vocab {args.vocab}, fp32, {torch.get_num_threads()} threads, "
        f"{args.repeats} interleaved repeats (median [min, max]).",
        "",
        "| batch | gpt2-sdpa tokens/s | alibi-sdpa tokens/s | alibi / gpt2 |",
        "|---|---|---|---|",
    ]
    for batch, rates in results.items():
        cells = [f"{statistics.median(r):.1f} [{min(r):.1f}, {max(r):.1f}]" for r in (rates["gpt2"], rates["alibi"])]
        ratio = statistics.median(rates["alibi"]) / statistics.median(rates["gpt2"])
        lines.append(f"| {batch} | {cells[0]} | {cells[1]} | {ratio:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, n_embd=768, n_head=12, n_layer=4, vocab=50257, threads=2)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="write the raw tokens/s per repeat here (JSON)")
    args = parser.parse_args(argv)
    if args.decode < 2 or args.repeats < 1 or args.prefill < 2:
        parser.error(
            f"need --decode >= 2, --repeats >= 1, --prefill >= 2; got {args.decode}, {args.repeats}, {args.prefill}"
        )
    torch.set_num_threads(args.threads)
    results = measure(args)
    print(table(results, args))
    if args.out:
        write_text_atomically(
            args.out,
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "tokens_per_s": results}, indent=1),
        )


if __name__ == "__main__":
    main()
