"""Recipe arguments: what an experiment varies (`ExperimentArguments`), and a flat YAML file (a path or the name of
a shipped config, `configs/*.yaml`) as defaults for `HfArgumentParser` dataclasses, overridden by the command line
(`parse_args`): the one parser of `hf-alibi train` and `hf-alibi evaluate`."""

from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import HfArgumentParser, TrainingArguments

from .baselines import BASELINES
from .data import STDLIB_CORPUS

DEFAULT_MODELS = ["alibi", "learned", "sinusoidal"]


def parse_model_spec(spec: str, default_length: int) -> tuple[str, int]:
    """`"learned@512"` -> `("learned", 512)`; `"learned"` -> `("learned", default_length)`."""
    name, at, length = spec.partition("@")
    if name not in BASELINES:
        raise ValueError(f"unknown model name {name!r} in {spec!r}; choose from {list(BASELINES)}, optionally @LENGTH")
    if not at:
        return name, default_length
    if not length.isdigit() or int(length) < 1:
        raise ValueError(f"model {spec!r}: the training length after '@' must be a positive integer, got {length!r}")
    return name, int(length)


@dataclass
class ExperimentArguments:
    """What a train-short/test-long experiment varies. `TrainingArguments` carry everything about optimisation."""

    models: list[str] = field(
        default_factory=lambda: list(DEFAULT_MODELS),
        metadata={"help": f"Models to train: a position encoding from {list(BASELINES)}, trained at train_length, or "
                          "ENCODING@LENGTH (e.g. learned@512) for another training length (same training tokens)."},
    )
    all_models: bool = field(default=False, metadata={"help": "Train every position encoding in BASELINES."})
    train_length: int = field(default=256, metadata={"help": "Training sequence length (tokens per block)."})
    eval_factors: list[int] = field(
        default_factory=lambda: [1, 2, 4, 8, 16],
        metadata={"help": "Evaluate at train_length times each factor (every factor >= 1)."},
    )
    eval_stride: int | None = field(
        default=None, metadata={"help": "Sliding-window stride; default half of each evaluation length."}
    )
    eval_max_documents: int | None = field(default=None, metadata={"help": "Cap on held-out documents evaluated."})
    eval_batch_tokens: int = field(default=8192, metadata={"help": "Input tokens per evaluation forward."})
    eval_sliding: bool = field(
        default=True, metadata={"help": "Also evaluate sliding windows (about 2x the evaluation time)."}
    )
    window_eps: float = field(
        default=0.01, metadata={"help": "Attention mass beyond ALiBi's effective window (theory: ln(1/eps) / m)."}
    )
    window_length: int = field(
        default=2048, metadata={"help": "Input length of the effective-window measurement (windows up to half of it)."}
    )
    cost_steps: int = field(
        default=20,
        metadata={"help": "After training, timed training steps per model, interleaved across models, for the "
                          "training-cost table (hf_alibi/experiments/training_cost.py); 0 skips it."},
    )
    cost_warmup_steps: int = field(
        default=2, metadata={"help": "Untimed steps per model before the interleaved timing (peak memory covers them)."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": f"None/'{STDLIB_CORPUS}' (offline default), a Hub dataset, or a builder."}
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Hub dataset configuration, e.g. wikitext-103-raw-v1."}
    )
    data_files: list[str] | None = field(default=None, metadata={"help": "Local data files or globs."})
    text_column: str = field(default="text", metadata={"help": "Column holding each document's text."})
    heldout_fraction: float = field(
        default=0.1, metadata={"help": "Documents held out when the data has no validation split."}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder or Hub id; default: a byte-level BPE trained on the train split."},
    )
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary of the locally trained tokenizer."})
    n_embd: int = field(default=256, metadata={"help": "Model width (all models)."})
    n_layer: int = field(default=4, metadata={"help": "Model depth (all models)."})
    n_head: int = field(default=8, metadata={"help": "Attention heads (all models)."})
    dropout: float = field(default=0.0, metadata={"help": "Every dropout probability."})
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint (folder or Hub id) to fine-tune ('alibi' only), with its tokenizer: BLOOM, MPT or "
            "Falcon-RW (imported exactly by hf_alibi.convert) or GPT-2 (converted: it must first learn ALiBi)."
        },
    )
    init_from_gpt2: str | None = field(default=None, metadata={"help": "Older name of init_from."})
    tp_size: int = field(
        default=1,
        metadata={"help": "Tensor-parallel ranks (transformers' DistributedConfig; 'alibi' only): each rank holds "
                          "1/tp_size of every block's heads and MLP. tp_size * fsdp_size = the launched processes."},
    )
    fsdp_size: int = field(
        default=1,
        metadata={"help": "FSDP2 ranks (transformers' DistributedConfig; 'alibi' only): parameters, gradients and "
                          "optimizer state sharded 1/fsdp_size a rank; each rank trains on its own batches."},
    )
    max_train_documents: int | None = field(
        default=None, metadata={"help": "Cap on training documents (tokenizer and blocks; smoke runs)."}
    )
    max_train_blocks: int | None = field(default=None, metadata={"help": "Cap on training blocks (smoke runs)."})
    smoke: bool = field(default=False, metadata={"help": "Whole pipeline on a tiny model and budget (< 1 minute)."})

    def __post_init__(self):
        if self.all_models:
            self.models = list(BASELINES)
        if not self.models:
            raise ValueError(f"models must name at least one model, got {self.models}")
        if self.train_length <= 0:
            raise ValueError(f"train_length must be positive, got {self.train_length}")
        for spec in self.models:
            parse_model_spec(spec, self.train_length)
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"models lists a model twice: {self.models}")
        if not 0 < self.window_eps < 1:
            raise ValueError(f"window_eps must be in (0, 1), got {self.window_eps}")
        if self.cost_steps < 0 or self.cost_warmup_steps < 1:
            raise ValueError(
                "cost_steps must be >= 0 and cost_warmup_steps >= 1, "
                f"got {self.cost_steps} and {self.cost_warmup_steps}"
            )
        if self.window_length < 2:
            raise ValueError(f"window_length must be at least 2, got {self.window_length}")
        if not self.eval_factors or any(f < 1 for f in self.eval_factors):
            raise ValueError(
                f"eval_factors must all be >= 1 (no evaluation below the training length), got {self.eval_factors}"
            )
        if self.eval_stride is not None and not 1 <= self.eval_stride <= self.train_length:
            raise ValueError(f"eval_stride must be in [1, train_length={self.train_length}], got {self.eval_stride}")
        if self.init_from_gpt2 is not None:
            if self.init_from not in (None, self.init_from_gpt2):
                raise ValueError(f"init_from={self.init_from!r} and init_from_gpt2={self.init_from_gpt2!r}: give one")
            self.init_from = self.init_from_gpt2
        for name in ("tp_size", "fsdp_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        if self.sharded and [parse_model_spec(m, 1)[0] for m in self.models] != ["alibi"]:
            raise ValueError(
                f"tp_size={self.tp_size}, fsdp_size={self.fsdp_size} shard ALiBi models only (the baselines have no "
                f"tensor-parallel or FSDP plan): set models to ['alibi'], got {self.models}"
            )
        if self.init_from is not None and [parse_model_spec(m, 1)[0] for m in self.models] != ["alibi"]:
            raise ValueError(f"init_from fine-tunes one ALiBi model: set models to ['alibi'], got {self.models}")

    @property
    def sharded(self) -> bool:
        """Whether models are sharded by transformers' engine (`DistributedConfig`) rather than replicated (DDP)."""
        return self.tp_size > 1 or self.fsdp_size > 1

    @property
    def eval_lengths(self) -> list[int]:
        return sorted({self.train_length * f for f in self.eval_factors})

    def model_specs(self) -> dict[str, tuple[str, int]]:
        """`{model: (position encoding, training length)}` in the order given."""
        return {spec: parse_model_spec(spec, self.train_length) for spec in self.models}

    def train_lengths(self) -> list[int]:
        return sorted({length for _, length in self.model_specs().values()})


SMOKE_OVERRIDES = {
    "experiment": dict(train_length=32, eval_factors=[1, 2, 4], n_embd=64, n_layer=2, n_head=4, vocab_size=512,
                       eval_max_documents=4, max_train_documents=60, max_train_blocks=256, window_length=128,
                       cost_steps=2, cost_warmup_steps=1),
    "training": dict(max_steps=8, per_device_train_batch_size=8, logging_steps=4, save_steps=4, warmup_steps=0),
}  # fmt: skip


def apply_smoke(experiment: ExperimentArguments, training: TrainingArguments) -> None:
    """Shrink a run to the tiny smoke budget in place (the pipeline stays whole).

    Models trained at other lengths keep their ratio to `train_length`: `learned@256` of a run at 128 becomes
    `learned@64` at the smoke length 32.
    """
    old, new = experiment.train_length, SMOKE_OVERRIDES["experiment"]["train_length"]
    models = []
    for spec, (encoding, length) in experiment.model_specs().items():
        if "@" not in spec:
            models.append(spec)
        elif length * new % old:
            raise ValueError(f"model {spec!r}: its length ratio to train_length {old} has no smoke length at {new}")
        else:
            models.append(f"{encoding}@{length * new // old}")
    experiment.models = models
    for key, value in SMOKE_OVERRIDES["experiment"].items():
        setattr(experiment, key, value)
    for key, value in SMOKE_OVERRIDES["training"].items():
        setattr(training, key, value)


def batch_size_at(experiment: ExperimentArguments, training: TrainingArguments, length: int) -> int:
    """Per-device batch at training length `length`: `batch * train_length / length` sequences, the same tokens."""
    tokens = training.per_device_train_batch_size * experiment.train_length
    if tokens % length:
        raise ValueError(
            f"training length {length} does not divide the {tokens} tokens of a batch (per_device_train_batch_size "
            f"{training.per_device_train_batch_size} x train_length {experiment.train_length}): every model must see "
            "the same tokens per step"
        )
    return tokens // length


CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # package data: shipped in the wheel
CLONE_CONFIGS = ("recipes", "configs")  # where a clone's commands (README, Makefile) used to find them


def shipped_configs() -> list[str]:
    """Names of the configs shipped with the package (`cpu_demo`, `smoke`, ...), each usable as `--config NAME`."""
    return sorted(path.stem for path in CONFIGS_DIR.glob("*.yaml"))


def resolve_config(value: str) -> Path:
    """The YAML file `--config value` means: an existing file, else a shipped config named `value` (`cpu_demo`,
    `cpu_demo.yaml`, or `recipes/configs/cpu_demo.yaml` as a clone's commands write it)."""
    path = Path(value)
    if path.is_file():
        return path
    if path.suffix in ("", ".yaml") and (len(path.parts) == 1 or path.parent.parts[-2:] == CLONE_CONFIGS):
        shipped = CONFIGS_DIR / f"{path.stem}.yaml"
        if shipped.is_file():
            return shipped
    names = ", ".join(shipped_configs())
    raise ValueError(f"config {value!r}: no such file, and not a shipped config (shipped: {names})")


class ArgumentParser(HfArgumentParser):
    """`HfArgumentParser` whose usage errors raise `ValueError` (the `hf-alibi` command prints them on one line)."""

    def error(self, message: str):
        raise ValueError(f"{message} (see --help)")


def parse_args(argv: list[str], *dataclass_types, training_arguments: bool = True, prog: str | None = None):
    """Parse `--config FILE_OR_NAME` plus overrides into `(*dataclass_types, TrainingArguments)` instances.

    The config is a flat YAML file of argument names (`resolve_config`); the command line overrides it. Without
    `training_arguments`, only `dataclass_types` are parsed. Unknown YAML keys and bad options raise a `ValueError`
    naming them (a typo must not silently fall back to a default). `prog` names the command in `--help`.
    """
    types = (*dataclass_types, TrainingArguments) if training_arguments else dataclass_types
    description = (
        "--config FILE_OR_NAME: a flat YAML file of these arguments, or a shipped config "
        f"({', '.join(shipped_configs())}); options given here override it."
    )
    parser = ArgumentParser(types, prog=prog, description=description)
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
    return parser.parse_args_into_dataclasses(args=rest)


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
