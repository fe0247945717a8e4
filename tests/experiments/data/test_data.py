"""Corpus, held-out split, fingerprint, tokenizer cache and packing (hf_alibi.experiments.data.corpus, hf_alibi.experiments.data.tokenization)."""

import json
import os

import pytest
from datasets import Dataset, DatasetDict
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hf_alibi.experiments.data import corpus as data
from hf_alibi.experiments.data import tokenization
from hf_alibi.experiments.data.corpus import (
    corpus_fingerprint,
    heldout_token_ids,
    is_heldout,
    join_wikitext_articles,
    load_text_corpus,
    pack_documents,
    split_documents,
    stdlib_documents,
)
from hf_alibi.experiments.data.tokenization import END_OF_TEXT, load_or_train_tokenizer, train_tokenizer

VOCAB = 300  # 256 bytes + <|endoftext|> + a few merges: trains in milliseconds


def _write(root, relative, text):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _python_source(i: int, lines: int) -> str:
    return "".join(f"def function_{i}_{j}(x):\n    return x * {j} + {i}  # comment {j}\n" for j in range(lines))


@pytest.fixture
def stdlib_root(tmp_path):
    """A miniature standard library: 40 modules of varied length, plus files the corpus must skip."""
    root = tmp_path / "lib"
    for i in range(40):
        _write(root, f"pkg{i % 3}/mod{i}.py", _python_source(i, lines=1 + (i * 7) % 40))
    _write(root, "test/test_mod.py", "import unittest\n")
    _write(root, "ctypes/test/test_x.py", "x = 1\n")
    _write(root, "idlelib/idle_test/test_y.py", "y = 1\n")
    _write(root, "site-packages/third_party.py", "z = 1\n")
    _write(root, "empty.py", "")
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    return root


@pytest.fixture
def corpus(stdlib_root):
    sources, texts = zip(*stdlib_documents(stdlib_root))
    return split_documents(sources, texts, heldout_fraction=0.3)


@pytest.fixture
def tokenizer(corpus, tmp_path):
    return load_or_train_tokenizer(corpus["train"], vocab_size=VOCAB, cache_dir=tmp_path / "cache")


def test_stdlib_documents_skip_tests_site_packages_empty_and_unreadable(stdlib_root):
    sources = [source for source, _ in stdlib_documents(stdlib_root)]
    assert sources == sorted(f"pkg{i % 3}/mod{i}.py" for i in range(40))


def test_real_stdlib_corpus_has_no_tests_or_third_party_code():
    documents = stdlib_documents()
    sources = [source for source, _ in documents]
    assert len(documents) > 300 and sources == sorted(sources)
    assert "os.py" in sources and "json/decoder.py" in sources
    bad = [s for s in sources if {"test", "tests", "site-packages", "idle_test"} & set(s.split("/")[:-1])]
    assert not bad, bad[:5]


def test_split_is_deterministic_disjoint_and_complete(stdlib_root):
    sources, texts = zip(*stdlib_documents(stdlib_root))
    first = split_documents(sources, texts, heldout_fraction=0.3)
    second = split_documents(sources, texts, heldout_fraction=0.3)
    assert first["train"]["source"] == second["train"]["source"]
    assert first["validation"]["source"] == second["validation"]["source"]
    train, held = set(first["train"]["source"]), set(first["validation"]["source"])
    assert not train & held and train | held == set(sources) and held


def test_heldout_membership_depends_only_on_the_key():
    keys = [f"module_{i}.py" for i in range(2000)]
    held = {key for key in keys if is_heldout(key, 0.1)}
    # Dropping half the other documents moves no document across the split.
    assert held & set(keys[::2]) == {key for key in keys[::2] if is_heldout(key, 0.1)}
    assert 0.07 < len(held) / len(keys) < 0.13, len(held)
    with pytest.raises(ValueError, match="1.5"):
        is_heldout("x", 1.5)


