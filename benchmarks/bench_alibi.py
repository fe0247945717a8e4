"""hf_alibi against GPT-2 (SDPA, no ALiBi), BLOOM, MPT, Jais's and Baichuan's eager code, side by side in one run.

    python -m benchmarks.bench_alibi --out results.json --markdown BENCHMARKS-table.md          # GPT-2 small, CPU
    python -m benchmarks.bench_alibi --preset tiny --repeats 1                                  # smoke, ~1 min
    python -m benchmarks.bench_alibi --suite forward --lengths 4096,8192 --contestants gpt2-sdpa,bloom-eager,alibi-sdpa
    python -m benchmarks.bench_alibi --device cuda --dtype bf16 --out results-cuda.json
    bash benchmarks/gpu_parity.sh                                                        # the parity targets on a GPU
    python -m benchmarks.bench_alibi --preset bloom-560m --suite forward,train --train-batch 1 \
        --contestants bloom-eager,alibi-from-bloom --out bloom560m.json --markdown bloom560m.md    # imported BLOOM
    python -m benchmarks.bench_alibi --suite forward,train --lengths 2048,8192,16384 --train-lengths 2048 \
        --train-batch 1 --contestants gpt2-sdpa,jais-eager,alibi-from-jais --out jais.json --markdown jais.md
        # imported Jais against their eager code: at 2048 (its n_positions cap; it raises past it) and past the cap
    python -m benchmarks.bench_alibi --preset baichuan-13b --suite forward,train --train-batch 1 --threads 2 \
        --reference baichuan-eager --contestants baichuan-eager,alibi-from-baichuan --out baichuan.json \
        --markdown baichuan.md  # imported Baichuan-13B (its width and 40 heads, 2 layers) against their code, 2k-16k
    python -m benchmarks.bench_alibi --suite forward --lengths 512,2048 --processes 5 --targets parity  # parity
    python -m benchmarks.bench_alibi --preset jina-base --suite encode --reference bert-sdpa --targets encoder \
        --contestants bert-sdpa,bert-sdpa-mlp4608,jina-eager,alibi-bert-sdpa --processes 1    # the ALiBi encoder

Every contestant lives in its own worker process (`benchmarks.worker`) for the whole run, so its peak memory is
its own and a crash, out-of-memory or timeout is recorded as that contestant's result. For each measurement cell
(suite x length x batch) the parent asks every worker for warm-up and a memory probe, then for `--repeats` timed
calls interleaved across contestants (A B C A B C ...), and reports medians and ratios against `gpt2-sdpa` (or the
no-bias GPT-2 that `--reference` names: `gpt2-flash` on a GPU).
With `--processes N`, every cell is instead measured in N fresh processes per contestant (round by round over all
cells, the contestants' order rotating), each reporting its median and its whole-process peak memory; the cell gets
the medians over processes and their [min, max].

- train: `model(input_ids, labels=input_ids)` (full logits and loss) + `backward()`, gradients dropped; with
  `--optimizer sgd` plus a plain SGD step. tokens/s = batch * length / step time.
- forward: batch 1 under `no_grad`, no cache, `logits_to_keep=1` for every contestant (the 16k x 50k logits
  would otherwise dominate memory).
- encode: an encoder's forward, batch 1 under `inference_mode`, with the all-ones `attention_mask` callers send.
- generate: greedy, exactly `--decode` new tokens (eos disabled) after a `--prefill`-token prompt; batches > 1 are
  left-padded with prompts from `--prefill` down to half of it. Each repeat times generate(1 new token) and
  generate(`--decode` new tokens); decode tokens/s = batch * (decode - 1) / (difference of the two).

After OOM, timeout or crash at one size, larger sizes of that suite are skipped for that contestant. Each cell
costs every contestant `--warmup` + 1 (memory probe) + `--repeats` calls. The full default run (GPT-2 small, fp32,
2 CPU cores) takes hours: estimated ~1 h train, ~1.5-2 h forward (8192 and 16384 dominate; the eager contestants
run out of memory at 16384 on a 23 GB machine), ~45 min generate. Run suites separately if needed.
"""

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

from . import report as reporting
from .contestants import CONTESTANTS, REFERENCE, REFERENCES, SUITES, Shape, default_contestants, unsupported_reason
from .harness import Bench, build_report, log_cell, plan_cells, run_in_processes


class Preset(NamedTuple):
    """A model shape and the lengths measured by default with it; explicit flags override either."""

    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int
    train_lengths: list[int]
    lengths: list[int]
    prefill: int
    decode: int


