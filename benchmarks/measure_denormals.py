"""Denormal-producing `exp` evaluations of the split's kernel calls on a trained checkpoint, with and without the
floored bias (hf_alibi/models/alibi/attention_sdpa_split_floor.py), simulated in float64; and each layer's attention
output against the float64 formula.

    nice -n 19 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.measure_denormals \
        --checkpoint /work/ckpt/cpu_demo/alibi/final --length 8192 --out results/benchmarks/denormals_8k
    ... --length 1024 --out /tmp/denormals                                          # smoke, under a minute
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.measure_denormals --length 8192 --time 3 \
        --out results/benchmarks/floor/floor_cost_8k              # the floor's own cost: CPU time, interleaved

A measurement, not a timing (the Intel Xeon whose cores take the microcode assists is not this machine): one row of
the recipe's held-out text (`measure_kept_fraction.heldout_stream`) runs through the model once; hooks capture every
layer's queries, keys and values; for the split's calls as the model's dense plan makes them (`split_plan`, each
layer call's `with_floors`), every kernel `exp` argument is recomputed in float64 from the call's own rows, keys and
mask, as the CPU flash kernel takes it:
- forward: logit minus the row's running maximum over the kernel's 512-key blocks (and each rescale, old minus new
  maximum). Arguments in (-103.97, -87.34) give fp32 denormals; the kernel's vectorised `exp` returns 0 there, but its
  scalar tail and rescale do not, and weights just above e^-87.34 make denormal products with values: the
  [-87.34, -80) band is counted too;
- backward: logit minus the row's final log-sum-exp in the call's frame (the kernel's `exp` there returns denormals).
Writes `<out>.json` and `<out>.md`.
"""

import argparse
import datetime
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from hf_alibi.atomic_files import write_text_atomically
from hf_alibi.experiments.length.kept_context import capture_queries_keys
from hf_alibi.models.alibi.attention_sdpa_split import SPLIT_CHUNKS, split_attention, split_plan
from hf_alibi.models.alibi.attention_sdpa_split_floor import backward_lse

DENORMAL = (-103.97, -87.34)  # exp(x) is an fp32 denormal for x in this range
LOW_NORMAL = (-87.34, -80.0)  # a normal weight whose products with |v| < 1 may be denormal
KV_BLOCK = 512  # the CPU flash kernel's keys per block (its online softmax's steps)


def count(arguments, band):
    return int(((arguments > band[0]) & (arguments < band[1])).sum())


def call_arguments(plan, group, query, key, lse, scaling):
    """(forward arguments, rescale arguments, backward arguments) of one call group, float64, visible entries only."""
    mask, shift, rows, keys = plan.views(group)
    logits = rows(query).double() @ keys(key).double().transpose(-1, -2) * scaling + mask.double()  # (c, h, n, k)
    visible = (mask > torch.finfo(mask.dtype).min / 2).expand_as(logits)
    logits = logits.masked_fill(~visible, -math.inf)
    blocks = logits.split(KV_BLOCK, dim=-1)
    running = torch.stack([block.amax(-1) for block in blocks], -1).cummax(-1).values  # (c, h, n, blocks)
    forward = torch.cat([block - running[..., b, None] for b, block in enumerate(blocks)], -1)[visible]
    rescale = (running[..., :-1] - running[..., 1:])[running[..., :-1].isfinite()]
    row_lse = rows(lse)  # (c, h, n) true frame
    call_lse = row_lse if shift is None else row_lse + shift.double()
    if shift is not None and plan.floors is not None:  # as the backward takes it: negligible rows at +inf
        call_lse = backward_lse(call_lse, rows(query), keys(key), mask, scaling, plan.visible)
    backward = (logits - call_lse[..., None])[visible]
    return forward, rescale, backward


def layer_counts(plan, query, key, lse, scaling):
    totals = dict.fromkeys(["forward_denormal", "forward_low", "rescale_denormal", "backward_denormal", "exps"], 0)
    for group in plan.groups:
        forward, rescale, backward = call_arguments(plan, group, query, key, lse, scaling)
        totals["forward_denormal"] += count(forward, DENORMAL)
        totals["forward_low"] += count(forward, LOW_NORMAL)
        totals["rescale_denormal"] += count(rescale, DENORMAL)
        totals["backward_denormal"] += count(backward, DENORMAL)
        totals["exps"] += forward.numel()
    return totals


def exact_attention(query, key, value, slopes, scaling, rows=1024):
    """Float64 causal ALiBi attention (B, H, L, D) and log-sum-exp (B, H, L), `rows` query rows at a time."""
    query, key, value = query.double(), key.double(), value.double()
    length, outputs, lses = query.shape[2], [], []
    j = torch.arange(length, dtype=torch.float64)
    for start in range(0, length, rows):
        i = torch.arange(start, min(start + rows, length), dtype=torch.float64)[:, None]
        logits = query[:, :, start : start + rows] @ key.transpose(-1, -2) * scaling
        logits = (logits - slopes.double()[:, None, None] * (i - j)).masked_fill(j > i, -math.inf)
        lses.append(torch.logsumexp(logits, -1))
        outputs.append(torch.softmax(logits, -1) @ value)
    return torch.cat(outputs, 2), torch.cat(lses, 2)


