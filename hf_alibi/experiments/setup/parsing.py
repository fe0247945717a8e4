"""One parser for `hf-alibi train`, `evaluate` and `sweep`: a flat YAML file (a path or the name of a shipped config,
`configs/*.yaml`) as defaults for `HfArgumentParser` dataclasses, overridden by the command line (`parse_args`).

Options are spelled as the dataclass fields are, `--snake_case`, as `TrainingArguments` and the YAML keys are;
`HfArgumentParser` also registers every `--kebab-case` spelling, so both work (see `hf_alibi.cli`).
"""

from dataclasses import fields
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"  # package data: shipped in the wheel


def shipped_configs() -> list[str]:
    """Names of the configs shipped with the package (`cpu_demo`, `smoke`, ...), each usable as `--config NAME`."""
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.yaml"))


def resolve_config(value: str) -> Path:
    """The YAML file `--config value` means: an existing file, else a shipped config named `value` (`cpu_demo` or
    `cpu_demo.yaml`: a bare name, no folder). A path with a folder names that file only: a missing one is an error,
    never a shipped config of the same name (in a clone they are `hf_alibi/experiments/configs/NAME.yaml`)."""
    path = Path(value)
    if path.is_file():
        return path
    names = ", ".join(shipped_configs())
    if len(path.parts) > 1:
        folder = "" if path.parent.is_dir() else f" (folder {str(path.parent)!r} does not exist)"
        raise ValueError(
            f"config {value!r}: no such file{folder}. Shipped configs, by name (--config cpu_demo) "
            f"or in a clone as hf_alibi/experiments/configs/NAME.yaml: {names}"
        )
    if path.suffix in ("", ".yaml"):
        shipped = CONFIGS_DIR / f"{path.stem}.yaml"
        if shipped.is_file():
            return shipped
    raise ValueError(f"config {value!r}: no such file, and not a shipped config (shipped: {names})")


class ArgumentParser(HfArgumentParser):
    """`HfArgumentParser` whose usage errors raise `ValueError` (the `hf-alibi` command prints them on one line)."""

    def error(self, message: str):
        raise ValueError(f"{message} (see --help)")


def argument_parts(dataclass_type) -> tuple[type, ...]:
    """The dataclasses that define `dataclass_type`'s arguments: its `parts` (`ExperimentArguments`: one `--help`
    group per concern), else itself."""
    return tuple(getattr(dataclass_type, "parts", (dataclass_type,)))


def parse_args(argv: list[str], *dataclass_types, training_arguments: bool = True, prog: str | None = None):
    """Parse `--config FILE_OR_NAME` plus overrides into `(*dataclass_types, TrainingArguments)` instances.

    The config is a flat YAML file of argument names (`resolve_config`); the command line overrides it. Without
    `training_arguments`, only `dataclass_types` are parsed. Unknown YAML keys and bad options raise a `ValueError`
    naming them (a typo must not silently fall back to a default). `prog` names the command in `--help`.

    A type made of parts (`ExperimentArguments`) gets its options from its parts, grouped in `--help`, and is built
    once from all of them, so it validates once, across parts too.
    """
    types = (*dataclass_types, TrainingArguments) if training_arguments else dataclass_types
    description = (
        "--config FILE_OR_NAME: a flat YAML file of these arguments, or a shipped config "
        f"({', '.join(shipped_configs())}); options given here override it. Options are --snake_case, as the YAML "
        "keys and TrainingArguments are (--kebab-case works too)."
    )
    parser = ArgumentParser([part for t in types for part in argument_parts(t)], prog=prog, description=description)
    config_value, rest = _split_config(argv)
    if config_value is not None:
        path = resolve_config(config_value)
        defaults = yaml.safe_load(path.read_text()) or {}
        if not isinstance(defaults, dict):
            raise ValueError(f"config file {str(path)!r} must hold a flat mapping of argument names to values")
        known = {action.dest for action in parser._actions}
        unknown = sorted(set(defaults) - known)
        if unknown:
            raise ValueError(f"config file {str(path)!r} has unknown keys {unknown}")
        parser.set_defaults(**defaults)
        # A YAML default satisfies a required argument (e.g. output_dir).
        for action in parser._actions:
            if action.dest in defaults:
                action.required = False
    # What HfArgumentParser.parse_args_into_dataclasses does, for `types` rather than the parser's parts.
    namespace, remaining = parser.parse_known_args(args=rest)
    if remaining:
        raise ValueError(f"Some specified arguments are not used by the HfArgumentParser: {remaining}")
    values = vars(namespace)
    return tuple(t(**{f.name: values[f.name] for f in fields(t) if f.init}) for t in types)


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    rest, config = [], None
    iterator = iter(argv)
    for arg in iterator:
        if arg == "--config":
            config = next(iterator, None)
            if config is None:
                raise ValueError("--config needs a YAML file path or a shipped config name")
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return config, rest


__all__ = ["ArgumentParser", "CONFIGS_DIR", "argument_parts", "parse_args", "resolve_config", "shipped_configs"]