def test_fingerprint_changes_when_a_document_changes_or_moves(stdlib_root):
    def fingerprint():
        sources, texts = zip(*stdlib_documents(stdlib_root))
        return corpus_fingerprint(split_documents(sources, texts, heldout_fraction=0.3))

    original = fingerprint()
    assert fingerprint() == original
    path = stdlib_root / "pkg0/mod0.py"
    path.write_text(path.read_text() + "#\n")
    edited = fingerprint()
    assert edited != original
    path.rename(stdlib_root / "pkg0/mod0_renamed.py")
    assert fingerprint() not in (original, edited)


def test_tokenizer_round_trips_text_exactly(tokenizer):
    text = "class A:\n\tdef f(self):  # tabs, 'quotes' and unicode: é ∑ 🙂\n        return None\r\n\n"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == END_OF_TEXT
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and len(tokenizer) == VOCAB


def test_tokenizer_is_cached_and_not_retrained(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load_or_train_tokenizer(corpus["train"], vocab_size=VOCAB, cache_dir=cache)

    def fail(*args, **kwargs):
        raise AssertionError("retrained although the cache holds this tokenizer")

    monkeypatch.setattr(tokenization, "train_tokenizer", fail)
    second = load_or_train_tokenizer(corpus["train"], vocab_size=VOCAB, cache_dir=cache)
    assert second.get_vocab() == first.get_vocab()
    assert [p.name for p in cache.iterdir()] == [tokenization.tokenizer_cache_key(corpus["train"], VOCAB)]


def test_interrupted_cache_write_leaves_nothing_behind(corpus, tmp_path, monkeypatch):
    cache = tmp_path / "cache"

    def crash(self, directory, **kwargs):  # dies half-way through writing
        with open(os.path.join(directory, "tokenizer.json"), "w") as half_written:
            half_written.write("{")
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        load_or_train_tokenizer(corpus["train"], vocab_size=VOCAB, cache_dir=cache)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    tokenizer = load_or_train_tokenizer(corpus["train"], vocab_size=VOCAB, cache_dir=cache)
    assert len(tokenizer) == VOCAB


def test_tokenizer_saves_and_loads_with_auto_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "saved")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    text = "import os\nprint(os.getcwd())\n"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.eos_token_id == tokenizer.eos_token_id == loaded.convert_tokens_to_ids(END_OF_TEXT)


def test_tokenizer_rejects_a_vocab_too_small_for_the_bytes():
    with pytest.raises(ValueError, match="100"):
        train_tokenizer(["abc"], vocab_size=100)


