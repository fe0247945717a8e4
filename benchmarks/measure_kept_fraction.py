"""Certified kept fraction of causal key work per head (hf_alibi.models.alibi.attention_skip), on trained ALiBi checkpoints.

    nice -n 19 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.measure_kept_fraction
    nice -n 19 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.measure_kept_fraction \
        --lengths 2048 --checkpoints cpu_demo --no-random --out /tmp/kept          # smoke, under a minute

Issue 17's measurement, not a timing: for each checkpoint (folders under `--runs`, loaded with
`AutoModelForCausalLM.from_pretrained` after `import hf_alibi`), one row of held-out standard-library text (the
recipe's split: `load_text_corpus()["validation"]`, documents joined by EOS as `pack_documents` packs them, encoded
with the checkpoint's own tokenizer) runs through the model once per length (SDPA, no grad); forward hooks on every
layer's `attn.c_attn` capture its queries and keys, and `certified_key_starts` gives, per (head, 256-row block), the
first key whose predecessors carry softmax mass <= eps on every row. The kept fraction is computed keys / causal keys
(`kept_fraction`), per layer and head, per head averaged over layers (a head is a slope), and overall. The main grid
uses the module's default bound (near-key LSE over 64 keys, Cauchy-Schwarz and centred block bounds); the ablation
rows (row and key blocks 256, eps 1e-7) show what each part of the bound buys. Random-init weights (the demo's
config, seed 0) are measured separately and labelled: their small q.k overstates the gain. Byte-identical weight
files (the demo's, the headline's and the 500-step budget-sweep ALiBi models) are measured once, under all names.
At 64k: `--lengths 65536 --checkpoints cpu_demo --no-random --out results/skip/kept_fraction_64k`.
Writes `<out>.json` and `<out>.md` (default results/skip/kept_fraction).
"""

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

from hf_alibi.experiments.length.kept_context import capture_queries_keys

GRID = [(eps, 256, key_block) for eps in (1e-7, 1e-5) for key_block in (256, 64)]  # (eps, row block, key block)
BOUNDS = {  # name -> (near keys in the LSE lower bound, centred block bound as well as Cauchy-Schwarz)
    "near 64, norms + centred": (64, True),
    "near 64, norms": (64, False),
    "diagonal, norms": (1, False),  # issue 17's bound, applied per key block
}
DEFAULT_BOUND = "near 64, norms + centred"
CHECKPOINTS = {
    "cpu_demo": "cpu_demo/alibi/final",
    "headline": "headline/alibi/final",
    "budget_sweep_60": "budget_sweep/steps_60/alibi/final",
    "budget_sweep_180": "budget_sweep/steps_180/alibi/final",
    "budget_sweep_500": "budget_sweep/steps_500/alibi/final",
}


def distinct_weights(folders: dict[str, Path]) -> dict[str, list[str]]:
    """First name -> every name whose `model.safetensors` is byte-identical (the demo's, the headline's and the
    500-step budget-sweep ALiBi models are one run of one recipe): each weight file is measured once."""
    groups = {}
    for name, folder in folders.items():
        digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        groups.setdefault(digest, []).append(name)
    return {names[0]: names for names in groups.values()}


def load_model(folder: Path, random_init: bool = False):
    """The checkpoint on SDPA in eval mode; `random_init`: its config with freshly initialised weights (seed 0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import hf_alibi  # noqa: F401  (registers the ALiBi model with the Auto classes)

    if random_init:
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(folder)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()


def heldout_stream(tokenizer, length: int) -> torch.Tensor:
    """(1, length) ids: the recipe's held-out standard-library documents, each followed by EOS, from the start."""
    from hf_alibi.experiments.data.corpus import load_text_corpus

    ids = []
    for text in load_text_corpus()["validation"]["text"]:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= length:
            return torch.tensor(ids[:length])[None]
    raise ValueError(f"the held-out documents hold only {len(ids)} tokens, fewer than length={length}")


def fractions(layers, slopes, scaling, eps, row_block, key_block, near, centroid) -> list[list[float]]:
    """Kept fraction per (layer, head) of causal key work for captured (query, key) pairs."""
    from benchmarks.skip_research import certified_key_starts, kept_fraction

    table = []
    for query, key in layers:
        starts = certified_key_starts(
            query, key, slopes, scaling, 0, eps, row_block, key_block, near=near, centroid=centroid
        )  # (H, n_row_blocks)
        table.append(kept_fraction(starts, query.shape[2], row_block).tolist())
    return table


