"""A passkey retrieval probe: a random digit string planted at a controlled depth in filler text, asked for at the end.

    template = PasskeyTemplate.from_tokenizer(tokenizer)               # needle and question as token ids
    stream = filler_stream(heldout_documents, tokenizer.eos_token_id)  # the corpus's own text, documents joined by EOS
    examples = probe_examples(stream, template, length=2048, depths=[0.0, 0.5, 1.0], samples=93, seed=0)
    correct = score_examples(model, examples)                          # exact match of the greedy digits, per example
    low, high = wilson_interval(sum(correct), len(correct))

An example is `length` tokens: filler, the needle ("pass key 48213.", on a line of its own) after `depth` of the
filler, more filler, and the question at the end: the needle's words again ("pass key ", on a new line), followed by
the key's digits. The template is short (32 byte-level tokens with the key twice) so that models trained at a short
length see mostly filler, and the cue repeats the needle's words exactly: recalling the key is the copy (induction)
a language model learns, not the parsing of an English question, which small models do not learn on this budget. `depth` 0 puts
the needle first, 1 right before the question (the same distance at every length: a control of local copying).
The key is drawn again until its digits occur nowhere in the filler, so the only place to read it from is the needle.
Every piece is encoded on its own and the ids concatenated (each digit one token for any byte-level tokenizer), so
the answer's ids are exactly the needle's digits, whatever the tokenizer merges.

Scoring is one forward over the example minus its last token: the greedy digits equal the key exactly when the argmax
at each answer position is the next true digit (greedy decoding that is right so far has read exactly the true
prefix), so one teacher-forced forward gives greedy decoding's exact match without a decoding loop, at exactly
`length` tokens. For the arms whose attention depends on the input length (dynamic NTK, ALiBi slope interpolation)
every answer position then sees the scale of the whole `length` tokens, where a cached decoder would use its own,
at most `digits - 1` tokens shorter.

Training documents (`passkey_blocks`) are the same construction at the training length with a uniform random depth:
every one fits in the training length, so the models learn the task only within it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

NEEDLE = ("pass key ", ".")  # around the key
QUESTION = "pass key "  # the needle's own words: the cue to recall what followed them
SEPARATOR = "\n"
Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class PasskeyTemplate:
    """The probe's fixed pieces as token ids: needle before and after the key, the question, the ten digits."""

    needle_head: tuple[int, ...]
    needle_tail: tuple[int, ...]
    question: tuple[int, ...]
    digit_ids: tuple[int, ...]  # digit_ids[d] is the id of the character str(d)
    digits: int = 5

    @classmethod
    def from_tokenizer(cls, tokenizer, digits: int = 5) -> PasskeyTemplate:
        """The template encoded piece by piece with `tokenizer` (no special tokens); `digits` per key."""
        if isinstance(digits, bool) or not isinstance(digits, int) or digits < 1:
            raise ValueError(f"passkey digits must be a positive integer, got {digits!r}")

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

        digit_ids = [ids(str(d)) for d in range(10)]
        if any(len(piece) != 1 for piece in digit_ids):
            raise ValueError(f"the tokenizer must encode each digit as one token, got {digit_ids}")
        return cls(
            ids(SEPARATOR + NEEDLE[0]),
            ids(NEEDLE[1] + SEPARATOR),
            ids(SEPARATOR + QUESTION),
            tuple(piece[0] for piece in digit_ids),
            digits,
        )

    @property
    def overhead(self) -> int:
        """Tokens of an example that are not filler: needle, question and the key twice."""
        return len(self.needle_head) + len(self.needle_tail) + len(self.question) + 2 * self.digits


@dataclass(frozen=True)
class PasskeyExample:
    """One probe: `input_ids` (length tokens), its `key`, where the needle's key and the answer start."""

    input_ids: tuple[int, ...]
    key: str
    depth: float
    needle_position: int  # index of the needle's first digit
    answer_position: int  # index of the answer's first digit (the last `digits` tokens)


def filler_stream(documents: Sequence[torch.Tensor], eos_token_id: int) -> torch.Tensor:
    """Documents' token ids joined by EOS (as `pack_documents` packs them): the filler the probe cuts windows from."""
    if not documents:
        raise ValueError("filler_stream needs at least one document")
    eos = torch.tensor([eos_token_id])
    return torch.cat([piece for doc in documents for piece in (doc.long().flatten(), eos)])


def _contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    return any(tuple(haystack[i : i + n]) == tuple(needle) for i in range(len(haystack) - n + 1))


