"""Certified kept fraction of an ALiBi encoder's bidirectional attention work, and what it costs, on a trained MLM.

    HF_HUB_OFFLINE=1 python -m recipes.train_mlm --config mlm_demo --output_dir /work/ckpt/mlm_demo   # the model
    nice -n 19 env OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python -m benchmarks.measure_bidirectional_kept \
        --checkpoint /work/ckpt/mlm_demo/final \
        --out results/skip/bidirectional_kept
    HF_HUB_OFFLINE=1 python -m benchmarks.measure_bidirectional_kept --lengths 1024 --checkpoint DIR --out /tmp/k  # smoke

Decides whether certified skipping pays for an encoder (`choose_path` refuses it for bidirectional plans until it
does). One row of held-out standard-library text per length (`measure_kept_fraction.heldout_stream`: documents
joined by EOS, the checkpoint's own tokenizer) runs once through the masked LM (SDPA, dense, timed); hooks capture
every layer's queries and keys, and `kept_context.certified_key_windows` (eps split over both sides) gives each
(head, 256-row block) its certified window [start, end) at the shipped certificate's settings (key blocks of 64,
rows bounded in groups of 16, the diagonal logit as the LSE bound). Reported: kept share of the L x L work per
head (mean over layers) and overall, the dense forward's time, and the certificate's own time for all layers.
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from hf_alibi.experiments.length.kept_context import bidirectional_kept_fraction, certified_key_windows

from .measure_kept_fraction import heldout_stream

ROWS, KEY_BLOCK, ROW_GROUP = 256, 64, 16  # the shipped certificate's (attention_certified.py)


def capture_encoder_queries_keys(model, ids: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """Every layer's (query, key), each (B, H, L, D), from one dense forward over `ids`; and that forward's seconds."""
    captured, handles = {}, []
    for index, layer in enumerate(model.bert.encoder.layer):
        attention = layer.attention.self
        for name in ("query", "key"):

            def hook(module, inputs, output, index=index, name=name, attention=attention):
                batch, length, _ = output.shape
                heads = output.view(batch, length, attention.num_heads, attention.head_dim).transpose(1, 2)
                captured[(index, name)] = heads  # (B, H, L, D)

            handles.append(getattr(attention, name).register_forward_hook(hook))
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            seconds = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    layers = [(captured[(i, "query")], captured[(i, "key")]) for i in range(len(model.bert.encoder.layer))]
    return layers, seconds


def measure(model, stream: torch.Tensor, length: int, eps: float) -> dict:
    """One length's record: kept fraction per (layer, head), per head, overall; dense forward and certificate time."""
    slopes = model.bert.alibi_slopes.double()  # (H,)
    scaling = model.bert.encoder.layer[0].attention.self.scaling
    layers, forward_s = capture_encoder_queries_keys(model, stream[:, :length])
    start, table = time.perf_counter(), []
    for query, key in layers:
        starts, ends = certified_key_windows(query, key, slopes, scaling, eps, ROWS, KEY_BLOCK, row_group=ROW_GROUP)
        table.append(bidirectional_kept_fraction(starts, ends, length, ROWS).tolist())
    certificate_s = time.perf_counter() - start
    per_head = torch.tensor(table).mean(0)  # (H,)
    return dict(
        length=length,
        eps=eps,
        slopes=slopes.tolist(),
        per_layer_head=table,
        per_head=per_head.tolist(),
        overall=float(per_head.mean()),
        dense_forward_s=round(forward_s, 3),
        certificate_s=round(certificate_s, 3),
    )


def markdown(records: list[dict], metadata: dict) -> str:
    heads = " | ".join(f"1/{round(1 / m)}" for m in records[0]["slopes"])
    lines = [
        "# Certified kept fraction of an ALiBi encoder's bidirectional attention work\n\n",
        f"`{metadata['command']}` ({metadata['date']}, load average {metadata['load']})\n\n",
        f"Checkpoint `{metadata['checkpoint']}`. Computed keys / (L x L), per head (slope; mean over layers) and "
        f"overall, at which every row drops softmax mass <= eps on both sides together; blocks of {ROWS} rows and "
        f"{KEY_BLOCK} keys. Times: one dense forward of the masked LM (SDPA), and the certificate for all layers.\n\n",
        f"| length | eps | overall | {heads} | dense forward | certificate |\n",
        "|" + "---|" * (5 + len(records[0]["slopes"])) + "\n",
    ]
    for r in records:
        per_head = " | ".join(f"{f:.3f}" for f in r["per_head"])
        lines.append(
            f"| {r['length']} | {r['eps']:.0e} | **{r['overall']:.3f}** | {per_head} | {r['dense_forward_s']:.2f} s "
            f"| {r['certificate_s']:.2f} s |\n"
        )
    return "".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("/work/ckpt/mlm_demo/final"))
    parser.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    parser.add_argument("--eps", type=float, default=1e-7)
    parser.add_argument("--out", type=Path, default=Path("results/skip/bidirectional_kept"), help="Path, no suffix.")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    import hf_alibi  # noqa: F401  (registers the encoder with the Auto classes)
    from hf_alibi.atomic_files import write_text_atomically

    model = AutoModelForMaskedLM.from_pretrained(args.checkpoint, attn_implementation="sdpa").eval()
    stream = heldout_stream(AutoTokenizer.from_pretrained(args.checkpoint), max(args.lengths))
    records = []
    for length in args.lengths:
        records.append(measure(model, stream, length, args.eps))
        print(json.dumps({k: v for k, v in records[-1].items() if k != "per_layer_head"}), flush=True)
    metadata = dict(
        command="python -m benchmarks.measure_bidirectional_kept " + " ".join(argv),
        checkpoint=str(args.checkpoint),
        torch=torch.__version__,
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        load=" ".join(Path("/proc/loadavg").read_text().split()[:3]),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(args.out.with_suffix(".json"), json.dumps(dict(metadata=metadata, records=records), indent=1))
    write_text_atomically(args.out.with_suffix(".md"), markdown(records, metadata))


if __name__ == "__main__":
    main()
