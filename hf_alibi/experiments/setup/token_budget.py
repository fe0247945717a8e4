"""A run's token budget: the per-device batch at each training length that gives every model the same tokens per
step (`batch_size_at`), and the smoke budget that shrinks a whole run to about 2 minutes on 2 cores (`apply_smoke`).

Both read `ExperimentArguments` with `TrainingArguments`; `arguments` re-exports them, where they always lived.
This module sits below `arguments` (which imports it): what it reads of a run's arguments is the `RunShape`
protocol here, which `ExperimentArguments` satisfies, so it never imports `arguments` back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import TrainingArguments


class RunShape(Protocol):
    """The part of `ExperimentArguments` the token budget reads and (smoke) rewrites."""

    train_length: int
    models: list[str]
    model_max_steps: list[str]

    def model_specs(self) -> dict[str, tuple[str, int]]: ...


SMOKE_OVERRIDES = {
    "experiment": dict(
        train_length=32,
        eval_factors=[1, 2, 4],
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=512,
        eval_max_documents=4,
        max_train_documents=60,
        max_train_blocks=256,
        window_length=128,
        cost_steps=2,
        cost_warmup_steps=1,
    ),
    "training": dict(max_steps=8, per_device_train_batch_size=8, logging_steps=4, save_steps=4, warmup_steps=0),
}


def apply_smoke(experiment: RunShape, training: TrainingArguments) -> None:
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
    experiment.model_max_steps = []  # every model trains the smoke budget
    for key, value in SMOKE_OVERRIDES["experiment"].items():
        setattr(experiment, key, value)
    for key, value in SMOKE_OVERRIDES["training"].items():
        setattr(training, key, value)


def batch_size_at(experiment: RunShape, training: TrainingArguments, length: int) -> int:
    """Per-device batch at training length `length`: `batch * train_length / length` sequences, the same tokens."""
    tokens = training.per_device_train_batch_size * experiment.train_length
    if tokens % length:
        raise ValueError(
            f"training length {length} does not divide the {tokens} tokens of a batch (per_device_train_batch_size "
            f"{training.per_device_train_batch_size} x train_length {experiment.train_length}): every model must see "
            "the same tokens per step"
        )
    return tokens // length


__all__ = ["SMOKE_OVERRIDES", "RunShape", "apply_smoke", "batch_size_at"]
