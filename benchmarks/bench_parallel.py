"""Training throughput and per-rank memory of DDP, FSDP2 and tensor parallelism on N CPU processes (gloo), hf_alibi.

    python -m benchmarks.bench_parallel                                    # 2 processes, d=512, L=512, 3 launches each
    python -m benchmarks.bench_parallel --n-embd 64 --n-layer 2 --length 32 --steps 3 --warmup 1 --launches 1  # smoke
    python -m benchmarks.bench_parallel --out parallel.json --markdown parallel.md

Issue 18's measurement, CPU figures only (gloo collectives over shared memory, not NVLink: communication costs
are not what a GPU sees). Every launch is a fresh `torchrun --standalone --nproc_per_node N` of this module
(`--child MODE`), modes alternating ddp, fsdp, tp, tp, fsdp, ddp, ...; each rank loads the same saved random-weight
checkpoint (seed 0) and trains `--steps` AdamW steps on random tokens after `--warmup` untimed ones:

- `ddp`: the whole model on every rank (`torch.nn.parallel.DistributedDataParallel`), each rank its own batch;
- `fsdp`: `from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N))`, each rank its own batch;
- `tp`: `DistributedConfig(tp_size=N)`, every rank the same batch (its heads and MLP columns of it).

Reported per mode (medians over launches): tokens/s of the whole group (distinct tokens per step / median step
time: N batches for ddp and fsdp, one for tp), the largest rank's peak resident set (VmHWM: torch, model, optimizer,
activations) and the parameter bytes a rank holds (its shards: about 1/N of the sharded weights for fsdp and tp).
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

from .contestants import NO_DROPOUT, add_shape_arguments, shape_fields
from .report import standalone_parser, write_outputs

MODES = ("ddp", "fsdp", "tp")
MIB = 2**20


def build(folder: Path, args) -> None:
    """The checkpoint every launch loads: random weights, seed 0."""
    import torch

    from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

    torch.manual_seed(0)
    config = AlibiGPT2Config(**shape_fields(args), n_positions=args.length, **NO_DROPOUT)
    AlibiGPT2LMHeadModel(config).save_pretrained(folder)


def train_step(model, optimizer, rows) -> None:
    """One AdamW step on `rows` (B, L); it ends when the slowest rank's does."""
    import torch.distributed as dist

    model(input_ids=rows, labels=rows).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    dist.barrier()


def measure(mode: str, folder: str, args) -> dict | None:
    """On one rank of a launch: train, time, measure; rank 0 returns every rank's figures, the others None."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers.distributed import DistributedConfig

    from hf_alibi import AlibiGPT2LMHeadModel

    from .measure import process_peak_bytes, time_call

    torch.set_num_threads(args.threads)
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if mode == "ddp":
        model = AlibiGPT2LMHeadModel.from_pretrained(folder)
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        sizes = {"fsdp_size": size} if mode == "fsdp" else {"tp_size": size}
        model = AlibiGPT2LMHeadModel.from_pretrained(folder, distributed_config=DistributedConfig(**sizes))
    model.train()
    held = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seed = 0 if mode == "tp" else rank  # TP ranks share one batch; data-parallel ranks each draw their own
    rows = torch.randint(0, args.vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(seed))
    seconds = time_call(partial(train_step, model, optimizer, rows), repeats=args.steps, warmup=args.warmup)
    figures = {
        "rank": rank,
        "step_seconds": statistics.median(seconds),
        "held_parameter_bytes": held,
        "process_peak_bytes": process_peak_bytes("cpu"),
    }
    gathered = [None] * size
    dist.all_gather_object(gathered, figures)
    del model, optimizer  # DDP's reducer holds the process group: a live one kept gloo ranks from exiting here
    dist.destroy_process_group()
    if rank != 0:
        return None
    tokens = args.batch * args.length * (1 if mode == "tp" else size)
    step = max(rank_figures["step_seconds"] for rank_figures in gathered)
    return {"mode": mode, "processes": size, "tokens_per_second": tokens / step, "ranks": gathered}


def run_child(mode: str, folder: Path, argv: list[str], processes: int) -> dict:
    """One fresh launch; rank 0 leaves its figures in `<folder>/../<mode>.json` (the launch's output goes to a log)."""
    result, log = folder.parent / f"{mode}.json", folder.parent / f"{mode}.log"
    result.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        "-m",
        "benchmarks.bench_parallel",
        *argv,
        "--child",
        mode,
        str(folder),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as output:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parents[1],
        )
    if done.returncode != 0 or not result.is_file():
        raise RuntimeError(f"{mode} failed (status {done.returncode}):\n{log.read_text()[-4000:]}")
    return json.loads(result.read_text())


def summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for mode in MODES:
        mine = [run for run in runs if run["mode"] == mode]
        rows.append(
            {
                "mode": mode,
                "tokens_per_second": statistics.median(run["tokens_per_second"] for run in mine),
                "max_rank_peak_bytes": statistics.median(
                    max(r["process_peak_bytes"] for r in run["ranks"]) for run in mine
                ),
                "held_parameter_bytes": max(r["held_parameter_bytes"] for r in mine[0]["ranks"]),
            }
        )
    return rows


def markdown(rows: list[dict], args) -> str:
    ddp = next(row for row in rows if row["mode"] == "ddp")
    lines = [
        f"DDP vs FSDP2 vs TP, {args.processes} CPU processes (gloo, {args.threads} thread each), hf_alibi SDPA, "
        f"n_embd {args.n_embd}, {args.n_head} heads, {args.n_layer} layers, vocab {args.vocab}, batch {args.batch} x "
        f"{args.length} tokens a rank, fp32 AdamW; medians of {args.launches} launches each. CPU figures.",
        "",
        "| mode | tokens/s (group) | vs DDP | peak RSS, largest rank (MiB) | parameters held a rank (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['mode']} | {row['tokens_per_second']:,.0f} | "
            f"{row['tokens_per_second'] / ddp['tokens_per_second']:.2f}x | "
            f"{row['max_rank_peak_bytes'] / MIB:,.0f} | {row['held_parameter_bytes'] / MIB:,.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = standalone_parser("bench_parallel", __doc__, what="launch", child=("MODE", "FOLDER"))
    parser.add_argument("--processes", type=int, default=2, help="ranks per launch (torchrun --nproc_per_node)")
    parser.add_argument("--launches", type=int, default=3, help="fresh launches per mode (median)")
    parser.add_argument("--steps", type=int, default=10, help="timed training steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=4, help="rows a rank trains on per step")
    parser.add_argument("--length", type=int, default=512)
    add_shape_arguments(
        parser, n_embd=512, n_head=8, n_layer=4, vocab=8192, threads=1, threads_help="torch threads in each rank"
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from hf_alibi._transformers_compat import require_transformers
    from hf_alibi.models.alibi.transformers_compat import TENSOR_PARALLEL_TRANSFORMERS

    # FSDP2 and TP load through DistributedConfig: refused before the first launch, not in its log
    require_transformers(TENSOR_PARALLEL_TRANSFORMERS, "bench_parallel's fsdp and tp modes")
    if args.child:
        result = measure(args.child[0], args.child[1], args)
        if result is not None:
            (Path(args.child[1]).parent / f"{args.child[0]}.json").write_text(json.dumps(result))
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp) / "model", args)
        for index in range(args.launches):
            for mode in MODES if index % 2 == 0 else MODES[::-1]:
                runs.append(run_child(mode, Path(tmp) / "model", argv, args.processes))
                print(f"{mode:>4}: {runs[-1]['tokens_per_second']:,.0f} tokens/s", flush=True)
    rows = summarise(runs)
    write_outputs(args, markdown(rows, args), runs, rows)


if __name__ == "__main__":
    main()
