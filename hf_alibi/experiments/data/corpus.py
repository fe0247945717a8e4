"""Text data for train-short, test-long experiments: corpora, a held-out split by document, packing.

Offline by default: the default corpus (`"python-stdlib"`) is the running interpreter's own standard library
source, one document per file, so every machine with the same Python has the same corpus and
`corpus_fingerprint` records exactly which one a result came from. Anything `datasets` can load (a Hub dataset, or
local text / json / csv / parquet files) works too, through `load_text_corpus`.

Every corpus is a `datasets.DatasetDict` with splits `train` and `validation`, one row per document and the
columns `source` (where the document came from: a relative path, or `split/row`) and `text`.

    corpus = load_text_corpus()                                     # the Python standard library
    tokenizer = load_or_train_tokenizer(corpus["train"])            # hf_alibi.experiments.data.tokenization
    train = pack_documents(corpus["train"], tokenizer, block_size=256)
    heldout = heldout_token_ids(corpus["validation"], tokenizer, min_eval_tokens=16 * 256 + 1)
"""

import glob
import hashlib
import os
import platform
import re
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from datasets import Dataset, DatasetDict, Features, Value, load_dataset
from transformers import PreTrainedTokenizerBase

STDLIB_CORPUS = "python-stdlib"
# Directories of the standard library that hold tests (and their deliberately broken data) or third-party code.
_EXCLUDED_DIRS = {"test", "tests", "site-packages", "dist-packages", "__pycache__"}
# `datasets` builders by file extension; anything else is read as plain text, one document per file.
_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
# A WikiText article starts with a level-1 heading line such as " = Valkyria Chronicles III = ".
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_FEATURES = Features({"source": Value("string"), "text": Value("string")})


def _is_excluded(relative: Path) -> bool:
    return any(part in _EXCLUDED_DIRS or part.endswith("_test") for part in relative.parts[:-1])


def stdlib_documents(root: str | os.PathLike | None = None) -> list[tuple[str, str]]:
    """The standard library's source files as `(relative path, text)` pairs, sorted by path.

    Args:
        root: The directory to read; `None` means this interpreter's `sysconfig.get_paths()["stdlib"]`.

    Every `*.py` file under `root` is one document, except files under `site-packages`, test directories (`test`,
    `tests`, `*_test` such as `idlelib/idle_test`) and files that are empty or not readable as UTF-8.
    """
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"stdlib root {str(root)!r} is not a directory")
    documents = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _is_excluded(relative):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            documents.append((relative.as_posix(), text))
    return documents


def corpus_fingerprint(corpus: Dataset | DatasetDict) -> str:
    """A sha256 (hex) over the Python version and every document's `(source, text)`, split by split.

    Record it next to results: two runs with the same fingerprint saw the same documents in the same order. The
    Python version is included because the default corpus is the running interpreter's standard library.
    """
    splits = corpus.items() if isinstance(corpus, DatasetDict) else [("", corpus)]
    digest = hashlib.sha256(f"python {platform.python_version()}\0".encode())
    for split, dataset in sorted(splits, key=lambda item: item[0]):
        digest.update(f"split {split}\0".encode())
        for source, text in zip(dataset["source"], dataset["text"]):
            for field in (source, text):
                data = field.encode("utf-8")
                # Length-prefixed so that ("ab", "c") and ("a", "bc") hash differently.
                digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def is_heldout(key: str, heldout_fraction: float) -> bool:
    """Whether the document named `key` is held out: sha256(key) read as a number in [0, 1) is below the fraction.

    A function of the key alone (no random state), so the split is the same on every machine and run, and adding
    or removing other documents never moves a document across it.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    value = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64
    return value < heldout_fraction


def split_documents(
    sources: Sequence[str], texts: Sequence[str], heldout_fraction: float, split_by: str = "source"
) -> DatasetDict:
    """Split documents into `train` and `validation` by `is_heldout` of each one's source (or text).

    Args:
        sources, texts: One entry per document.
        heldout_fraction: Expected fraction of documents held out.
        split_by: `"source"` hashes the document's name (a stable path); `"text"` hashes its content (for rows whose
            index is all that names them; identical documents then land on the same side).

    The split ignores length on purpose: the tokenizer that measures length is trained on the training split.
    `heldout_token_ids` later keeps only the held-out documents long enough to evaluate.
    """
    if split_by not in ("source", "text"):
        raise ValueError(f"split_by must be 'source' or 'text', got {split_by!r}")
    keys = sources if split_by == "source" else texts
    heldout = [is_heldout(key, heldout_fraction) for key in keys]
    columns = {"train": {"source": [], "text": []}, "validation": {"source": [], "text": []}}
    for source, text, held in zip(sources, texts, heldout):
        split = columns["validation" if held else "train"]
        split["source"].append(source)
        split["text"].append(text)
    return DatasetDict({name: Dataset.from_dict(data, features=_FEATURES) for name, data in columns.items()})


def join_wikitext_articles(lines: Iterable[str]) -> list[str]:
    """Join WikiText's rows (one line each) into articles, each starting at its ` = Title = ` heading row."""
    articles: list[list[str]] = []
    for line in lines:
        if _WIKITEXT_TITLE.match(line.rstrip("\n")) or not articles:
            articles.append([])
        articles[-1].append(line)
    return ["".join(article) for article in articles if "".join(article).strip()]