def measure(model, ids):
    length = ids.shape[1]
    slopes = model.transformer.alibi_slopes.float()
    scaling = model.transformer.h[0].attn.scaling
    rows = []
    for layer, (query, key, value) in enumerate(capture_queries_keys(model, ids, values=True)):
        expected, lse = exact_attention(query, key, value, slopes, scaling)
        row = {"layer": layer}
        for floor in (False, True):
            plan = split_plan(slopes, 0, length, None, SPLIT_CHUNKS, 1, torch.float32, floor)
            call = plan.with_floors(query, key, scaling)
            name = "floored" if floor else "exact"
            row[name] = layer_counts(call, query, key, lse, scaling)
            with torch.no_grad():
                output = split_attention(query, key, value, plan, scaling)
            row[name]["max_output_difference"] = (output.double() - expected).abs().max().item()
            if floor:
                row["floors"] = [] if call.floors is None else call.floors.tolist()
        rows.append(row)
    return rows


def time_floor(model, ids, repeats: int) -> dict:
    """Seconds (median over `repeats` interleaved rounds, CPU time of this process) of every layer's split call, forward
    and forward + backward, on the captured inputs with the floored and the exact bias: the floor's own cost."""
    slopes, scaling = model.transformer.alibi_slopes.float(), model.transformer.h[0].attn.scaling
    layers = capture_queries_keys(model, ids, values=True)
    plans = {
        floor: split_plan(slopes, 0, ids.shape[1], None, SPLIT_CHUNKS, 1, torch.float32, floor) for floor in (1, 0)
    }

    def run(floor, train):
        for query, key, value in layers:
            tensors = [t.detach().requires_grad_(train) for t in (query, key, value)]
            with torch.set_grad_enabled(train):
                output = split_attention(*tensors, plans[floor], scaling)
            if train:
                output.sum().backward()

    times = {(floor, train): [] for floor in (1, 0) for train in (False, True)}
    for _ in range(repeats + 1):  # the first round warms up
        for key in times:
            start = time.process_time()
            run(*key)
            times[key].append(time.process_time() - start)
    return {
        f"{'floored' if f else 'exact'} {'train' if t else 'forward'}": statistics.median(v[1:])
        for (f, t), v in times.items()
    }


def markdown(rows, meta) -> str:
    lines = [
        f"Split calls of `{meta['checkpoint']}` on {meta['length']} held-out tokens, float64 simulation "
        f"({meta['machine']}, {meta['date']}). Counts per forward; `C` per head (inf: left exact).",
        "",
        "| layer | C per head | bias | fwd exp in denormal band | fwd exp in [-87.34, -80) | rescales in band | "
        "bwd exp in band | max output diff vs float64 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        floors = ", ".join(f"{c:.1f}" for c in row["floors"]) or "none"
        for name in ("exact", "floored"):
            c = row[name]
            lines.append(
                f"| {row['layer']} | {floors} | {name} | {c['forward_denormal']:,} | {c['forward_low']:,} | "
                f"{c['rescale_denormal']:,} | {c['backward_denormal']:,} | {c['max_output_difference']:.2e} |"
            )
    for name in ("exact", "floored"):
        total = {k: sum(row[name][k] for row in rows) for k in rows[0][name] if k != "max_output_difference"}
        lines.append(
            f"| all | | {name} | {total['forward_denormal']:,} | {total['forward_low']:,} | "
            f"{total['rescale_denormal']:,} | {total['backward_denormal']:,} | of {total['exps']:,} exps |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="/work/ckpt/cpu_demo/alibi/final")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--out", default="results/benchmarks/denormals_8k")
    parser.add_argument("--time", type=int, default=0, help="rounds timing the split with and without the floor")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks.measure_kept_fraction import heldout_stream, load_model

    model = load_model(Path(args.checkpoint))
    ids = heldout_stream(AutoTokenizer.from_pretrained(args.checkpoint), args.length)
    if args.time:
        times = time_floor(model, ids, args.time)
        print(json.dumps(times, indent=1))
        write_text_atomically(Path(args.out).with_suffix(".time.json"), json.dumps(times, indent=1))
        return
    rows = measure(model, ids)
    meta = {
        "checkpoint": args.checkpoint,
        "length": args.length,
        "machine": platform.processor() or platform.machine(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out.with_suffix(".json"), json.dumps({"meta": meta, "layers": rows}, indent=1))
    write_text_atomically(out.with_suffix(".md"), markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
