"""A byte-level BPE tokenizer trained locally on a corpus's training split, cached on disk.

GPT-2's own tokenizer would need the Hub (and `tiktoken` downloads its encodings at run time), and its 50k vocabulary
makes the output layer dominate a small model on a CPU. A byte-level BPE trained with `tokenizers` on the training
documents only (never the held-out ones) takes seconds, encodes any text losslessly, and is wrapped as a
`transformers.PreTrainedTokenizerFast` so `save_pretrained` / `AutoTokenizer.from_pretrained` work as usual.

    tokenizer = load_or_train_tokenizer(corpus["train"], vocab_size=8192)
"""

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ...atomic_files import write_folder_atomically
from .corpus import corpus_fingerprint

END_OF_TEXT = "<|endoftext|>"
# Bump when the training recipe below changes, so caches made by an older recipe are not reused.
_RECIPE_VERSION = "bytelevel-bpe-v1"


def default_cache_dir() -> Path:
    """`$HF_ALIBI_CACHE/tokenizers`, else `$XDG_CACHE_HOME/hf_alibi/tokenizers`, else `~/.cache/hf_alibi/tokenizers`."""
    if "HF_ALIBI_CACHE" in os.environ:
        return Path(os.environ["HF_ALIBI_CACHE"]) / "tokenizers"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_alibi" / "tokenizers"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2's pre-tokenization, all 256 bytes in the alphabet) on `texts`.

    Args:
        texts: The training documents.
        vocab_size: Size of the vocabulary, including the 256 bytes and `<|endoftext|>` (at least 257).

    `<|endoftext|>` is the only special token and serves as bos, eos and pad, as in GPT-2. `decode(encode(text))`
    gives back `text` exactly.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 257:
        raise ValueError(f"vocab_size must be an integer >= 257 (256 bytes + {END_OF_TEXT}), got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        # Transformers' default clean-up rewrites " ." and " n't", which would break the exact round trip.
        clean_up_tokenization_spaces=False,
    )


def tokenizer_cache_key(train: Dataset, vocab_size: int) -> str:
    """The cache folder name: a hash of the training split's `corpus_fingerprint`, the vocab size and the recipe."""
    key = f"{corpus_fingerprint(train)}\0{vocab_size}\0{_RECIPE_VERSION}"
    return f"bpe{vocab_size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load_or_train_tokenizer(
    train: Dataset, vocab_size: int = 8192, cache_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """The tokenizer for a training split (columns `source`, `text`): loaded from the cache, else trained and cached.

    Args:
        train: The training documents, e.g. `load_text_corpus()["train"]`. Never pass held-out documents.
        vocab_size: See `train_tokenizer`.
        cache_dir: Where tokenizers are cached, one folder per `tokenizer_cache_key`; default `default_cache_dir()`.

    A new tokenizer is saved into a temporary folder and then renamed into place, so an interrupted run never leaves
    a half-written cache entry, and of two processes racing to write the same entry the first rename wins.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / tokenizer_cache_key(train, vocab_size)
    if not final.is_dir():
        tokenizer = train_tokenizer(train["text"], vocab_size)
        try:
            write_folder_atomically(final, tokenizer.save_pretrained)
        except (OSError, ValueError):  # ValueError: `final` was filled meanwhile
            if not final.is_dir():  # not a lost race: a real failure
                raise
    return AutoTokenizer.from_pretrained(final)


__all__ = ["END_OF_TEXT", "default_cache_dir", "load_or_train_tokenizer", "tokenizer_cache_key", "train_tokenizer"]