def measure(name: str, model, weights: str, lengths: list[int], tokenizer) -> list[dict]:
    """Records for one model: the main grid with the default bound, and the bound ablation, at every length."""
    attention = model.transformer.h[0].attn
    slopes = model.transformer.alibi_slopes.float()  # (H,), refilled after loading (NOTES: meta-device buffers)
    grid = [dict(eps=eps, row_block=rows, key_block=keys, bound=DEFAULT_BOUND) for eps, rows, keys in GRID]
    ablation = [dict(eps=1e-7, row_block=256, key_block=256, bound=bound) for bound in BOUNDS if bound != DEFAULT_BOUND]
    stream = heldout_stream(tokenizer, max(lengths))
    records = []
    for length in lengths:
        layers = capture_queries_keys(model, stream[:, :length])
        for setting in grid + ablation:
            eps, row_block, key_block, bound = setting.values()
            table = fractions(layers, slopes, attention.scaling, eps, row_block, key_block, *BOUNDS[bound])
            per_head = torch.tensor(table).mean(0)  # (H,): a head's slope is the same in every layer
            kept = dict(per_layer_head=table, per_head=per_head.tolist(), overall=float(per_head.mean()))
            records.append(dict(model=name, weights=weights, length=length, **setting, slopes=slopes.tolist(), **kept))
            print(
                f"{name:>17} {weights:>7} L={length:>6} eps={eps:.0e} blocks {row_block}/{key_block} "
                f"[{bound}]: overall {records[-1]['overall']:.3f}",
                flush=True,
            )
    return records


def markdown(records: list[dict], metadata: dict) -> str:
    """Per head (mean over layers) and overall kept fractions: the main grid, then the ablation."""
    heads = " | ".join(f"1/{round(1 / m)}" if m > 0 else "0" for m in records[0]["slopes"])
    header = f"| model | weights | length | eps | blocks (rows/keys) | overall | {heads} |\n"
    header += "|" + "---|" * (6 + len(records[0]["slopes"])) + "\n"

    def row(r):
        per_head = " | ".join(f"{f:.3f}" for f in r["per_head"])
        return (
            f"| {r['model']} | {r['weights']} | {r['length']} | {r['eps']:.0e} | {r['row_block']}/"
            f"{r['key_block']} | **{r['overall']:.3f}** | {per_head} |\n"
        )

    main = [r for r in records if r["bound"] == DEFAULT_BOUND]
    ablation = [r for r in records if r["eps"] == 1e-7 and r["row_block"] == r["key_block"] == 256]
    lines = [
        "# Certified kept fraction of causal key work (hf_alibi.models.alibi.attention_skip)\n\n",
        f"{metadata['command']}\n\n",
        "Computed keys / causal keys, per head (slope; mean over layers) and overall, at which every real row "
        "drops softmax mass <= eps (output change <= 2 eps max|v|). One row of held-out standard-library text "
        "per length, each checkpoint's own byte-level tokenizer. Random weights are labelled `random` and "
        f"overstate the gain.\n\n## Main grid (bound: {DEFAULT_BOUND})\n\n",
        header,
        *(row(r) for r in main),
        "\n## Ablation of the bound (eps 1e-7, blocks 256/256)\n\n",
        header.replace("| eps |", "| bound |"),
        *(row(r).replace(f"| {r['eps']:.0e} |", f"| {r['bound']} |", 1) for r in ablation),
    ]
    return "".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"), help="Folder holding the recipes' runs.")
    parser.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192, 32768])
    parser.add_argument("--no-random", dest="random", action="store_false", help="Skip the random-init model.")
    parser.add_argument("--out", type=Path, default=Path("results/skip/kept_fraction"), help="Path without suffix.")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from hf_alibi.atomic_files import write_text_atomically

    folders = {name: args.runs / CHECKPOINTS[name] for name in args.checkpoints}
    missing = [str(folder) for folder in folders.values() if not folder.is_dir()]
    if missing:
        raise SystemExit(f"checkpoints not found: {missing} (train them with the recipes, or pass --runs)")
    records = []
    for name, aliases in distinct_weights(folders).items():
        folder = folders[name]
        records += measure(
            " = ".join(aliases), load_model(folder), "trained", args.lengths, AutoTokenizer.from_pretrained(folder)
        )
    if args.random:
        first = next(iter(folders.values()))
        records += measure(
            f"{args.checkpoints[0]} config",
            load_model(first, random_init=True),
            "random",
            args.lengths,
            AutoTokenizer.from_pretrained(first),
        )
    command = "python -m benchmarks.measure_kept_fraction " + " ".join(argv)
    metadata = dict(
        command=command.strip(),
        torch=torch.__version__,
        python=platform.python_version(),
        checkpoints={name: str(folder) for name, folder in folders.items()},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out.with_suffix(".json"), json.dumps(dict(metadata=metadata, records=records), indent=1))
    write_text_atomically(args.out.with_suffix(".md"), markdown(records, metadata))


if __name__ == "__main__":
    main()
