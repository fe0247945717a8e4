"""Training cost measured the same way for every model: interleaved timed steps, warm-up excluded.

A training run's own clock (Trainer's `train_samples_per_second`) is a poor basis for comparing models on a shared
machine: models train one after the other, so a burst of load on the machine lands on whichever model is training
then, and the run's wall time also holds checkpoint saves, logging and the first step's one-time set-up. Measured
for the recipe's byte-level models in one process (README "Training cost"), the per-step medians of two models
agreed within 1% while their Trainer figures differed by 13%: a load burst during three steps of one of them.

So every model is measured again, after training, the way the benchmark harness measures (`benchmarks/`):

    costs = measure_training_costs({"alibi": build_alibi, "learned": build_learned}, steps=10, warmup=2)

- each `build()` returns `(model, optimizer, batch)`: a fresh model, the optimizer Trainer would create for it
  (`Trainer.create_optimizer`), and one batch exactly as the recipe's collator makes it;
- peak memory: the growth of the process (`PeakMemory`) while the model is built and runs its warm-up steps:
  weights, gradients, optimizer state and activations, one model at a time, after freed memory is returned;
- time: `steps` rounds; in each round every model runs one training step (forward on the batch, backward, gradient
  clipping, optimizer step, zero_grad: what Trainer does per step), the order rotating by one model each round, so
  every model sees the same load; per model the median step, and tokens/s = tokens in the batch / that median.

The step time does not depend on the weights, so fresh models measure what the trained ones cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from .peak_memory import PeakMemory

Builder = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer, dict]]


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, max_grad_norm: float) -> None:
    """One optimisation step as Trainer runs it: loss on `batch`, backward, clip (when `max_grad_norm` > 0), step."""
    model(**batch).loss.backward()
    if max_grad_norm and max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_training_costs(
    builders: Mapping[str, Builder],
    *,
    steps: int = 10,
    warmup: int = 2,
    max_grad_norm: float = 1.0,
    device: torch.device | str = "cpu",
) -> dict[str, dict]:
    """`{name: {"tokens_per_second", "step_seconds_median", "step_seconds", "peak_memory_mib", ...}}` (module doc)."""
    if steps < 1 or warmup < 1:
        raise ValueError(f"steps and warmup must be at least 1, got steps={steps}, warmup={warmup}")
    built, results = {}, {}
    for name, build in builders.items():
        with PeakMemory(device) as peak:
            model, optimizer, batch = build()
            model.train()
            for _ in range(warmup):
                training_step(model, optimizer, batch, max_grad_norm)
        built[name] = (model, optimizer, batch)
        results[name] = {**peak.result(), "tokens_per_step": batch["input_ids"].numel()}
    times: dict[str, list[float]] = {name: [] for name in built}
    order = list(built)
    for round_index in range(steps):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            model, optimizer, batch = built[name]
            began = time.perf_counter()
            training_step(model, optimizer, batch, max_grad_norm)
            times[name].append(time.perf_counter() - began)
    for name, seconds in times.items():
        median = statistics.median(seconds)
        results[name].update(
            step_seconds_median=round(median, 7),
            step_seconds=[round(s, 7) for s in seconds],
            tokens_per_second=round(results[name]["tokens_per_step"] / median, 1),
            protocol=f"{steps} interleaved steps after {warmup} warm-up steps, rotating order; median",
        )
    return results


__all__ = ["measure_training_costs", "training_step"]