PRESETS = {
    "small": Preset(768, 12, 12, 50257, [512, 1024], [2048, 4096, 8192, 16384], prefill=512, decode=256),
    # bloom-560m's width, heads and vocabulary (24 layers there; fewer on CPU via --n-layer, same for all)
    "bloom-560m": Preset(1024, 4, 16, 250880, [2048], [2048, 4096, 8192, 16384, 32768], prefill=512, decode=64),
    # Baichuan-13B's width, heads and vocabulary (40 layers there; 2 here): the import against their eager code
    # (`baichuan-eager`: its (B, H, L, L) mask holds 40 * L^2 floats at L tokens). Baichuan2's vocabulary (125696)
    # does not fit: the imported contestant's process holds the source and the import while the other lives
    "baichuan-13b": Preset(5120, 2, 40, 64000, [2048], [2048, 4096, 8192, 16384], prefill=512, decode=64),
    # jina-embeddings-v2-base's width, heads and vocabulary (12 layers there): the encode suite's encoders
    "jina-base": Preset(768, 4, 12, 30528, [512], [512, 2048, 8192, 16384], prefill=512, decode=64),
    "tiny": Preset(96, 2, 12, 512, [64, 128], [128, 256], prefill=32, decode=8),
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_alibi",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_workload_arguments(parser)
    _add_measurement_arguments(parser)
    _add_report_arguments(parser)
    return parser


def _add_workload_arguments(parser) -> None:
    """The model's shape and what is measured on it: suites, contestants, lengths and batches."""
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="small",
        help="model shape and default lengths: small = GPT-2 small (d=768, 12 layers, 12 heads, "
        "vocab 50257); tiny = d=96, 2 layers, 12 heads, vocab 512, short lengths (smoke tests)",
    )
    parser.add_argument("--n-embd", type=int, help="override the preset's width")
    parser.add_argument("--n-layer", type=int, help="override the preset's depth")
    parser.add_argument("--n-head", type=int, help="override the preset's head count")
    parser.add_argument("--vocab-size", type=int, help="override the preset's vocabulary size")
    parser.add_argument(
        "--suite",
        default="train,forward,generate",
        help=f"comma-separated subset of {','.join(SUITES)} (default: the causal LMs' three; encode: the encoders')",
    )
    parser.add_argument(
        "--contestants",
        help=f"comma-separated subset of {','.join(CONTESTANTS)} (default: every "
        "one that runs on the device without compiling; the --reference is always added)",
    )
    parser.add_argument("--train-lengths", type=_ints, help="training-step lengths (small preset: 512,1024)")
    parser.add_argument("--train-batch", type=int, default=4, help="training-step batch size (default 4)")
    parser.add_argument(
        "--train-shapes",
        type=_shapes,
        help="training-step (length x batch) pairs, e.g. 128x32,512x8 (replaces --train-lengths and --train-batch)",
    )
    parser.add_argument(
        "--train-masks",
        default="none",
        help="comma-separated training-step masks: none (no "
        "attention_mask: the reference's fastest path) and/or ones (the all-ones mask Trainer sends)",
    )
    parser.add_argument(
        "--lengths", type=_ints, help="inference-forward lengths, batch 1 (small: 2048,4096,8192,16384)"
    )
    parser.add_argument("--prefill", type=int, help="generation prompt length (small: 512)")
    parser.add_argument("--decode", type=int, help="tokens generated per prompt (small: 256)")
    parser.add_argument("--gen-batches", type=_ints, default=[1, 8], help="generation batch sizes (default 1,8)")


