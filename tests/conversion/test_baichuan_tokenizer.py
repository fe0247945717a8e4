"""Baichuan's SentencePiece tokenizer loads without its remote class: on a SentencePiece model trained here with
Baichuan's settings, the tokenizer read from it encodes as SentencePiece itself does (bos / eos only as their
tokenizer_config.json says), decodes back, and the converted folder loads it with AutoTokenizer; `--to baichuan`
writes their files back. Skipped without sentencepiece and protobuf (`hf_alibi[sentencepiece]`)."""

import json
import sys

import pytest

sentencepiece = pytest.importorskip("sentencepiece")
pytest.importorskip("google.protobuf")

from transformers import AutoTokenizer  # noqa: E402

from baichuan_checkpoints import TOKENIZER_TEXT, save_source, tiny_checkpoint, train_sentencepiece  # noqa: E402
from hf_alibi.cli import run  # noqa: E402
from hf_alibi.conversion.baichuan_tokenizer import read_baichuan_tokenizer  # noqa: E402

TEXTS = [
    *TOKENIZER_TEXT,
    "百川 Baichuan 2024年 model",
    "   leading spaces and trailing   ",
    "ünïcödé 𝔘 emoji 🙂 not in training: 龘",
    "a\nb\tc\r\n",
    "",
]


@pytest.mark.parametrize("add_bos_token", [False, True])
def test_tokenizer_encodes_as_sentencepiece_does_with_bos_only_where_their_config_says(tmp_path, add_bos_token):
    train_sentencepiece(tmp_path, add_bos_token=add_bos_token)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    tokenizer = read_baichuan_tokenizer(tmp_path)
    bos = [processor.bos_id()] if add_bos_token else []
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == bos + processor.encode(text), repr(text)  # no eos: their add_eos_token is False
        assert tokenizer.decode(ids, skip_special_tokens=True) == processor.decode(processor.encode(text)), repr(text)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token) == (
        "<s>",
        "</s>",
        "<unk>",
        "<unk>",
    )


def test_special_tokens_in_the_text_are_taken_whole_as_their_class_takes_them(tmp_path):
    train_sentencepiece(tmp_path)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    ids = read_baichuan_tokenizer(tmp_path)("hello</s>world")["input_ids"]
    assert ids == processor.encode("hello") + [processor.eos_id()] + processor.encode("world")


def test_their_class_defaults_apply_when_their_config_is_absent(tmp_path):
    train_sentencepiece(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()  # BaichuanTokenizer's defaults: add_bos_token=True, no eos
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert read_baichuan_tokenizer(tmp_path)("hello")["input_ids"] == [1, *processor.encode("hello")]
    assert read_baichuan_tokenizer(tmp_path / "no_such_folder") is None  # no tokenizer.model: no tokenizer


def test_convert_writes_a_tokenizer_autotokenizer_loads_and_export_writes_theirs_back(tmp_path):
    source = tmp_path / "source"
    save_source(tiny_checkpoint("baichuan2_13b"), source)
    model_bytes = train_sentencepiece(source, add_bos_token=True)
    run(["convert", str(source), str(tmp_path / "alibi")])
    config = json.loads((tmp_path / "alibi" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] != "BaichuanTokenizer" and "auto_map" not in config  # no remote class
    assert (tmp_path / "alibi" / "tokenizer.model").read_bytes() == model_bytes
    processor = sentencepiece.SentencePieceProcessor(model_file=str(source / "tokenizer.model"))
    loaded = AutoTokenizer.from_pretrained(tmp_path / "alibi")
    for text in TEXTS:
        assert loaded(text)["input_ids"] == [1, *processor.encode(text)], repr(text)
    run(["export", str(tmp_path / "alibi"), str(tmp_path / "back"), "--to", "baichuan"])
    assert (tmp_path / "back" / "tokenizer.model").read_bytes() == model_bytes
    theirs = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert theirs["tokenizer_class"] == "BaichuanTokenizer"
    assert theirs["auto_map"] == {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]}
    assert (theirs["add_bos_token"], theirs["add_eos_token"], theirs["bos_token"], theirs["pad_token"]) == (
        True,
        False,
        "<s>",
        "<unk>",
    )
    again = read_baichuan_tokenizer(tmp_path / "back")  # their files read again: the same tokenizer
    assert all(again(text)["input_ids"] == loaded(text)["input_ids"] for text in TEXTS)


def test_without_sentencepiece_the_import_names_the_extra(tmp_path, monkeypatch):
    train_sentencepiece(tmp_path)
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # as if not installed
    with pytest.raises(ImportError, match=r"sentencepiece.*pip install 'hf_alibi\[sentencepiece\]'"):
        read_baichuan_tokenizer(tmp_path)