def _check_data_files(data_files: str | list[str] | dict[str, str | list[str]]) -> list[str]:
    """Every path or glob of `data_files`, flat, each local one checked to match at least one file."""
    if isinstance(data_files, dict):
        patterns = [p for value in data_files.values() for p in ([value] if isinstance(value, str) else value)]
    else:
        patterns = [data_files] if isinstance(data_files, str) else list(data_files)
    if not patterns:
        raise ValueError("data_files is empty: give at least one file or glob")
    for pattern in patterns:
        if "://" not in pattern and not glob.glob(os.path.expanduser(pattern), recursive=True):
            raise ValueError(f"data file {pattern!r} matches no file")
    return patterns


def load_recipe_corpus(data) -> "DatasetDict":
    """The corpus and held-out split a recipe's `DataArguments` (or the `ExperimentArguments` holding them) name."""
    return load_text_corpus(
        data.dataset_name,
        data.dataset_config,
        data_files=data.data_files,
        text_column=data.text_column,
        heldout_fraction=data.heldout_fraction,
    )


def load_text_corpus(
    name: str | None = None,
    config: str | None = None,
    *,
    data_files: str | list[str] | dict[str, str | list[str]] | None = None,
    text_column: str = "text",
    train_split: str = "train",
    validation_split: str | None = None,
    heldout_fraction: float = 0.1,
) -> DatasetDict:
    """Load a corpus as a `DatasetDict` with splits `train` and `validation`, columns `source` and `text`.

    Args:
        name: `None` or `"python-stdlib"` (the default corpus, offline); a Hub dataset name such as `"wikitext"`; or,
            with `data_files`, a `datasets` builder (`"text"`, `"json"`, `"csv"`, `"parquet"`; `None` guesses it from
            the file extension, plain text for unknown ones).
        config: The Hub dataset's configuration, e.g. `"wikitext-103-raw-v1"`.
        data_files: Local files or globs (a dict maps split names to them). Plain-text files are one document each.
        text_column: The column holding the text (json / csv / parquet / Hub data).
        train_split: The split to train on.
        validation_split: An existing held-out split. `None` uses `"validation"` if the data has one, else holds out
            `heldout_fraction` of the training documents by `is_heldout` (of the path for the standard library,
            of the text otherwise).
        heldout_fraction: See `validation_split`.

    WikiText (`name` ending in `"wikitext"`) stores one line per row: rows are joined into articles first.
    Raises `ValueError` naming the bad value for missing files, a missing text column or an unknown split.
    """
    if data_files is None and name in (None, STDLIB_CORPUS):
        if validation_split is not None:
            raise ValueError(f"the {STDLIB_CORPUS!r} corpus has no split {validation_split!r}; leave it None")
        sources, texts = zip(*stdlib_documents())
        return split_documents(sources, texts, heldout_fraction, split_by="source")
    if data_files is not None:
        patterns = _check_data_files(data_files)
        if name is None:
            name = _BUILDERS.get(Path(patterns[0]).suffix.lower(), "text")
        # `text` splits by line unless told otherwise; a file is a document here.
        kwargs = {"sample_by": "document"} if name == "text" else {}
        raw = load_dataset(name, config, data_files=data_files, **kwargs)
    else:
        raw = load_dataset(name, config)
    if not isinstance(raw, DatasetDict):
        raw = DatasetDict({train_split: raw})
    for split in (train_split, validation_split):
        if split is not None and split not in raw:
            raise ValueError(f"split {split!r} not found; the data has splits {sorted(raw)}")
    if validation_split is None and "validation" in raw and train_split != "validation":
        validation_split = "validation"
    columns = raw[train_split].column_names
    if text_column not in columns:
        raise ValueError(f"text_column {text_column!r} not found; the data has columns {columns}")
    wikitext = name.rstrip("/").split("/")[-1] == "wikitext"

    def documents(split: str) -> tuple[list[str], list[str]]:
        rows = raw[split][text_column]
        if wikitext:
            texts = join_wikitext_articles(rows)
            return [f"{split}/article{i}" for i in range(len(texts))], texts
        kept = [(f"{split}/{i}", text) for i, text in enumerate(rows) if text and text.strip()]
        return [source for source, _ in kept], [text for _, text in kept]

    if validation_split is None:
        return split_documents(*documents(train_split), heldout_fraction, split_by="text")
    return DatasetDict(
        {
            new: Dataset.from_dict(dict(zip(("source", "text"), documents(old))), features=_FEATURES)
            for new, old in (("train", train_split), ("validation", validation_split))
        }
    )


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no eos_token: packing needs one")
    return tokenizer.eos_token_id


