"""Length-extrapolation evaluation ("train short, test long"): exact, token-weighted perplexity at many lengths.

Two protocols, both defined on windows whose model input is exactly `L` tokens:

- **nonoverlapping** (the paper's, as fairseq evaluates it): a document `x` is cut into consecutive windows
  `x[kL : kL + L + 1]`; the model reads the first `L` tokens and predicts the last `L`. Consecutive windows share
  one boundary token, so every token but the document's first is scored exactly once, with `1..L` tokens of
  context.
- **sliding** with stride `S` (the Hugging Face "perplexity of fixed-length models" method, done exactly): the
  window start advances by `S`; after the first window only the targets not scored before (the last `S`) count,
  so each token is scored once with `L - S + 1..L` tokens of context. The last window is aligned to the document's
  end so that it still reads `L` tokens. With `S == L` this is exactly the nonoverlapping protocol.

Every length scores the same tokens (so a table row compares like with like): documents shorter than
`max(lengths) + 1` tokens are skipped, and the others are cut to `1 + k * max(lengths)` tokens, a whole number of
windows at every length that divides the longest (true for `L_train * 2**i`). Counts of skipped documents and
dropped tail tokens are reported.

Perplexity is `exp(sum of per-token NLL / number of scored tokens)`, summed in float64 (never a mean of batch
means). Models with a position table (`max_length`, or `config.n_positions` for `model_type == "gpt2"`) get an
"unsupported" entry for longer lengths instead of an index error.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Largest number of logits upcast at once by the loss (64 MiB of float32): bounds the loss's own memory,
# independently of the batch and the vocabulary.
_LOSS_CHUNK_ELEMENTS = 2**24


@dataclass
class PositionLoss:
    """Mean NLL of nonoverlapping targets bucketed by context length `c` (tokens seen): `[start, end)`, powers of 2."""

    context_start: list[int]
    context_end: list[int]
    mean_nll: list[float]
    count: list[int]


@dataclass
class LengthResult:
    """Everything measured for one model at one evaluation length `length` (the model's input length)."""

    length: int
    factor: float | None = None  # length / train_length
    unsupported: str | None = None  # why the model was not run at this length; the numbers below are then empty
    stride: int | None = None
    ppl_nonoverlapping: float | None = None
    ppl_sliding: float | None = None
    nll_nonoverlapping: float | None = None  # summed over scored tokens
    nll_sliding: float | None = None
    tokens_nonoverlapping: int = 0
    tokens_sliding: int = 0
    windows_nonoverlapping: int = 0
    windows_sliding: int = 0
    position_loss: PositionLoss | None = None
    seconds: float = 0.0


@dataclass
class DocumentSelection:
    """Which documents every length scores (see the module docstring)."""

    documents: int
    skipped: int  # documents shorter than min_tokens
    min_tokens: int
    tokens_used: int
    tokens_dropped: int  # tail tokens cut from used documents to a whole number of the longest windows
    fingerprint: str  # sha256 of the used token ids


@dataclass
class ModelEvaluation:
    """Results of one model at every requested length; `to_dict` / `from_dict` round-trip through JSON."""

    model: str
    train_length: int | None
    max_length: int | None  # the model's position limit, None when unbounded
    selection: DocumentSelection
    lengths: list[LengthResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelEvaluation:
        lengths = []
        for item in data["lengths"]:
            item = dict(item)
            if item.get("position_loss") is not None:
                item["position_loss"] = PositionLoss(**item["position_loss"])
            lengths.append(LengthResult(**item))
        return cls(
            model=data["model"],
            train_length=data.get("train_length"),
            max_length=data.get("max_length"),
            selection=DocumentSelection(**data["selection"]),
            lengths=lengths,
        )

    def by_length(self) -> dict[int, LengthResult]:
        return {result.length: result for result in self.lengths}


def perplexity(nll_sum: float, tokens: int) -> float:
    """`exp(nll_sum / tokens)`, inf instead of an OverflowError."""
    if tokens <= 0:
        raise ValueError(f"perplexity needs at least one scored token, got tokens={tokens}")
    mean = nll_sum / tokens
    return math.exp(mean) if mean < 709.0 else math.inf


def nonoverlapping_windows(num_tokens: int, length: int) -> list[tuple[int, int]]:
    """`(start, score_from)` of each window over a document of `num_tokens`: input `[start, start + length)`."""
    return [(start, 0) for start in range(0, num_tokens - length, length)]


def sliding_windows(num_tokens: int, length: int, stride: int) -> list[tuple[int, int]]:
    """`(start, score_from)` of each sliding window; targets at window positions `>= score_from` are scored.

    Window `start` predicts targets `start + 1 .. start + length`; each target is scored by the first window that
    covers it, so the union is `1 .. num_tokens - 1`, each once.
    """
    if not 1 <= stride <= length:
        raise ValueError(f"stride must be in [1, length={length}], got {stride}")
    last_target = num_tokens - 1
    if last_target < length:
        return []
    windows = [(0, 0)]
    covered = length  # highest target scored so far
    while covered < last_target:
        start = min(windows[-1][0] + stride, last_target - length)  # last window ends at the document's end
        windows.append((start, covered - start))
        covered = start + length
    return windows


def select_documents(
    documents: list[torch.Tensor], lengths: list[int], max_documents: int | None = None
) -> tuple[list[torch.Tensor], DocumentSelection]:
    """Keep documents of at least `max(lengths) + 1` tokens, cut to `1 + k * max(lengths)` tokens (module docstring)."""
    span = max(lengths)
    kept, skipped, dropped = [], 0, 0
    for doc in documents:
        if doc.dim() != 1:
            raise ValueError(f"documents must be 1-D token id tensors, got shape {tuple(doc.shape)}")
        n = doc.numel()
        if n < span + 1:
            skipped += 1
            continue
        if max_documents is not None and len(kept) >= max_documents:
            break
        keep = 1 + span * ((n - 1) // span)
        kept.append(doc[:keep].long())
        dropped += n - keep
    if not kept:
        longest = max((doc.numel() for doc in documents), default=0)
        raise ValueError(
            f"no document has the {span + 1} tokens the longest length {span} needs (longest has {longest}); "
            "lower the lengths or supply longer documents"
        )
    selection = DocumentSelection(
        documents=len(kept),
        skipped=skipped,
        min_tokens=span + 1,
        tokens_used=sum(doc.numel() for doc in kept),
        tokens_dropped=dropped,
        fingerprint=documents_fingerprint(kept),
    )
    return kept, selection


def documents_fingerprint(documents: list[torch.Tensor]) -> str:
    """sha256 of the token ids (int64, document boundaries included): the same number means the same eval set."""
    digest = hashlib.sha256()
    for doc in documents:
        digest.update(doc.numel().to_bytes(8, "little"))
        digest.update(doc.to(torch.int64).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def position_limit(model: torch.nn.Module, max_length: int | None = None) -> int | None:
    """The longest input the model can run: `max_length` if given, GPT-2's position table, else None (unbounded)."""
    if max_length is not None:
        return max_length
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) == "gpt2":
        return config.n_positions
    return None


def evaluate_model(
    model: torch.nn.Module,
    documents: list[torch.Tensor],
    lengths: list[int],
    *,
    name: str = "model",
    train_length: int | None = None,
    stride: int | None = None,
    batch_tokens: int = 4096,
    max_length: int | None = None,
    max_documents: int | None = None,
    sliding: bool = True,
) -> ModelEvaluation:
    """Nonoverlapping and sliding-window perplexity of a causal LM at each of `lengths`.

    Args:
        model: any causal LM whose forward takes `input_ids` and returns `.logits` of shape (B, L, V).
        documents: held-out documents, 1-D LongTensors of token ids.
        lengths: evaluation lengths (model input tokens), e.g. `[L_train * f for f in (1, 2, 4, 8, 16)]`.
        name: how the model is named in the results.
        train_length: the training length; only used to report `factor`.
        stride: sliding-window stride; None means `length // 2` at each length. Must not exceed any length.
        batch_tokens: input tokens per forward; a batch holds `max(1, batch_tokens // length)` windows.
        max_length: the model's position limit, overriding what `position_limit` reads from its config.
        max_documents: evaluate only the first this-many eligible documents.
        sliding: also run the sliding-window protocol (it costs about `length / stride` times more).
    """
    lengths = sorted(set(lengths))
    if not lengths or any(not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive integers, got {lengths}")
    if stride is not None and not 1 <= stride <= lengths[0]:
        raise ValueError(f"stride must be in [1, shortest length {lengths[0]}], got {stride}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be positive, got {batch_tokens}")
    docs, selection = select_documents(documents, lengths, max_documents)
    limit = position_limit(model, max_length)
    evaluation = ModelEvaluation(model=name, train_length=train_length, max_length=limit, selection=selection)

    was_training = model.training
    model.eval()
    try:
        for length in lengths:
            evaluation.lengths.append(
                _evaluate_length(model, docs, length, train_length, stride, batch_tokens, limit, sliding)
            )
    finally:
        model.train(was_training)
    return evaluation


def _evaluate_length(model, docs, length, train_length, stride, batch_tokens, limit, sliding) -> LengthResult:
    factor = length / train_length if train_length else None
    if limit is not None and length > limit:
        return LengthResult(length=length, factor=factor, unsupported=f"unsupported: exceeds position table of {limit}")
    began = time.perf_counter()
    windows = [
        (d, start, score_from)
        for d, doc in enumerate(docs)
        for start, score_from in nonoverlapping_windows(doc.numel(), length)
    ]
    nll, tokens, by_position = _score_windows(model, docs, windows, length, batch_tokens, track_positions=True)
    result = LengthResult(
        length=length,
        factor=factor,
        ppl_nonoverlapping=perplexity(nll, tokens),
        nll_nonoverlapping=nll,
        tokens_nonoverlapping=tokens,
        windows_nonoverlapping=len(windows),
        position_loss=_bucket_by_context(*by_position),
    )
    if sliding:
        result.stride = stride if stride is not None else max(1, length // 2)
        windows = [
            (d, start, score_from)
            for d, doc in enumerate(docs)
            for start, score_from in sliding_windows(doc.numel(), length, result.stride)
        ]
        nll, tokens, _ = _score_windows(model, docs, windows, length, batch_tokens, track_positions=False)
        result.ppl_sliding, result.nll_sliding = perplexity(nll, tokens), nll
        result.tokens_sliding, result.windows_sliding = tokens, len(windows)
    result.seconds = time.perf_counter() - began
    sliding_text = f"{result.ppl_sliding:.3f}" if result.ppl_sliding is not None else "-"
    logger.info(
        "length %d: perplexity %.3f nonoverlapping, %s sliding, %d tokens, %.1f s",
        length,
        result.ppl_nonoverlapping,
        sliding_text,
        result.tokens_nonoverlapping,
        result.seconds,
    )
    return result


@torch.inference_mode()
def _score_windows(model, docs, windows, length, batch_tokens, track_positions):
    """Summed NLL (float64) and count of scored targets over `windows` = [(doc, start, score_from)]."""
    device = next(model.parameters()).device
    per_batch = max(1, batch_tokens // length)
    positions = torch.arange(length, device=device)
    nll_sum, count = 0.0, 0
    position_sum = torch.zeros(length, dtype=torch.float64, device=device)
    position_count = torch.zeros(length, dtype=torch.int64, device=device)
    for first in range(0, len(windows), per_batch):
        batch = windows[first : first + per_batch]
        tokens = torch.stack([docs[d][start : start + length + 1] for d, start, _ in batch]).to(device)  # (B, L + 1)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits  # (B, L, V)
        nll = token_nll(logits, tokens[:, 1:])  # (B, L) float64
        del logits  # only one batch of full-vocab logits is ever alive
        score_from = torch.tensor([s for _, _, s in batch], device=device)
        scored = positions[None, :] >= score_from[:, None]  # (B, L)
        nll = nll.masked_fill(~scored, 0.0)
        nll_sum += nll.sum().item()
        count += int(scored.sum().item())
        if track_positions:
            position_sum += nll.sum(0)
            position_count += scored.sum(0)
    return nll_sum, count, (position_sum.cpu(), position_count.cpu())


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token NLL (B, L) in float64 of `targets` (B, L) under `logits` (B, L, V), log-softmax in sequence chunks.

    Half-precision logits are upcast to float32 (float64 stays float64), one chunk at a time, so the loss never
    holds a second full-size copy of the logits.
    """
    batch, seq, vocab = logits.shape
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    chunk = max(1, _LOSS_CHUNK_ELEMENTS // (batch * vocab))
    out = torch.empty(batch, seq, dtype=torch.float64, device=logits.device)
    for begin in range(0, seq, chunk):
        piece = logits[:, begin : begin + chunk].to(compute_dtype)  # (B, c, V)
        nll = F.cross_entropy(piece.flatten(0, 1), targets[:, begin : begin + chunk].flatten(), reduction="none")
        out[:, begin : begin + chunk] = nll.view(batch, -1).double()
    return out


def _bucket_by_context(position_sum: torch.Tensor, position_count: torch.Tensor) -> PositionLoss:
    """Bucket per-position sums (window position i = context length i + 1) into `[2**k, 2**(k + 1))`."""
    length = position_sum.numel()
    starts, ends, means, counts = [], [], [], []
    start = 1
    while start <= length:
        end = min(2 * start, length + 1)
        n = int(position_count[start - 1 : end - 1].sum())
        if n:
            starts.append(start)
            ends.append(end)
            counts.append(n)
            means.append(float(position_sum[start - 1 : end - 1].sum()) / n)
        start *= 2
    return PositionLoss(context_start=starts, context_end=ends, mean_nll=means, count=counts)


__all__ = [
    "DocumentSelection",
    "LengthResult",
    "ModelEvaluation",
    "PositionLoss",
    "documents_fingerprint",
    "evaluate_model",
    "nonoverlapping_windows",
    "perplexity",
    "position_limit",
    "select_documents",
    "sliding_windows",
    "token_nll",
]