def test_packing_gives_exact_blocks_of_the_eos_joined_stream(corpus, tokenizer):
    block = 32
    packed = pack_documents(corpus["train"], tokenizer, block_size=block)
    stream = [t for text in corpus["train"]["text"] for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    assert packed.column_names == ["input_ids", "labels"]
    assert len(packed) == len(stream) // block
    assert all(len(row) == block for row in packed["input_ids"])
    assert packed["labels"] == packed["input_ids"]
    assert [t for row in packed["input_ids"] for t in row] == stream[: len(packed) * block]


def test_heldout_token_ids_are_all_long_enough(corpus, tokenizer):
    lengths = [len(tokenizer(text)["input_ids"]) for text in corpus["validation"]["text"]]
    min_eval_tokens = sorted(lengths)[len(lengths) // 2]  # about half qualify
    docs = heldout_token_ids(corpus["validation"], tokenizer, min_eval_tokens)
    assert [len(d) for d in docs] == [n for n in lengths if n >= min_eval_tokens]
    assert all(d.dtype.is_floating_point is False and d.dim() == 1 for d in docs)
    with pytest.raises(ValueError, match=f"min_eval_tokens={max(lengths) + 1}"):
        heldout_token_ids(corpus["validation"], tokenizer, max(lengths) + 1)


def test_local_text_files_load_one_document_per_file(tmp_path):
    for i in range(30):
        _write(tmp_path / "txt", f"doc{i}.txt", f"first line {i}\nsecond line\n\nlast line\n")
    corpus = load_text_corpus(data_files=str(tmp_path / "txt" / "*.txt"), heldout_fraction=0.3)
    texts = list(corpus["train"]["text"]) + list(corpus["validation"]["text"])
    assert len(texts) == 30 and all(t.count("\n") == 4 for t in texts)
    assert corpus["train"].column_names == ["source", "text"] and len(corpus["validation"]) > 0


def test_json_text_column_is_used_and_an_existing_validation_split_is_kept(tmp_path):
    for split, n in (("train", 5), ("validation", 2)):
        rows = [json.dumps({"id": i, "body": f"{split} document {i}"}) for i in range(n)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    files = {split: str(tmp_path / f"{split}.jsonl") for split in ("train", "validation")}
    corpus = load_text_corpus(data_files=files, text_column="body")
    assert corpus["validation"]["text"] == ["validation document 0", "validation document 1"]
    assert len(corpus["train"]) == 5


def test_missing_text_column_error_names_it_and_lists_the_columns(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"content": "x", "id": 1}) + "\n")
    with pytest.raises(ValueError, match=r"'body'.*\['content', 'id'\]"):
        load_text_corpus(data_files=str(tmp_path / "data.jsonl"), text_column="body")


def test_missing_data_file_error_names_it(tmp_path):
    missing = str(tmp_path / "nope" / "*.txt")
    with pytest.raises(ValueError, match="nope"):
        load_text_corpus(data_files=missing)


def test_unknown_split_error_names_it(tmp_path):
    (tmp_path / "data.csv").write_text("text\nhello\nworld\n")
    with pytest.raises(ValueError, match=r"'dev'.*\['train'\]"):
        load_text_corpus(data_files=str(tmp_path / "data.csv"), validation_split="dev")


def test_wikitext_lines_join_into_articles():
    lines = ["", " = Alpha = \n", "", " = = Section = = \n", " Text a .\n", " = Beta = \n", " Text b .\n"]
    assert join_wikitext_articles(lines) == [" = Alpha = \n = = Section = = \n Text a .\n", " = Beta = \n Text b .\n"]


def test_hub_wikitext_is_joined_into_articles_and_keeps_its_validation_split(monkeypatch):
    def rows(*titles):
        return Dataset.from_dict({"text": [line for t in titles for line in ("", f" = {t} = \n", f" About {t} .\n")]})

    fake_hub = DatasetDict({"train": rows("A", "B", "C"), "validation": rows("D"), "test": rows("E")})
    calls = []
    monkeypatch.setattr(data, "load_dataset", lambda *args, **kwargs: calls.append(args) or fake_hub)
    corpus = load_text_corpus("Salesforce/wikitext", "wikitext-103-raw-v1")
    assert calls == [("Salesforce/wikitext", "wikitext-103-raw-v1")]
    assert corpus["train"]["text"] == [f" = {t} = \n About {t} .\n" for t in "ABC"]
    assert corpus["validation"]["text"] == [" = D = \n About D .\n"]
    assert corpus["validation"]["source"] == ["validation/article0"]


def test_byte_level_vocabulary_scores_exactly_one_byte_per_token():
    import torch

    from hf_alibi.experiments.data.tokenization import train_tokenizer
    from hf_alibi.experiments.setup.arguments import ExperimentArguments
    from hf_alibi.experiments.training.recipe_data import heldout_bytes_per_token

    text = "def f(x):\n    return x  # é, ü: multi-byte characters\n" * 40
    tokenizer = train_tokenizer([text], vocab_size=257)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    assert ids.numel() == len(text.encode("utf-8"))
    experiment = ExperimentArguments(train_length=8, eval_factors=[1, 2], models=["alibi"])
    assert heldout_bytes_per_token([ids], tokenizer, experiment) == 1.0
