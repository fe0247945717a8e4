"""The `hf-alibi` console command.

hf-alibi convert SRC DST                 # {families} -> ALiBi GPT-2
                                         # {encoder_sources} -> ALiBi BERT
hf-alibi export SRC DST --to bloom       # ALiBi GPT-2 folder -> BloomForCausalLM folder
hf-alibi export SRC DST --to mpt --max-seq-len 8192   # -> MptForCausalLM folder (transformers, vLLM, TGI)
hf-alibi export SRC DST --to jais        # -> their remote-code layout (also {other_remote_layouts}), for their own code
hf-alibi export SRC model.gguf --to gguf # -> one llama.cpp file ({gguf_architectures}), tokenizer included
hf-alibi export SRC DST --to jina        # ALiBi BERT folder -> jina-bert-implementation's layout (also {other_encoder_layouts})
hf-alibi plot-bias [MODEL_OR_CONFIG | --n-head N] --output FILE.png   # bias matrices and slope schedule
hf-alibi train --config cpu_demo [--KEY VALUE ...]    # train short, test long (a shipped config or a YAML file)
hf-alibi evaluate --model FOLDER [FOLDER ...]         # any checkpoint at 1x-16x its training length
hf-alibi sweep --config budget_sweep                  # the 16L/L ratio of every model at several training budgets
hf-alibi serve FOLDER [--port 8000] [--continuous-batching]   # transformers' OpenAI-compatible server for a checkpoint

train, evaluate, sweep and plot-bias need `pip install 'hf_alibi[experiments]'`; `export --to gguf` needs
`hf_alibi[gguf]`; serve needs `hf_alibi[serve]`.
`hf-alibi train --help` and `hf-alibi evaluate --help` list every argument. An error prints one line,
`hf-alibi: error: ...`, and exits with status 2, having written nothing; `--debug` (or HF_ALIBI_DEBUG=1) shows the
traceback instead.

Flag style, one per command family:
  train, evaluate, sweep (and python -m recipes.*): --snake_case (--max_steps, --output_dir, --use_cpu true).
      Their options are dataclass fields (TrainingArguments and the recipe's own, parsed by HfArgumentParser), which
      fix the spelling: the same names are the YAML keys of --config files, the keys of results.json and the flags
      of transformers' example scripts. HfArgumentParser also registers every --kebab-case spelling
      (--max-steps), so both are accepted; documentation and configs use snake_case.
  convert, export, plot-bias, serve: --kebab-case (--alibi-max-bias, --max-seq-len, --n-head, --cb-block-size).
      Plain argparse tools, spelled as `transformers serve`, `huggingface-cli` and most command-line tools are;
      switches are flags without a value (--continuous-batching), where the Trainer commands take --name true/false.
"""

import argparse
import sys
from pathlib import Path

# How a command ends (one-line error, status 2, --debug): below the commands too, which end the same way
from .command_errors import DEBUG_VARIABLE, EXIT_ERROR, EXPECTED_ERRORS, error_line, run_command


class _Parser(argparse.ArgumentParser):
    """Usage errors raise (so `main` prints them on one line) instead of printing usage and exiting."""

    def error(self, message: str):
        raise ValueError(f"{message} (see {self.prog} --help)")


def convert_checkpoint(source: str, destination: str, alibi_max_bias: float | None = None) -> Path:
    """Import the checkpoint at `source` and save it, with its tokenizer and generation config, to `destination`,
    atomically (a failure leaves nothing behind). `alibi_max_bias` applies to GPT-2 sources only (the others keep
    their own slopes)."""
    from .conversion import convert

    path = convert(source, destination, **({} if alibi_max_bias is None else {"alibi_max_bias": alibi_max_bias}))
    if not (path / "tokenizer_config.json").is_file():
        print(f"note: no tokenizer found at {source}; saved the model only")
    return path


def export_checkpoint(source: str, destination: str, layout: str, max_seq_len: int | None = None) -> Path:
    """Export the ALiBi GPT-2 folder `source` (with its tokenizer) to `layout` at `destination`, atomically."""
    from .conversion import export

    return export(source, layout, destination, max_seq_len=max_seq_len)


