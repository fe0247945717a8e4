"""Peak memory of generation with a static cache against the dynamic cache (hf_alibi, SDPA), each in a fresh process.

    python -m benchmarks.bench_static_cache                                   # 4k and 16k prompts, 3 processes each
    python -m benchmarks.bench_static_cache --prompts 512 --processes 1       # smoke, a few seconds
    python -m benchmarks.bench_static_cache --out static_cache.json --markdown static_cache.md

Issue 16's measurement: a static cache's prefill used to build a (1, H, prompt, max_cache_len) fp32 bias (4096
tokens, 8 heads, n_embd 128, 2 layers: 1519 MiB peak against ~450 MiB with the dynamic cache); the target is a
static / dynamic peak of at most 1.1x at 4k and 16k prompts. Every measurement is one process (`--child`), so one
cache's allocations never sit in the other's figure: it builds the model (the shape above by default; random
weights, seed 0), generates `--new-tokens` greedy tokens after a `--batch`-row prompt (rows left-padded from
`--prompt` down to half of it when batch > 1) with `cache_implementation="static"` (max_cache_len = prompt + new
tokens, as generate sizes it) or the default dynamic cache, and reports the process's peak resident set (VmHWM:
torch, the model and the call) and the growth of the resident set during the call (`benchmarks.measure.peak_memory`).
Processes alternate static, dynamic, dynamic, static, ...; the table holds medians over processes and static's
ratio to dynamic, and every process's tokens must equal the dynamic cache's (the run fails otherwise).
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from .contestants import TOKEN_IDS, add_shape_arguments, shape_fields
from .report import standalone_parser, write_outputs

PREFIX = "@@static_cache "
CACHES = ("static", "dynamic")
MIB = 2**20


def measure(cache: str, prompt: int, args) -> dict:
    """In this process: build the model, generate once, return the peaks (bytes) and the generated tokens."""
    import torch

    from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

    from .measure import peak_memory, process_peak_bytes

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # dense: the caches' memory, not skipping on random weights
    config = AlibiGPT2Config(**shape_fields(args), n_positions=512, **TOKEN_IDS, alibi_skip_eps=0.0)
    model = AlibiGPT2LMHeadModel._from_config(config, attn_implementation="sdpa").eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, args.vocab, (args.batch, prompt), generator=generator)
    lengths = [prompt - (row * (prompt // 2)) // max(args.batch - 1, 1) for row in range(args.batch)]
    mask = (torch.arange(prompt)[None] >= prompt - torch.tensor(lengths)[:, None]).long()  # (B, prompt), left pad
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    if cache == "static":
        settings["cache_implementation"] = "static"
    result = {}

    def generate():
        with torch.no_grad():
            result["tokens"] = model.generate(ids.masked_fill(mask == 0, 0), attention_mask=mask, **settings)

    growth, method = peak_memory(generate, "cpu")
    tokens = result["tokens"][:, prompt:].tolist()
    return {
        "cache": cache,
        "prompt": prompt,
        "call_growth_bytes": growth,
        "memory_method": method,
        "process_peak_bytes": process_peak_bytes("cpu"),
        "tokens": tokens,
    }


def run_child(cache: str, prompt: int, argv: list[str]) -> dict:
    command = [sys.executable, "-m", "benchmarks.bench_static_cache", *argv, "--child", cache, str(prompt)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in done.stdout.splitlines() if line.startswith(PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{cache} at {prompt} tokens failed (status {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix(PREFIX))


def summarise(runs: list[dict], prompts: list[int]) -> list[dict]:
    rows = []
    for prompt in prompts:
        row = {"prompt": prompt}
        for cache in CACHES:
            mine = [run for run in runs if run["prompt"] == prompt and run["cache"] == cache]
            for key in ("process_peak_bytes", "call_growth_bytes"):
                row[f"{cache}_{key}"] = statistics.median(run[key] for run in mine)
                row[f"{cache}_{key}_range"] = [min(run[key] for run in mine), max(run[key] for run in mine)]
        row["peak_ratio"] = row["static_process_peak_bytes"] / row["dynamic_process_peak_bytes"]
        row["growth_ratio"] = row["static_call_growth_bytes"] / max(row["dynamic_call_growth_bytes"], 1)
        rows.append(row)
    return rows


def markdown(rows: list[dict], args) -> str:
    lines = [
        f"Static vs dynamic cache, hf_alibi SDPA, n_embd {args.n_embd}, {args.n_head} heads, {args.n_layer} layers, "
        f"batch {args.batch}, {args.new_tokens} new tokens, fp32 CPU; medians of {args.processes} fresh processes "
        "each (MiB; [min, max])",
        "",
        "| prompt | static peak RSS | dynamic peak RSS | static / dynamic | static call growth | dynamic call growth "
        "| static / dynamic |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [str(row["prompt"])]
        for key in ("process_peak_bytes", "call_growth_bytes"):
            for cache in CACHES:
                low, high = row[f"{cache}_{key}_range"]
                cells.append(f"{row[f'{cache}_{key}'] / MIB:,.0f} [{low / MIB:,.0f}, {high / MIB:,.0f}]")
            cells.append(f"{row['peak_ratio' if key == 'process_peak_bytes' else 'growth_ratio']:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = standalone_parser("bench_static_cache", __doc__, what="process", child=("CACHE", "PROMPT"))
    parser.add_argument("--prompts", default="4096,16384", help="comma-separated prompt lengths (default 4096,16384)")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per cache and prompt (median)")
    parser.add_argument("--batch", type=int, default=1, help="prompt rows; > 1 left-pads down to half the prompt")
    parser.add_argument("--new-tokens", type=int, default=4, help="greedy tokens generated after the prompt")
    add_shape_arguments(parser, n_embd=128, n_head=8, n_layer=2, vocab=512, threads=2)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        print(PREFIX + json.dumps(measure(args.child[0], int(args.child[1]), args)), flush=True)
        return
    prompts = [int(p) for p in args.prompts.split(",") if p]
    runs = []
    for prompt in prompts:
        for index in range(args.processes):
            for cache in CACHES if index % 2 == 0 else CACHES[::-1]:
                runs.append(run_child(cache, prompt, argv))
                peak = runs[-1]["process_peak_bytes"] / MIB
                print(f"{cache:>7} {prompt:>6} tokens: peak {peak:,.0f} MiB", flush=True)
        expected = next(run["tokens"] for run in runs if run["prompt"] == prompt and run["cache"] == "dynamic")
        if any(run["tokens"] != expected for run in runs if run["prompt"] == prompt):
            raise SystemExit(f"at {prompt} tokens the static cache generated other tokens than the dynamic cache")
    rows = summarise(runs, prompts)
    write_outputs(args, markdown(rows, args), runs, rows)


if __name__ == "__main__":
    main()
