"""The `hf-alibi` console command.

hf-alibi convert SRC DST                 # GPT-2, BLOOM, MPT or Falcon-RW (folder or Hub id) -> ALiBi GPT-2 folder
hf-alibi export SRC DST --to bloom       # ALiBi GPT-2 folder -> BloomForCausalLM folder
hf-alibi export SRC DST --to mpt --max-seq-len 8192   # -> MptForCausalLM folder (transformers, vLLM, TGI)
hf-alibi export SRC model.gguf --to gguf # -> one llama.cpp file (architecture mpt), tokenizer included
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
    args = parser.parse_args(argv)
    import hf_alibi  # noqa: F401  (registers the Auto classes for the saved folder)
    from transformers import AutoConfig

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
