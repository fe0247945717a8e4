"""How far back the default path reads, per layer and head, at each length: the certified split's first key per block
of query rows, on a trained checkpoint and held-out text.

    python -m benchmarks.measure_key_windows --checkpoint runs/cpu_demo/alibi/final \
        --lengths 16384,32768,65536 --out results/length_scaling/key_windows

Not a timing. One forward per length (the model as `from_pretrained` gives it: the default `"auto"`, SDPA; no grad,
no cache, the all-ones mask), each layer's `KeyRanges` read from `attention_certified.certified_split` as it runs.
Per layer and head: the mean and the largest number of keys read left of a block's first row, over the blocks whose
first row is at least `--settled` (no row there within its head's reach of the start), and the head's kept share of
causal key work (every row's keys from its block's first key on). A window w that stays the same at every length
gives key work about L w - w^2 / 2, which doubles faster than 2x until L is many times w (the band's edge):
the growth column is that work's ratio to the previous length's.
"""

import argparse
import sys

import torch

from benchmarks.bench_length_scaling import write_report
from benchmarks.skip_research import kept_fraction, recorded_key_ranges


def layer_windows(first_key: torch.Tensor, rows: int, length: int, settled: int) -> list[dict]:
    """Per head: mean and largest keys read back over the settled blocks, and the kept share."""
    first_row = torch.arange(first_key.shape[1]) * rows
    back = (first_row[None] - first_key)[:, first_row >= settled].double()  # (H, settled blocks)
    share = kept_fraction(first_key, length, rows)  # (H,) kept keys / causal keys
    return [
        {"mean_back": float(b.mean()) if b.numel() else 0.0, "max_back": int(b.max()) if b.numel() else 0, "kept": s}
        for b, s in zip(back, share.tolist())
    ]


def measure(checkpoint: str, lengths: list[int], settled: int) -> tuple[list[dict], list[float]]:
    """One forward per length; each layer's certified key ranges summarised by head. Also the model's slopes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_alibi  # noqa: F401  (registers the model)
    from benchmarks.measure_kept_fraction import heldout_stream
    from hf_alibi.models.alibi.alibi_bias import slopes_from_config

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    cells = []
    for length in lengths:
        ids = heldout_stream(tokenizer, length)
        with recorded_key_ranges() as ranges, torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
        if not ranges:
            raise SystemExit(f"length {length}: the forward took no certified split (dense by default there)")
        heads = [layer_windows(r.first_key.cpu(), r.rows, length, settled) for r in ranges]
        cells.append({"length": length, "rows": ranges[0].rows, "layers": heads})
    return cells, slopes_from_config(model.config).tolist()


def markdown(cells: list[dict], command: str, slopes: list[float] | None = None) -> str:
    lines = [
        "# Keys read back per head under the default, by length",
        "",
        f"Command: `{command}`. Keys read left of each block's first row (mean and largest over the settled blocks), "
        "the kept share of causal key work, and that work's growth over the previous length (share x L^2).",
        "",
        "| tokens | layer | head | keys back, mean | largest | kept share | key work growth |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    previous = {}
    for cell in cells:
        length = cell["length"]
        for layer, heads in enumerate(cell["layers"]):
            for head, figures in enumerate(heads):
                work = figures["kept"] * length**2
                before = previous.get((layer, head))
                growth = f"x{work / before:.3f}" if before else "-"
                previous[(layer, head)] = work
                name = f"{head} (1/{1 / slopes[head]:g})" if slopes else str(head)
                lines.append(
                    f"| {length:,} | {layer} | {name} | {figures['mean_back']:,.0f} | {figures['max_back']:,} "
                    f"| {figures['kept']:.4f} | {growth} |"
                )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default="runs/cpu_demo/alibi/final")
    parser.add_argument("--lengths", default="16384,32768,65536")
    parser.add_argument("--settled", type=int, default=8192, help="first row of the blocks the means are over")
    parser.add_argument("--out", default="results/length_scaling/key_windows")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    command = "python -m benchmarks.measure_key_windows " + " ".join(sys.argv[1:] if argv is None else argv)
    cells, slopes = measure(args.checkpoint, lengths, args.settled)
    report = {"command": command, "settled": args.settled, "slopes": slopes, "cells": cells}
    write_report(args.out, report, markdown(cells, command, slopes))


if __name__ == "__main__":
    main()
