"""Recipe arguments: a flat YAML file gives defaults for `HfArgumentParser` dataclasses; the command line overrides."""

from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments


def parse_args(argv: list[str], *dataclass_types):
    """Parse `--config FILE.yaml` plus overrides into `(*dataclass_types, TrainingArguments)` instances.

    Unknown YAML keys raise a `ValueError` naming them (a typo must not silently fall back to a default).
    """
    parser = HfArgumentParser((*dataclass_types, TrainingArguments))
    config_path, rest = _split_config(argv)
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ValueError(f"config file {config_path!r} does not exist")
        defaults = yaml.safe_load(path.read_text()) or {}
        if not isinstance(defaults, dict):
            raise ValueError(f"config file {config_path!r} must hold a flat mapping of argument names to values")
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"config file {config_path!r} has unknown keys {unknown}")
        parser.set_defaults(**defaults)
        # A YAML default satisfies a required argument (e.g. output_dir).
        for action in parser._actions:
            if action.dest in defaults:
                action.required = False
    return parser.parse_args_into_dataclasses(args=rest)


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    rest, config = [], None
    iterator = iter(argv)
    for arg in iterator:
        if arg == "--config":
            config = next(iterator, None)
            if config is None:
                raise ValueError("--config needs a YAML file path")
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return config, rest
