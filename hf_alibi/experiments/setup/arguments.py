"""Recipe arguments: what a train-short/test-long experiment varies, one dataclass per concern, and the one object
the recipe reads (`ExperimentArguments`, all of them together).

    ComparisonArguments   which models are compared, and the length they train at
    EvaluationArguments   what is measured after training: perplexity by length, the attention window, the cost
    DataArguments         the corpus, its held-out split, the tokenizer
    ModelArguments        every model's size, or the checkpoint to fine-tune
    RunArguments          how the run is laid out and capped: sharding, training caps, the smoke budget
    RetrievalArguments    the retrieval experiment: passkey documents in training, the probe, the evaluation arms

`TrainingArguments` carry everything about optimisation. Every field is a YAML key and a command-line option of
`hf-alibi train` and `hf-alibi sweep` (`parsing.parse_args`); `--help` lists them by concern. The parser and the
token budget (`token_budget`: `batch_size_at`, `apply_smoke`) are re-exported here, where they used to live.
"""

import sys
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from ..._transformers_compat import require_transformers
from ...conversion.dispatch import EXACT_FAMILIES, FAMILY_NAMES, NAMES, spoken  # the help's family names
from ...models.alibi.transformers_compat import TENSOR_PARALLEL_TRANSFORMERS
from ..data.corpus import STDLIB_CORPUS
from .baselines import BASELINES
from .parsing import CONFIGS_DIR, ArgumentParser, parse_args, resolve_config, shipped_configs
from .retrieval_arguments import RetrievalArguments
from .token_budget import SMOKE_OVERRIDES, apply_smoke, batch_size_at

DEFAULT_MODELS = ["alibi", "learned", "sinusoidal"]


def _stacklevel_outside_hf_alibi() -> int:
    """`warnings.warn`'s stacklevel of the first caller outside `hf_alibi` (for the function calling this): a
    deprecation warning names the script, test or command that used the old name, and the test suite, which turns
    FutureWarnings located in hf_alibi into errors (pyproject.toml), fails if hf_alibi itself ever uses it."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "hf_alibi":
        level, frame = level + 1, frame.f_back
    return level


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
class ComparisonArguments:
    """Which models the experiment compares, and the length they train at."""

    _argument_group_name = "models compared"

    models: list[str] = field(
        default_factory=lambda: list(DEFAULT_MODELS),
        metadata={
            "help": f"Models to train: a position encoding from {list(BASELINES)}, trained at train_length, or "
            "ENCODING@LENGTH (e.g. learned@512) for another training length (same training tokens)."
        },
    )
    all_models: bool = field(default=False, metadata={"help": "Train every position encoding in BASELINES."})
    train_length: int = field(default=256, metadata={"help": "Training sequence length (tokens per block)."})
    model_max_steps: list[str] = field(
        default_factory=list,
        metadata={
            "help": "MODEL=STEPS: model MODEL trains STEPS steps (its schedule stretched over them) instead of "
            "max_steps; the other models keep max_steps. For a model the experiment shows needs longer (say why in "
            "the run's notes), e.g. nope=32000. Entries may name models this run does not train."
        },
    )

    def __post_init__(self):
        self.model_steps()  # a bad entry fails here, by name
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

    def model_specs(self) -> dict[str, tuple[str, int]]:
        """`{model: (position encoding, training length)}` in the order given."""
        return {spec: parse_model_spec(spec, self.train_length) for spec in self.models}

    def model_steps(self) -> dict[str, int]:
        """`{model: its own max_steps}` from `model_max_steps` (`ValueError` naming a bad entry)."""
        steps: dict[str, int] = {}
        for entry in self.model_max_steps:
            spec, _, count = (part.strip() for part in entry.partition("="))
            if not count.isdigit() or int(count) <= 0:
                raise ValueError(f"model_max_steps entry {entry!r} is not MODEL=STEPS with STEPS a positive integer")
            parse_model_spec(spec, 1)  # a known position encoding, or ValueError
            if spec in steps:
                raise ValueError(f"model_max_steps names {spec!r} twice: {self.model_max_steps}")
            steps[spec] = int(count)
        return steps

    def max_steps_of(self, name: str) -> int | None:
        """Model `name`'s own `max_steps`; None: it trains the run's `max_steps`."""
        return self.model_steps().get(name)

    def train_lengths(self) -> list[int]:
        return sorted({length for _, length in self.model_specs().values()})


@dataclass
class EvaluationArguments:
    """What is measured after training: perplexity at multiples of the training length, ALiBi's effective attention
    window, and the training cost of every model."""

    _argument_group_name = "evaluation"

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
        metadata={
            "help": "After training, timed training steps per model, interleaved across models, for the "
            "training-cost table (hf_alibi/experiments/training/training_cost.py); 0 skips it."
        },
    )
    cost_warmup_steps: int = field(
        default=2, metadata={"help": "Untimed steps per model before the interleaved timing (peak memory covers them)."}
    )

    def __post_init__(self):
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


@dataclass
class DataArguments:
    """The corpus, its held-out split and the tokenizer. No checks here: `data.load_text_corpus` checks the files,
    columns and held-out fraction against the data itself, before the run writes anything."""

    _argument_group_name = "data"

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


@dataclass
class ModelArguments:
    """Every model's size, or the checkpoint the ALiBi model is fine-tuned from."""

    _argument_group_name = "model"

    n_embd: int = field(default=256, metadata={"help": "Model width (all models)."})
    n_layer: int = field(default=4, metadata={"help": "Model depth (all models)."})
    n_head: int = field(default=8, metadata={"help": "Attention heads (all models)."})
    dropout: float = field(default=0.0, metadata={"help": "Every dropout probability."})
    init_from: str | None = field(
        default=None,
        metadata={
            "help": "Checkpoint (folder or Hub id) to fine-tune ('alibi' only), with its tokenizer: "
            f"{spoken(NAMES[family] for family in EXACT_FAMILIES)} (imported exactly by hf_alibi.convert) or "
            f"{NAMES['gpt2']} (converted: it must first learn ALiBi)."
        },
    )
    # The name init_from had while only GPT-2 could be imported. Kept, with a FutureWarning, so that old configs and
    # commands run; results record it as given (the key stays in results.md's experiment line).
    init_from_gpt2: str | None = field(
        default=None, metadata={"help": "Deprecated: the older name of init_from (which imports any family); use it."}
    )

    def __post_init__(self):
        if self.init_from_gpt2 is not None:
            warnings.warn(
                f"init_from_gpt2={self.init_from_gpt2!r} is deprecated: it is the older name of init_from (which "
                f"imports {spoken(FAMILY_NAMES, 'and')} checkpoints); use --init_from / init_from: instead",
                FutureWarning,
                stacklevel=_stacklevel_outside_hf_alibi(),
            )
            if self.init_from not in (None, self.init_from_gpt2):
                raise ValueError(f"init_from={self.init_from!r} and init_from_gpt2={self.init_from_gpt2!r}: give one")
            self.init_from = self.init_from_gpt2


