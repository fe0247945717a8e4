"""The `hf-alibi` console command.

hf-alibi convert SRC DST   # GPT-2 checkpoint (folder or Hub id) -> ALiBi GPT-2 folder, with its tokenizer
hf-alibi plot-bias [MODEL_OR_CONFIG | --n-head N] --output FILE.png   # bias matrices and slope schedule
"""

import argparse
import os
import shutil
import tempfile
from pathlib import Path


def convert_checkpoint(source: str, destination: str, alibi_max_bias: float = 8.0) -> Path:
    """Convert the GPT-2 checkpoint at `source` and save it, with its tokenizer, to `destination`.

    Written to a temporary folder beside `destination` and renamed into place, so a failure leaves nothing behind.
    """
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from .conversion import convert_gpt2

    destination_path = Path(destination)
    if destination_path.exists() and any(destination_path.iterdir()):
        raise ValueError(f"destination {destination!r} exists and is not empty")
    model = convert_gpt2(GPT2LMHeadModel.from_pretrained(source), alibi_max_bias=alibi_max_bias)
    destination_path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=destination_path.parent))
    try:
        model.save_pretrained(staging)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError):
            tokenizer = None
        # transformers 5 builds an empty tokenizer from a bare config: only a real vocabulary is worth shipping
        if tokenizer is not None and len(tokenizer) > len(tokenizer.all_special_tokens):
            tokenizer.save_pretrained(staging)
        else:
            print(f"note: no tokenizer found at {source}; saved the model only")
        if destination_path.exists():
            destination_path.rmdir()
        os.replace(staging, destination_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination_path


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
    convert = commands.add_parser("convert", help="convert a GPT-2 checkpoint to ALiBi GPT-2 (then fine-tune it)")
    convert.add_argument("source", help="GPT-2 checkpoint folder or Hub id")
    convert.add_argument("destination", help="folder to write (must not exist or be empty)")
    convert.add_argument("--alibi-max-bias", type=float, default=8.0, help="the 8 in the paper's slope rule")
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

    if args.command == "plot-bias":
        print(f"wrote {plot_bias(args)}")
        return

    path = convert_checkpoint(args.source, args.destination, args.alibi_max_bias)
    print(f"wrote ALiBi GPT-2 to {path}; fine-tune it before use")


if __name__ == "__main__":
    main()
