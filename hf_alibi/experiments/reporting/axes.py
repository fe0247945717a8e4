"""What the tables (`results`) and the figures (`plots`) both read off a set of evaluations: the lengths on the
x axis, the training length they are labelled against, whether the models were trained at several lengths, and
the unit of a bits axis. Here, below both, so that neither imports the other to get them.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..length.length_eval import ModelEvaluation


def bits_unit(bytes_per_token: float | None) -> str:
    """What `bits` measures: "bits per byte" when the evaluation text's bytes per token is known."""
    return "bits per byte" if bytes_per_token else "bits per token"


def evaluated_lengths(results: Mapping[str, ModelEvaluation]) -> list[int]:
    """Every evaluation length of any model, ascending: the tables' columns and the figures' x ticks."""
    return sorted({r.length for ev in results.values() for r in ev.lengths})


def reference_train_length(results: Mapping[str, ModelEvaluation]) -> int | None:
    """The training length the columns are labelled against: the shortest one."""
    return min((ev.train_length for ev in results.values() if ev.train_length), default=None)


def mixed_train_lengths(results: Mapping[str, ModelEvaluation]) -> bool:
    """Whether the models were trained at different lengths (the paper's Figure 1 layout then)."""
    return len({ev.train_length for ev in results.values() if ev.train_length}) > 1


__all__ = ["bits_unit", "evaluated_lengths", "mixed_train_lengths", "reference_train_length"]