def draw_key(rng: random.Random, template: PasskeyTemplate, filler: Sequence[int]) -> str:
    """A uniform random key of `template.digits` digits whose ids occur nowhere in `filler` (drawn again if so)."""
    for _ in range(1000):
        key = "".join(rng.choice("0123456789") for _ in range(template.digits))
        if not _contains(filler, key_ids(template, key)):
            return key
    raise ValueError(f"no {template.digits}-digit key avoids the filler after 1000 draws: use more digits")


def key_ids(template: PasskeyTemplate, key: str) -> tuple[int, ...]:
    return tuple(template.digit_ids[int(c)] for c in key)


def make_example(
    filler: Sequence[int], template: PasskeyTemplate, length: int, depth: float, rng: random.Random
) -> PasskeyExample:
    """An example of exactly `length` tokens from the first `length - template.overhead` ids of `filler`, the needle
    after `round(depth * filler tokens)` of them."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    size = length - template.overhead
    if size < 0:
        raise ValueError(f"length {length} is shorter than the passkey template's {template.overhead} tokens")
    if len(filler) < size:
        raise ValueError(f"filler has {len(filler)} tokens, the example needs {size}")
    filler = [int(t) for t in filler[:size]]
    key = draw_key(rng, template, filler)
    digits = key_ids(template, key)
    cut = round(depth * size)
    head = filler[:cut] + list(template.needle_head)
    ids = head + list(digits) + list(template.needle_tail) + filler[cut:] + list(template.question) + list(digits)
    return PasskeyExample(tuple(ids), key, depth, len(head), len(ids) - template.digits)


def probe_examples(
    stream: torch.Tensor, template: PasskeyTemplate, length: int, depths: Sequence[float], samples: int, seed: int
) -> list[PasskeyExample]:
    """`samples` examples of `length` tokens at each depth (depth-major), deterministic in `seed`: each from a
    random window of `stream`, the same windows at every depth."""
    size = length - template.overhead
    if stream.numel() < size:
        raise ValueError(f"the filler stream holds {stream.numel()} tokens, a {length}-token example needs {size}")
    rng = random.Random(f"passkey-{seed}-{length}")
    starts = [rng.randrange(stream.numel() - size + 1) for _ in range(samples)]
    return [
        make_example(stream[s : s + size].tolist(), template, length, depth, rng) for depth in depths for s in starts
    ]


def passkey_blocks(
    filler_blocks: Sequence[Sequence[int]], template: PasskeyTemplate, length: int, seed: int
) -> list[list[int]]:
    """Training documents: one `length`-token example per filler block (its own first ids), uniform random depth."""
    rng = random.Random(f"passkey-train-{seed}")
    return [list(make_example(block, template, length, rng.random(), rng).input_ids) for block in filler_blocks]


@torch.inference_mode()
def score_examples(model: torch.nn.Module, examples: Sequence[PasskeyExample], batch_size: int = 8) -> list[bool]:
    """Per example, whether greedy decoding after the question gives the key exactly (module docstring: one
    teacher-forced forward over the example minus its last token)."""
    device = next(model.parameters()).device
    correct = []
    for first in range(0, len(examples), batch_size):
        batch = examples[first : first + batch_size]
        if len({len(e.input_ids) for e in batch}) != 1:
            raise ValueError("score_examples needs examples of one length per batch (no padding)")
        ids = torch.tensor([e.input_ids for e in batch], device=device)  # (B, L)
        answer = batch[0].answer_position
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits[:, answer - 1 :]  # (B, digits, V)
        correct += (logits.argmax(-1) == ids[:, answer:]).all(-1).tolist()
    return correct


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default): `(low, high)`."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got successes={successes}, n={n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def samples_for_half_width(half_width: float, z: float = Z_95) -> int:
    """The smallest n whose Wilson interval is narrower than +-`half_width` at every success count (widest at p = 1/2:
    half-width z / (2 sqrt(n + z^2)))."""
    if not 0 < half_width < 0.5:
        raise ValueError(f"half_width must be in (0, 0.5), got {half_width}")
    n = math.floor((z / (2 * half_width)) ** 2 - z * z) + 1
    return max(1, n)


__all__ = [
    "NEEDLE",
    "QUESTION",
    "PasskeyExample",
    "PasskeyTemplate",
    "draw_key",
    "filler_stream",
    "key_ids",
    "make_example",
    "passkey_blocks",
    "probe_examples",
    "samples_for_half_width",
    "score_examples",
    "wilson_interval",
]
