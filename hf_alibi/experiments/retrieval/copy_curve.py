"""The copy's learning curve: how well a model copies the passkey at its training length, step by step.

    examples = probe_examples(stream, template, train_length, [0.0, 0.5, 1.0], 93, seed=0)
    trainer = Trainer(..., callbacks=[CopyCurve(examples, every=250)])   # <output_dir>/copy_curve.json
    read_curve(Path(output_dir) / "copy_curve.json")   # [{"step", "learning_rate", "exact", "per_digit", ...}]

Per probe, one teacher-forced forward (as `passkey.score_examples`):

- `exact`: every answer digit is the argmax (greedy decoding returns the key): the retrieval accuracy;
- `per_digit`: the share of answer digits that are the argmax (chance: 1/10 once the model knows a digit comes);
- `copy_loss`: mean cross-entropy of the answer's digits, the copy (ln 10 = 2.303 for a model that knows only that
  a digit comes, 0 for a perfect copy);
- `needle_loss`: mean cross-entropy of the needle's digits, their first occurrence: random digits, so ln 10 is the
  best any model can do there.

A model that has not learned the copy has `copy_loss` at `needle_loss` (both near ln 10); the copy is learned when
`copy_loss` falls far below it. The probes are held-out text at exactly the training length, so the last point of a
curve is the run's retrieval at 1x.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import TrainerCallback

from ...atomic_files import write_text_atomically
from .passkey import PasskeyExample

CURVE_FILE = "copy_curve.json"


def _positions(batch: Sequence[PasskeyExample], start: str, digits: int) -> torch.Tensor:
    """`(B, digits)` token indices of each example's key at its `start` ("needle_position" or "answer_position")."""
    return torch.tensor([[getattr(e, start) + k for k in range(digits)] for e in batch])


def _at_key(logp: torch.Tensor, ids: torch.Tensor, batch, start: str, digits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log-probabilities predicting each key digit (B, digits, V), the digits (B, digits))` at `start`."""
    where = _positions(batch, start, digits).to(ids.device)  # (B, digits): the key's tokens
    predicted = logp.gather(1, (where - 1)[..., None].expand(-1, -1, logp.shape[-1]))  # read one token earlier
    return predicted, ids.gather(1, where)


@torch.inference_mode()
def copy_metrics(model: torch.nn.Module, examples: Sequence[PasskeyExample], batch_size: int = 32) -> dict:
    """`{"exact", "per_digit", "copy_loss", "needle_loss", "n"}` of `model` on `examples` (module docstring)."""
    if not examples:
        raise ValueError("copy_metrics needs at least one passkey example")
    if len({len(e.input_ids) for e in examples}) != 1:
        raise ValueError("copy_metrics needs examples of one length (no padding)")
    device = next(model.parameters()).device
    digits = len(examples[0].key)
    exact, right, copy_loss, needle_loss = 0, 0, 0.0, 0.0
    for first in range(0, len(examples), batch_size):
        batch = examples[first : first + batch_size]
        ids = torch.tensor([e.input_ids for e in batch], device=device)  # (B, L)
        logp = model(input_ids=ids[:, :-1], use_cache=False).logits.float().log_softmax(-1)  # (B, L - 1, V)
        predicted, answer = _at_key(logp, ids, batch, "answer_position", digits)  # the copy
        hits = predicted.argmax(-1) == answer  # (B, digits)
        exact += int(hits.all(-1).sum())
        right += int(hits.sum())
        copy_loss -= float(predicted.gather(2, answer[..., None]).sum())
        predicted, needle = _at_key(logp, ids, batch, "needle_position", digits)  # the first occurrence
        needle_loss -= float(predicted.gather(2, needle[..., None]).sum())
    n = len(examples)
    return {
        "exact": exact / n,
        "per_digit": right / (n * digits),
        "copy_loss": copy_loss / (n * digits),
        "needle_loss": needle_loss / (n * digits),
        "n": n,
    }


@torch.inference_mode()
def copy_attention(
    model: torch.nn.Module, examples: Sequence[PasskeyExample], batch_size: int = 32
) -> list[list[float]]:
    """`[layer][head]`: the mean attention weight from each answer query onto the needle digit it must copy.

    The query predicting answer digit k reads the cue's last token (k = 0) or answer digit k - 1; its earlier
    occurrence is the needle's token just before digit k, so an induction head (Olsson et al., 2022) attends to the
    needle's digit k. A head that copies puts most of its weight there; one that does not, about 1 / (its distance).
    `model` must return attentions (load it with `attn_implementation="eager"`).
    """
    device = next(model.parameters()).device
    digits = len(examples[0].key)
    total = None
    for first in range(0, len(examples), batch_size):
        batch = examples[first : first + batch_size]
        ids = torch.tensor([e.input_ids for e in batch], device=device)  # (B, L)
        attentions = model(input_ids=ids[:, :-1], use_cache=False, output_attentions=True).attentions
        if not attentions or attentions[0] is None:
            raise ValueError("the model returned no attention weights: load it with attn_implementation='eager'")
        queries = (_positions(batch, "answer_position", digits) - 1).to(device)  # (B, digits)
        keys = _positions(batch, "needle_position", digits).to(device)  # (B, digits)
        rows = torch.arange(len(batch), device=device)[:, None]  # (B, 1)
        weights = torch.stack([a[rows, :, queries, keys] for a in attentions])  # (layers, B, digits, heads)
        summed = weights.float().sum(dim=(1, 2))  # (layers, heads)
        total = summed if total is None else total + summed
    return (total / (len(examples) * digits)).tolist()


def read_curve(path: str | Path) -> list[dict]:
    """The points a `CopyCurve` wrote to `path`, by step ([] when there is no file)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.exists() else []


class CopyCurve(TrainerCallback):
    """Every `every` optimisation steps (and at the last), `copy_metrics` on `examples`, with the step and learning
    rate, kept in `<output_dir>/copy_curve.json` (rewritten atomically each time). A resumed run keeps the points up
    to its checkpoint's step and goes on from there."""

    def __init__(self, examples: Sequence[PasskeyExample], every: int, batch_size: int = 32):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"the copy curve's step interval must be a positive integer, got {every!r}")
        self.examples, self.every, self.batch_size = list(examples), every, batch_size
        self.points: list[dict] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.points = [p for p in read_curve(Path(args.output_dir) / CURVE_FILE) if p["step"] <= state.global_step]

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        if state.global_step % self.every and state.global_step != state.max_steps:
            return
        if not state.is_world_process_zero:
            return
        was_training = model.training
        model.eval()
        metrics = copy_metrics(model, self.examples, self.batch_size)
        model.train(was_training)
        rate = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else None  # as Trainer logs it
        self.points.append({"step": state.global_step, "learning_rate": rate, **metrics})
        write_text_atomically(Path(args.output_dir) / CURVE_FILE, json.dumps(self.points, indent=1) + "\n")


def first_step_at(curve: Sequence[dict], accuracy: float = 0.9) -> int | None:
    """The first step whose exact-match accuracy is at least `accuracy`, or None if the curve never gets there."""
    return next((p["step"] for p in curve if p["exact"] >= accuracy), None)


__all__ = ["CURVE_FILE", "CopyCurve", "copy_attention", "copy_metrics", "first_step_at", "read_curve"]
