"""The `hf-alibi` console command.

hf-alibi convert SRC DST                 # GPT-2, BLOOM, MPT or Falcon-RW (folder or Hub id) -> ALiBi GPT-2 folder
hf-alibi export SRC DST --to bloom       # ALiBi GPT-2 folder -> BloomForCausalLM folder
hf-alibi export SRC DST --to mpt --max-seq-len 8192   # -> MptForCausalLM folder (transformers, vLLM, TGI)
hf-alibi export SRC model.gguf --to gguf # -> one llama.cpp file (architecture mpt), tokenizer included
hf-alibi plot-bias [MODEL_OR_CONFIG | --n-head N] --output FILE.png   # bias matrices and slope schedule
"""

import argparse
from pathlib import Path


def convert_checkpoint(source: str, destination: str, alibi_max_bias: float | None = None) -> Path:
    """Import the checkpoint at `source` and save it, with its tokenizer and generation config, to `destination`.

    Written to a temporary folder beside `destination` and renamed into place, so a failure leaves nothing behind.
    `alibi_max_bias` applies to GPT-2 sources only (the others keep their own slopes).
    """
    from .conversion import convert
    from .conversion.common import load_tokenizer, write_folder_atomically

    destination_path = Path(destination)
    if destination_path.exists() and any(destination_path.iterdir()):
        raise ValueError(f"destination {destination!r} exists and is not empty")
    model = convert(source, **({} if alibi_max_bias is None else {"alibi_max_bias": alibi_max_bias}))
    tokenizer = load_tokenizer(source)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        else:
            print(f"note: no tokenizer found at {source}; saved the model only")

    return write_folder_atomically(destination_path, write)


def export_checkpoint(source: str, destination: str, layout: str, max_seq_len: int | None = None) -> Path:
    """Export the ALiBi GPT-2 folder `source` (with its tokenizer) to `layout` at `destination`, atomically."""
    from .conversion import export

    return export(source, layout, destination, max_seq_len=max_seq_len)


def plot_bias(args: argparse.Namespace) -> Path:
    """`hf-alibi plot-bias`: the slopes of a saved model/config (or the paper's rule for --n-head), drawn."""
    from .experiments.plots import plot_alibi_bias

    if (args.model is None) == (args.n_head is None):
        raise ValueError(
            f"give a model/config path or --n-head, not both or neither (got {args.model!r}, {args.n_head})"
        )
    if args.model is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.model)
        if not hasattr(config, "alibi_slopes"):
            raise ValueError(f"{args.model} is a {config.model_type!r} config, not an ALiBi one (alibi_gpt2)")
        source = config
    else:
        from .alibi import get_alibi_slopes

        source = get_alibi_slopes(args.n_head, args.alibi_max_bias)
    return plot_alibi_bias(source, args.output, heads=args.heads, size=args.size, eps=args.eps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hf-alibi", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="import a GPT-2, BLOOM, MPT or Falcon-RW checkpoint")
    convert.add_argument("source", help="checkpoint folder or Hub id (its model_type picks the family)")
    convert.add_argument("destination", help="folder to write (must not exist or be empty)")
    convert.add_argument("--alibi-max-bias", type=float, help="GPT-2 only: the 8 in the paper's slope rule")
    export = commands.add_parser("export", help="export an ALiBi GPT-2 folder to BLOOM, MPT or GGUF (llama.cpp)")
    export.add_argument("source", help="ALiBi GPT-2 folder (its tokenizer comes along)")
    export.add_argument("destination", help="folder to write (bloom, mpt) or a .gguf file (gguf)")
    export.add_argument("--to", required=True, choices=("bloom", "mpt", "gguf"), help="target layout")
    export.add_argument("--max-seq-len", type=int, help="mpt: longest input served (its loaders refuse more); "
                        "gguf: the context length recorded (default: the model's n_positions)")
    bias = commands.add_parser("plot-bias", help="draw the ALiBi bias of a few heads and the slope schedule")
    bias.add_argument("model", nargs="?", help="saved ALiBi model folder or its config.json")
    bias.add_argument("--n-head", type=int, help="instead of a model: the paper's slopes for this many heads")
    bias.add_argument("--alibi-max-bias", type=float, default=8.0, help="the 8 in the paper's slope rule (--n-head)")
    bias.add_argument("--output", default="alibi_bias.png", help="PNG file to write")
    bias.add_argument("--heads", type=int, nargs="+", help="heads to draw (default: steepest, middle, flattest)")
    bias.add_argument("--size", type=int, default=64, help="positions per side of each bias matrix")
    bias.add_argument("--eps", type=float, default=0.01, help="attention mass beyond the marked window")
    args = parser.parse_args(argv)
    import hf_alibi  # noqa: F401  (registers the Auto classes for the saved folder)
    from transformers import AutoConfig

    if args.command == "plot-bias":
        print(f"wrote {plot_bias(args)}")
        return

    from .conversion import EXACT_FAMILIES

    if args.command == "convert":
        path = convert_checkpoint(args.source, args.destination, args.alibi_max_bias)
        family = AutoConfig.from_pretrained(args.source).model_type
        if family in EXACT_FAMILIES:
            print(f"wrote ALiBi GPT-2 to {path}: an exact import of the {family} model (same outputs, any length)")
        else:
            print(f"wrote ALiBi GPT-2 to {path}; fine-tune it before use")
    elif args.command == "export":
        path = export_checkpoint(args.source, args.destination, args.to, args.max_seq_len)
        print(f"wrote {args.to} export to {path}")


if __name__ == "__main__":
    main()