@dataclass
class RunArguments:
    """How the run is laid out and capped: sharding over the launched processes, training caps, the smoke budget."""

    _argument_group_name = "run"

    tp_size: int = field(
        default=1,
        metadata={
            "help": "Tensor-parallel ranks (transformers' DistributedConfig; 'alibi' only): each rank holds "
            "1/tp_size of every block's heads and MLP. tp_size * fsdp_size = the launched processes."
        },
    )
    fsdp_size: int = field(
        default=1,
        metadata={
            "help": "FSDP2 ranks (transformers' DistributedConfig; 'alibi' only): parameters, gradients and "
            "optimizer state sharded 1/fsdp_size a rank; each rank trains on its own batches."
        },
    )
    max_train_documents: int | None = field(
        default=None, metadata={"help": "Cap on training documents (tokenizer and blocks; smoke runs)."}
    )
    max_train_blocks: int | None = field(default=None, metadata={"help": "Cap on training blocks (smoke runs)."})
    smoke: bool = field(
        default=False,
        metadata={
            "help": "Whole pipeline on a tiny model and budget (~2 minutes on 2 cores); its "
            "tables and plots say 'smoke run'."
        },
    )

    def __post_init__(self):
        for name in ("tp_size", "fsdp_size"):
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        if self.sharded:  # refused here, before any data or model is made, rather than at the first from_pretrained
            require_transformers(
                TENSOR_PARALLEL_TRANSFORMERS,
                f"tp_size={self.tp_size}, fsdp_size={self.fsdp_size} (transformers' tensor parallelism and FSDP2)",
            )

    @property
    def sharded(self) -> bool:
        """Whether models are sharded by transformers' engine (`DistributedConfig`) rather than replicated (DDP)."""
        return self.tp_size > 1 or self.fsdp_size > 1


# Bases listed last-part-first: a dataclass takes its bases' fields in reverse order, so the fields (and the
# `experiment` line of results.md, `asdict` of this) keep the order of `parts`, the order they had as one class.
@dataclass
class ExperimentArguments(
    RetrievalArguments, RunArguments, ModelArguments, DataArguments, EvaluationArguments, ComparisonArguments
):
    """Every argument of a train-short/test-long experiment, as one object with one attribute per field.

    Defined by its `parts`, which `parse_args` parses (one `--help` group each); built from keywords in code and
    tests (`ExperimentArguments(models=["alibi"], train_length=64)`). Each part checks its own fields; the checks
    that span parts are here.
    """

    _argument_group_name = "experiment"
    parts: ClassVar[tuple[type, ...]] = (
        ComparisonArguments,
        EvaluationArguments,
        DataArguments,
        ModelArguments,
        RunArguments,
        RetrievalArguments,
    )

    def __post_init__(self):
        for part in self.parts:
            if "__post_init__" in vars(part):  # DataArguments has no checks of its own
                part.__post_init__(self)
        if self.eval_stride is not None and not 1 <= self.eval_stride <= self.train_length:
            raise ValueError(f"eval_stride must be in [1, train_length={self.train_length}], got {self.eval_stride}")
        if self.sharded and [parse_model_spec(m, 1)[0] for m in self.models] != ["alibi"]:
            raise ValueError(
                f"tp_size={self.tp_size}, fsdp_size={self.fsdp_size} shard ALiBi models only (the baselines have no "
                f"tensor-parallel or FSDP plan): set models to ['alibi'], got {self.models}"
            )
        if self.init_from is not None and [parse_model_spec(m, 1)[0] for m in self.models] != ["alibi"]:
            raise ValueError(f"init_from fine-tunes one ALiBi model: set models to ['alibi'], got {self.models}")
        if self.retrieval:
            from .eval_arms import parse_arm

            for arm in self.eval_arms:
                parse_arm(arm, self.models)

    @property
    def eval_lengths(self) -> list[int]:
        return sorted({self.train_length * f for f in self.eval_factors})


__all__ = [
    "ArgumentParser",
    "CONFIGS_DIR",
    "ComparisonArguments",
    "DataArguments",
    "EvaluationArguments",
    "ExperimentArguments",
    "ModelArguments",
    "RetrievalArguments",
    "RunArguments",
    "SMOKE_OVERRIDES",
    "apply_smoke",
    "batch_size_at",
    "parse_args",
    "parse_model_spec",
    "resolve_config",
    "shipped_configs",
]
