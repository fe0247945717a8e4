"""An imported jina-embeddings-v2 folder (base-code's layout too) is a sentence-transformers model that encodes as
their mean pooling (the float64 reference's), with hf_alibi imported and, through the code the folder ships, without
it; an imported jina-reranker-v1 is a CrossEncoder scoring as their classifier."""

import json
import sys

import pytest
import torch

from encoder_reference import (
    JINA_BASE_CODE,
    JINA_CODE,
    jina_config,
    reference_forward,
    save_source,
    tiny_state,
    wordpiece_tokenizer,
)
from hf_alibi import convert
from tests.models.alibi.test_hub import run_without_hf_alibi  # the one fresh-process runner of the Hub tests

sentence_transformers = pytest.importorskip("sentence_transformers")
TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "a long text of many words " * 40]
ATOL = 2e-5


def imported(tmp_path, head="base", modules=None, max_seq_length=None, code=JINA_CODE):
    """A tiny Jina checkpoint (`code=JINA_BASE_CODE`: base-code's) with a WordPiece tokenizer (and, if given, its own
    modules.json and sentence_bert_config.json), imported: (our folder, their config, their state, tokenizer)."""
    config = jina_config(head, code=code)
    state = tiny_state(config, head, fused=False)
    folder = save_source(tmp_path / "source", config, state, pickled=False)
    tokenizer = wordpiece_tokenizer(folder)
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return convert(str(folder), tmp_path / "ours"), config, state, tokenizer


def their_mean_pooling(config, state, tokenizer, texts) -> torch.Tensor:
    """jina-embeddings-v2's `encode`: the mean of the last hidden states over the real tokens, float64."""
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    hidden = reference_forward(config, state, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    mask = batch["attention_mask"][..., None].double()  # (B, L, 1)
    return (hidden["hidden"] * mask).sum(1) / mask.sum(1)  # (B, H)


@pytest.mark.parametrize("code", [JINA_CODE, JINA_BASE_CODE], ids=["jina-embeddings-v2", "base-code"])
def test_sentence_transformer_encodes_as_their_mean_pooling(tmp_path, code):
    folder, config, state, tokenizer = imported(tmp_path, code=code)
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == 8192
    got = torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True)).double()
    error = (got - their_mean_pooling(config, state, tokenizer, TEXTS)).abs().max().item()
    assert error < ATOL, f"embeddings differ from their mean pooling by {error:.2e}"


def test_the_sources_normalize_module_and_max_seq_length_are_kept(tmp_path):
    theirs = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    folder, config, state, tokenizer = imported(tmp_path, modules=theirs, max_seq_length=1024)
    assert [module["type"] for module in json.loads((folder / "modules.json").read_text())][-1].endswith("Normalize")
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    assert model.max_seq_length == 1024  # the source's sentence_bert_config.json, kept
    got = torch.as_tensor(model.encode(TEXTS)).double()
    expected = torch.nn.functional.normalize(their_mean_pooling(config, state, tokenizer, TEXTS), dim=-1)
    assert (got - expected).abs().max().item() < ATOL


LOAD_WITHOUT_HF_ALIBI = """
import sys, json
sys.modules["hf_alibi"] = None  # the package is not there: only the code the folder ships
from sentence_transformers import SentenceTransformer
folder, texts, output = sys.argv[1:]
model = SentenceTransformer(folder, device="cpu", trust_remote_code=True)
open(output, "w").write(json.dumps(model.encode(json.loads(texts)).tolist()))
"""


def test_the_folder_loads_without_hf_alibi_through_its_own_code(tmp_path):
    folder, config, state, tokenizer = imported(tmp_path)
    output = tmp_path / "embeddings.json"
    run_without_hf_alibi(LOAD_WITHOUT_HF_ALIBI, [str(folder), json.dumps(TEXTS), str(output)], tmp_path)
    got = torch.tensor(json.loads(output.read_text())).double()
    error = (got - their_mean_pooling(config, state, tokenizer, TEXTS)).abs().max().item()
    assert error < ATOL, f"embeddings without hf_alibi differ by {error:.2e}"


def test_a_reranker_is_a_cross_encoder_scoring_as_their_classifier(tmp_path):
    folder, config, state, tokenizer = imported(tmp_path, head="sequence_classification")
    assert not (folder / "modules.json").exists()  # a classifier, not an embedding model
    pairs = [("hello world", "the quick brown fox"), ("lazy dog", "a long text of many words")]
    model = sentence_transformers.CrossEncoder(str(folder), device="cpu")
    got = torch.as_tensor(model.predict(pairs, activation_fn=torch.nn.Identity())).double().flatten()
    batch = tokenizer([q for q, _ in pairs], [d for _, d in pairs], padding=True, return_tensors="pt")
    expected = reference_forward(config, state, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    error = (got - expected["logits"].flatten()).abs().max().item()
    assert error < ATOL, f"reranker scores differ from their classifier's by {error:.2e}"


def test_convert_says_how_to_load_it_and_names_the_extra_when_missing(tmp_path, capsys, monkeypatch):
    from hf_alibi.cli import run

    config = jina_config()
    folder = save_source(tmp_path / "source", config, tiny_state(config, "base", fused=False), pickled=False)
    run(["convert", str(folder), str(tmp_path / "a")])
    assert "SentenceTransformer" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # find_spec: not installed
    run(["convert", str(folder), str(tmp_path / "b")])
    lines = [line for line in capsys.readouterr().out.splitlines() if "sentence-transformers" in line]
    assert lines == [
        "SentenceTransformer(folder) needs sentence-transformers, which is not installed: "
        "pip install 'hf_alibi[embeddings]'"
    ], lines


def test_a_saved_encoder_becomes_a_sentence_transformer_with_one_call(tmp_path, make_encoder):
    from hf_alibi.conversion import write_sentence_transformers_files

    model = make_encoder(vocab_size=64, max_position_embeddings=4096)
    model.save_pretrained(tmp_path / "mine")
    tokenizer = wordpiece_tokenizer(tmp_path / "mine")
    write_sentence_transformers_files(tmp_path / "mine", model.config, normalize=True)
    encoder = sentence_transformers.SentenceTransformer(str(tmp_path / "mine"), device="cpu")
    assert encoder.max_seq_length == 4096
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()  # (B, L, H)
    mask = batch["attention_mask"][..., None].double()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    got = torch.as_tensor(encoder.encode(TEXTS)).double()
    assert (got - expected).abs().max().item() < ATOL