def pack_documents(
    dataset: Dataset, tokenizer: PreTrainedTokenizerBase, block_size: int, *, num_proc: int | None = None
) -> Dataset:
    """Tokenize `dataset["text"]`, end each document with EOS, concatenate and cut into `block_size` blocks.

    As `group_texts` in transformers' `run_clm.py`: concatenation and cutting happen per `map` batch (1000
    documents) and the remainder of each batch is dropped, so every row is exactly `block_size` tokens. Returns
    columns `input_ids` and `labels` (a copy; the model shifts them), ready for `transformers.Trainer`.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    eos = _eos_id(tokenizer)

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc in ids]}

    def group(batch: dict[str, list]) -> dict[str, list]:
        stream = [token for doc in batch["input_ids"] for token in doc]
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names, num_proc=num_proc)
    return tokenized.map(group, batched=True, num_proc=num_proc)


def heldout_token_ids(
    dataset: Dataset, tokenizer: PreTrainedTokenizerBase, min_eval_tokens: int
) -> list[torch.LongTensor]:
    """The held-out documents with at least `min_eval_tokens` tokens, each a 1-D `LongTensor`, in dataset order.

    Pass `min_eval_tokens` = the longest evaluation length (+ 1 for the shifted labels), e.g. `16 * 256 + 1`, so
    every document is evaluated at every length. No special tokens are added. Raises `ValueError` if none is long
    enough, naming the longest length found.
    """
    if isinstance(min_eval_tokens, bool) or not isinstance(min_eval_tokens, int) or min_eval_tokens <= 0:
        raise ValueError(f"min_eval_tokens must be a positive integer, got {min_eval_tokens!r}")
    ids = tokenizer(list(dataset["text"]), add_special_tokens=False)["input_ids"]
    kept = [torch.tensor(doc, dtype=torch.long) for doc in ids if len(doc) >= min_eval_tokens]
    if not kept:
        longest = max((len(doc) for doc in ids), default=0)
        raise ValueError(
            f"no held-out document has min_eval_tokens={min_eval_tokens} tokens (of {len(ids)}, the longest has "
            f"{longest}): lower the evaluation length or raise heldout_fraction"
        )
    return kept


__all__ = [
    "STDLIB_CORPUS",
    "corpus_fingerprint",
    "heldout_token_ids",
    "is_heldout",
    "join_wikitext_articles",
    "load_text_corpus",
    "pack_documents",
    "split_documents",
    "stdlib_documents",
]