def _add_measurement_arguments(parser) -> None:
    """How each cell is measured: repeats, device and dtype, threads, limits, processes."""
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per contestant and cell (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before the memory probe and timing")
    parser.add_argument(
        "--optimizer",
        choices=("none", "sgd"),
        default="none",
        help="training step: gradients only (none) or plus a plain SGD step (sgd)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), help="weights and activations (cpu: fp32, cuda: bf16)")
    parser.add_argument(
        "--native-flush",
        action="store_true",
        help="every worker runs inside "
        "hf_alibi.native_flush.flushing_denormals() (the opt-in switch: denormals flushed on every thread)",
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads in every worker (default: torch's own)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="seconds per measured call (warm-up, memory probe "
        "or repeat) before the worker is killed and the result recorded as timeout (default 900)",
    )
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        help="CPU: address-space limit per worker, so running out "
        "raises an OOM result instead of waking the kernel's OOM killer (default 80%% of the memory "
        "available at start; 0 = none)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        metavar="N",
        help="measure every cell in N fresh processes per contestant, interleaved round by round, "
        "and report the median over processes with their [min, max] and each process's whole "
        "peak memory (default 0: one long-lived process per contestant for the whole run)",
    )


def _add_report_arguments(parser) -> None:
    """What the ratios are against, which targets are checked, and where results go."""
    parser.add_argument(
        "--reference",
        choices=REFERENCES,
        default=REFERENCE,
        help="the no-bias model every ratio is against (default gpt2-sdpa; gpt2-flash: "
        "FlashAttention-2, CUDA + flash-attn, to hold alibi-flash against the same kernel without "
        "alibi_slopes; bert-sdpa: BertModel, the encode suite's; bloom-eager, jais-eager, baichuan-eager: the "
        "source's own code, for an import)",
    )
    parser.add_argument(
        "--targets",
        choices=("budget", "parity", "encoder"),
        default="budget",
        help="which targets to evaluate: budget (default: training <= 1.10x, forward <= 1.3x, memory "
        "<= 1.25x, decoding >= 0.95x, BLOOM >= 3x slower) or parity (within 1.05x of the reference "
        "in time and whole-process peak memory, BLOOM >= 3x slower from 4096 on) or encoder (within 1.05x of "
        "bert-sdpa in time; at 8192 >= 3x faster than jina-eager with <= 0.25x its peak memory)",
    )
    parser.add_argument("--settle", type=float, default=0.2, help="seconds of idle between timed calls (default 0.2)")
    parser.add_argument("--out", help="write the full results here as JSON (atomically, updated after every cell)")
    parser.add_argument("--markdown", help="write the markdown table here (atomically)")
    parser.add_argument("--worker", metavar="SPEC_JSON", help=argparse.SUPPRESS)  # internal: run as a worker


def parse_args(argv: list[str] | None = None):
    """The command line, the preset's defaults filled in and every choice checked (`parser.error` names the value)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        return args
    preset = PRESETS[args.preset]
    args.shape = Shape(
        **{k: getattr(args, k) or getattr(preset, k) for k in ("n_embd", "n_layer", "n_head", "vocab_size")}
    )
    for key in ("train_lengths", "lengths", "prefill", "decode"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(preset, key))
    args.train_shapes = args.train_shapes or [(length, args.train_batch) for length in args.train_lengths]
    args.train_lengths = [length for length, _ in args.train_shapes]
    args.train_masks = [m for m in args.train_masks.split(",") if m]
    if not args.train_masks or set(args.train_masks) - {"none", "ones"}:
        parser.error(f"--train-masks takes none and/or ones, got {args.train_masks!r}")
    args.suites = [s for s in args.suite.split(",") if s]
    if bad := [s for s in args.suites if s not in SUITES]:
        parser.error(f"unknown suite(s) {bad}; choose from {list(SUITES)}")
    args.contestants = args.contestants.split(",") if args.contestants else default_contestants(args.device)
    if bad := [c for c in args.contestants if c not in CONTESTANTS]:
        parser.error(f"unknown contestant(s) {bad}; choose from {list(CONTESTANTS)}")
    if why := next(filter(None, (unsupported_reason(args.reference, s, args.device) for s in args.suites)), None):
        parser.error(f"--reference {args.reference} cannot run here: {why}")
    if args.reference not in args.contestants:
        args.contestants.insert(0, args.reference)
    if args.repeats < 1 or args.warmup < 0 or args.decode < 2 or args.prefill < 2 or args.processes < 0:
        parser.error(
            f"need --repeats >= 1, --warmup >= 0, --decode >= 2, --prefill >= 2, --processes >= 0; got "
            f"{args.repeats}, {args.warmup}, {args.decode}, {args.prefill}, {args.processes}"
        )
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    if args.memory_limit_gb is None:
        args.memory_limit_gb = 0.8 * _available_memory_gb() if args.device == "cpu" else 0
    args.max_length = max([*args.train_lengths, *args.lengths, args.prefill + args.decode])
    args.command = "python -m benchmarks.bench_alibi " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


def _shapes(text: str) -> list[tuple[int, int]]:
    """ "128x32,512x8" -> [(128, 32), (512, 8)]; argparse turns the ValueError into a usage error naming the text."""
    pairs = [tuple(int(n) for n in item.split("x")) for item in text.split(",") if item]
    if not pairs or any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise ValueError(text)
    return pairs


def _available_memory_gb() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) / 2**20
    except (OSError, KeyError):
        return 0.0


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.worker:
        from .worker import serve

        serve(json.loads(args.worker))
        return None
    from hf_alibi.atomic_files import write_text_atomically  # not at the top: workers import this module

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is built from a config: nothing to download
    cells = plan_cells(args)
    with tempfile.TemporaryDirectory(prefix="bench_alibi_") as log_dir:
        bench = Bench(args, Path(log_dir))
        try:
            if args.processes:
                run_in_processes(args, cells, bench)
            else:
                for cell in cells:
                    print(f"[bench] {cell['name']}", file=sys.stderr, flush=True)
                    cell["results"] = bench.run_cell(cell, args.contestants)
                    log_cell(cell)
                    if args.out:
                        write_text_atomically(args.out, json.dumps(build_report(args, cells, bench), indent=1))
            report = build_report(args, cells, bench)
        finally:
            bench.close()
    markdown = reporting.render_markdown(report)
    if args.out:
        write_text_atomically(args.out, json.dumps(report, indent=1))
    if args.markdown:
        write_text_atomically(args.markdown, markdown)
    print(markdown)
    return report


if __name__ == "__main__":
    main()
