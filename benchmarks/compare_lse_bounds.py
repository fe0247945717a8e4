"""What each lower bound on a row's log-sum-exp certifies, on a trained checkpoint, against an oracle.

    nice -n 19 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.compare_lse_bounds \
        --checkpoint runs/cpu_demo/alibi/final --lengths 2048 8192 --out results/skip/lse_bounds

Not a timing. The layers' queries and keys (one row of held-out standard-library text, captured as
`measure_kept_fraction` does) are certified with the same upper bound (Theorem 3: Cauchy-Schwarz per 64-key block,
rows grouped by 16) and four lower bounds on LSE_i (Theorems 2 and 4 of `hf_alibi.models.alibi.attention_skip`):
- `diagonal logit`: s q_i.k_i (FlexAttention's prefill, decoding);
- `split (kernel LSE)`: what the split really uses, `certified_split`'s ranges: the fp32 kernel's log-sum-exp over
  each 256-row block's own diagonal and, for the heads that reach further back (`near_widths`), the 256 keys before
  it, less its rounding margin (the ranges it reads: its shared windows included);
- `exact LSE`: the float64 log-sum-exp over all of the row's keys (the best any lower bound can do);
- `oracle`: no bound at all: each row's first 64-key boundary whose exact dropped mass is <= eps (what a certificate
  from norms could at most approach).
Kept fraction = computed keys / causal keys, per head (mean over layers) and overall. Writes `<out>.json`/`.md`.
Given several lengths, the kept work's growth per step too, (L2 / L1)^2 kept2 / kept1 (causal work is L^2 / 2): 2.0
for twice the length is linear; the oracle's growth is the least any certificate can give.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from hf_alibi.models.alibi.attention_certified import KEY_BLOCK, ROWS  # the blocks the layers certify with


def exact_lse_and_oracle(query, key, slopes, scaling, eps):
    """Float64 LSE (B, H, q) over every causal key, and the oracle's starts (H, blocks): per 256-row block."""
    batch, heads, length, _ = query.shape
    m = slopes.double()[:, None, None]  # (H, 1, 1)
    lse = torch.empty(batch, heads, length, dtype=torch.float64)
    starts = torch.zeros(heads, -(-length // ROWS), dtype=torch.long)
    for index, first in enumerate(range(0, length, ROWS)):
        last = min(first + ROWS, length)
        scores = query[:, :, first:last].double() @ key[:, :, :last].double().transpose(-1, -2) * scaling
        distance = (torch.arange(first, last)[:, None] - torch.arange(last)[None]).double()  # (rows, keys)
        scores = (scores - m * distance).masked_fill(distance < 0, -math.inf)  # (B, H, rows, keys)
        lse[:, :, first:last] = torch.logsumexp(scores, -1)
        blocks = first // KEY_BLOCK  # key blocks wholly before the row block
        if blocks:
            weights = torch.softmax(scores, -1)[..., : blocks * KEY_BLOCK].unflatten(-1, (blocks, KEY_BLOCK))
            passing = (weights.sum(-1).cumsum(-1) <= eps).sum(-1)  # (B, H, rows) leading blocks dropped
            starts[:, index] = passing.amin(0).amin(-1) * KEY_BLOCK
    return lse, starts


def kept(name, table):
    per_head = torch.stack(table).mean(0)  # (H,)
    return dict(bound=name, per_head=per_head.tolist(), overall=float(per_head.mean()))


def measure(model, ids, eps):
    from benchmarks.skip_research import certified_key_starts, kept_fraction
    from hf_alibi.experiments.length.kept_context import capture_queries_keys
    from hf_alibi.models.alibi.attention_alibi import plan_alibi_attention
    from hf_alibi.models.alibi.attention_certified import ROW_GROUP, certified_split

    slopes, scaling = model.transformer.alibi_slopes.float(), model.transformer.h[0].attn.scaling
    length = ids.shape[1]
    tables = {"diagonal logit": [], "split (kernel LSE)": [], "exact LSE": [], "oracle": []}
    for query, key in capture_queries_keys(model, ids):
        with torch.no_grad():
            plan = plan_alibi_attention("sdpa", slopes, 1, length, length, skip_eps=eps)
            split_ranges = certified_split(query, key, key, plan, scaling)[1].first_key
        lse, oracle = exact_lse_and_oracle(query, key, slopes, scaling, eps)
        common = dict(row_block=ROWS, key_block=KEY_BLOCK, centroid=False, row_group=ROW_GROUP)
        starts = {
            "diagonal logit": certified_key_starts(query, key, slopes, scaling, 0, eps, near=1, **common),
            "split (kernel LSE)": split_ranges,
            "exact LSE": certified_key_starts(query, key, slopes, scaling, 0, eps, lse_lower=lse, **common),
            "oracle": oracle,
        }
        for name, first in starts.items():
            tables[name].append(kept_fraction(first, length, ROWS))
    return [kept(name, table) for name, table in tables.items()]


def work_growth(records: list[dict]) -> list[dict]:
    """Per bound, each step between consecutive lengths: how many times the kept key work grows."""
    steps = []
    for bound in dict.fromkeys(r["bound"] for r in records):
        mine = sorted((r for r in records if r["bound"] == bound), key=lambda r: r["length"])
        for a, b in zip(mine, mine[1:]):
            growth = (b["length"] / a["length"]) ** 2 * b["overall"] / a["overall"]
            steps.append(dict(bound=bound, lengths=(a["length"], b["length"]), growth=growth))
    return steps


def markdown(command: str, checkpoint: str, eps: float, slopes: list[float], records: list[dict]) -> str:
    lines = [
        f"# Lower bounds on LSE: kept fraction of causal key work\n\n`{command.strip()}`\n\n",
        f"Checkpoint `{checkpoint}`, eps {eps:g}, 256-row / 64-key blocks, Cauchy-Schwarz upper bound "
        "with rows grouped by 16 (the oracle uses no bound). Per head (slope; mean over layers) and overall.\n\n",
        "| length | lower bound | overall | " + " | ".join(f"1/{round(1 / m)}" for m in slopes) + " |\n",
        "|" + "---|" * (3 + len(slopes)) + "\n",
    ]
    for r in records:
        heads = " | ".join(f"{f:.3f}" for f in r["per_head"])
        lines.append(f"| {r['length']} | {r['bound']} | **{r['overall']:.3f}** | {heads} |\n")
    growth = work_growth(records)
    if growth:
        lines += ["\nKept key work, growth from one length to the next (2.00 per doubling is linear):\n\n"]
        lines += ["| lower bound | lengths | growth |\n", "|---|---|---:|\n"]
        lines += [f"| {g['bound']} | {g['lengths'][0]} -> {g['lengths'][1]} | x{g['growth']:.3f} |\n" for g in growth]
    return "".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final")
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--out", type=Path, default=Path("results/skip/lse_bounds"))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks.measure_kept_fraction import heldout_stream, load_model
    from hf_alibi.atomic_files import write_text_atomically

    model = load_model(Path(args.checkpoint))
    stream = heldout_stream(AutoTokenizer.from_pretrained(args.checkpoint), max(args.lengths))
    records = []
    for length in args.lengths:
        for record in measure(model, stream[:, :length], args.eps):
            records.append(dict(length=length, eps=args.eps, **record))
            print(json.dumps(records[-1]), flush=True)
    slopes = model.transformer.alibi_slopes.tolist()
    command = "python -m benchmarks.compare_lse_bounds " + " ".join(argv)
    report = dict(command=command, slopes=slopes, records=records, growth=work_growth(records))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out.with_suffix(".json"), json.dumps(report, indent=1))
    write_text_atomically(args.out.with_suffix(".md"), markdown(command, args.checkpoint, args.eps, slopes, records))


if __name__ == "__main__":
    main()