def plot_bias(args: argparse.Namespace) -> Path:
    """`hf-alibi plot-bias`: the slopes of a saved model/config (or the paper's rule for --n-head), drawn."""
    if (args.model is None) == (args.n_head is None):
        raise ValueError(
            f"give a model/config path or --n-head, not both or neither (got {args.model!r}, {args.n_head})"
        )
    from .experiments.reporting.plots import plot_alibi_bias

    if args.model is not None:
        from .conversion.common import load_config

        config = load_config(args.model)
        if not hasattr(config, "alibi_slopes"):
            raise ValueError(f"{args.model} is a {config.model_type!r} config, not an ALiBi one (alibi_gpt2)")
        source = config
    else:
        from .models.alibi.alibi_bias import get_alibi_slopes

        source = get_alibi_slopes(args.n_head, args.alibi_max_bias)
    return plot_alibi_bias(source, args.output, heads=args.heads, size=args.size, eps=args.eps)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf_alibi")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _max_seq_len_help(meanings: dict[str, str]) -> str:
    """`--max-seq-len`'s help: the layouts that take it, grouped by what it sets in each (first-seen order)."""
    groups: dict[str, list[str]] = {}
    for layout, meaning in meanings.items():
        groups.setdefault(meaning, []).append(layout)
    return "; ".join(f"{', '.join(layouts)}: {meaning}" for meaning, layouts in groups.items())


def description() -> str:
    """The top `--help` text: this module's docstring, its family and layout names read from the conversion records."""
    from .conversion.dispatch import ENCODER_LAYOUT_NAMES, FAMILY_NAMES, GGUF_ARCHITECTURES, REMOTE_CODE, spoken
    from .conversion.encoder_files import ENCODER_SOURCES

    remote_layouts = [model_type for family in REMOTE_CODE for model_type in family.names]
    return __doc__.format(
        families=", ".join(FAMILY_NAMES),
        encoder_sources=", ".join(ENCODER_SOURCES),
        other_remote_layouts=", ".join(f"--to {layout}" for layout in remote_layouts[1:]),
        gguf_architectures=spoken(GGUF_ARCHITECTURES),
        other_encoder_layouts=", ".join(f"--to {layout}" for layout in list(ENCODER_LAYOUT_NAMES)[1:]),
    )


