"""The `hf-alibi` console command.

hf-alibi convert SRC DST   # GPT-2 checkpoint (folder or Hub id) -> ALiBi GPT-2 folder, with its tokenizer
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hf-alibi", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="convert a GPT-2 checkpoint to ALiBi GPT-2 (then fine-tune it)")
    convert.add_argument("source", help="GPT-2 checkpoint folder or Hub id")
    convert.add_argument("destination", help="folder to write (must not exist or be empty)")
    convert.add_argument("--alibi-max-bias", type=float, default=8.0, help="the 8 in the paper's slope rule")
    args = parser.parse_args(argv)
    import hf_alibi  # noqa: F401  (registers the Auto classes for the saved folder)

    path = convert_checkpoint(args.source, args.destination, args.alibi_max_bias)
    print(f"wrote ALiBi GPT-2 to {path}; fine-tune it before use")


if __name__ == "__main__":
    main()