def build_parser() -> argparse.ArgumentParser:
    # Every family and layout name is the conversion layer's (its records; nothing listed here): ~0.1 s to import
    from .conversion.dispatch import (
        ENCODER_LAYOUTS,
        ENCODER_NAMES,
        FAMILY_NAMES,
        GPT2_LAYOUTS,
        LAYOUT_NAMES,
        LAYOUTS,
        MAX_SEQ_LEN,
    )

    parser = _Parser(prog="hf-alibi", description=description(), formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--debug", action="store_true", help=f"show the traceback of an error (or {DEBUG_VARIABLE}=1)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    convert = commands.add_parser(
        "convert",
        help=f"import a {', '.join(FAMILY_NAMES)} checkpoint, or an ALiBi encoder ({', '.join(ENCODER_NAMES)})",
    )
    convert.add_argument("source", help="checkpoint folder or Hub id (its model_type picks the family)")
    convert.add_argument("destination", help="folder to write (must not exist or be empty)")
    convert.add_argument("--alibi-max-bias", type=float, help="GPT-2 only: the 8 in the paper's slope rule")
    export = commands.add_parser(
        "export",
        help=f"export an ALiBi GPT-2 folder ({', '.join(dict.fromkeys(LAYOUT_NAMES[layout] for layout in GPT2_LAYOUTS))}) "
        f"or ALiBi BERT ({', '.join(dict.fromkeys(LAYOUT_NAMES[layout] for layout in ENCODER_LAYOUTS))})",
    )
    export.add_argument("source", help="ALiBi GPT-2 or ALiBi BERT folder (its tokenizer comes along)")
    export.add_argument("destination", help="folder to write (every layout but gguf) or a .gguf file")
    export.add_argument("--to", required=True, choices=LAYOUTS, help="target layout")
    export.add_argument(
        "--max-seq-len",
        type=int,
        help=f"{_max_seq_len_help(MAX_SEQ_LEN)} (default: the model's n_positions)",
    )
    bias = commands.add_parser("plot-bias", help="draw the ALiBi bias of a few heads and the slope schedule")
    bias.add_argument("model", nargs="?", help="saved ALiBi model folder or its config.json")
    bias.add_argument("--n-head", type=int, help="instead of a model: the paper's slopes for this many heads")
    bias.add_argument("--alibi-max-bias", type=float, default=8.0, help="the 8 in the paper's slope rule (--n-head)")
    bias.add_argument("--output", default="alibi_bias.png", help="PNG file to write")
    bias.add_argument("--heads", type=int, nargs="+", help="heads to draw (default: steepest, middle, flattest)")
    bias.add_argument("--size", type=int, default=64, help="positions per side of each bias matrix")
    bias.add_argument("--eps", type=float, default=0.01, help="attention mass beyond the marked window")
    from .serving import add_arguments as add_serve_arguments  # the options' dataclass only: nothing heavy

    add_serve_arguments(
        commands.add_parser(
            "serve",
            help="serve a checkpoint with transformers' OpenAI-compatible "
            "server (/v1/completions, /v1/chat/completions)",
        )
    )
    # train and evaluate parse their own arguments (HfArgumentParser dataclasses, --config YAML): see their --help
    commands.add_parser("train", add_help=False, help="train short, test long (--config NAME_OR_YAML; see --help)")
    commands.add_parser("evaluate", add_help=False, help="evaluate checkpoints at multiples of their training length")
    commands.add_parser("sweep", add_help=False, help="train short, test long at several training budgets")
    return parser


def run(argv: list[str]) -> None:
    """Run one `hf-alibi` command; errors raise (`main` turns them into one line and exit status 2)."""
    args, rest = build_parser().parse_known_args(argv)
    if args.command == "train":
        from .experiments.commands.train_short_test_long import main as train

        return train(rest)
    if args.command == "sweep":
        from .experiments.commands.budget_sweep import main as sweep

        return sweep(rest)
    if args.command == "evaluate":
        from .experiments.commands.evaluate_length import main as evaluate

        evaluate(rest)
        return None
    if rest:
        raise ValueError(f"unrecognized arguments: {' '.join(rest)} (see hf-alibi {args.command} --help)")
    if args.command == "plot-bias":
        print(f"wrote {plot_bias(args)}")
    elif args.command == "convert":
        from .conversion import EXACT_FAMILIES
        from .conversion.common import source_model_type
        from .conversion.encoder_files import ENCODER_MODEL_TYPES
        from .import_utils import missing_extra

        path = convert_checkpoint(args.source, args.destination, args.alibi_max_bias)
        family = source_model_type(args.source)
        if family in ENCODER_MODEL_TYPES:  # only an ALiBi encoder imports from these; anything else is refused
            print(f"wrote ALiBi BERT to {path}: an exact import of the ALiBi encoder (same outputs, any length)")
            if (path / "modules.json").is_file():
                print(missing_extra("embeddings", "SentenceTransformer(folder)") or "load it with SentenceTransformer")
        elif family in EXACT_FAMILIES:
            print(f"wrote ALiBi GPT-2 to {path}: an exact import of the {family} model (same outputs, any length)")
        else:
            print(f"wrote ALiBi GPT-2 to {path}; fine-tune it before use")
    elif args.command == "export":
        path = export_checkpoint(args.source, args.destination, args.to, args.max_seq_len)
        print(f"wrote {args.to} export to {path}")
    elif args.command == "serve":
        from .serving import options_from_arguments, serve

        serve(options_from_arguments(args))  # every option is checked, and the model loaded, before it listens


def main(argv: list[str] | None = None) -> int:
    """The console command: run `argv` (default `sys.argv[1:]`); 0 on success, 2 after a one-line error."""
    return run_command(run, argv)


__all__ = ["DEBUG_VARIABLE", "EXIT_ERROR", "EXPECTED_ERRORS", "build_parser", "error_line", "main", "run"]


if __name__ == "__main__":
    sys.exit(main())
