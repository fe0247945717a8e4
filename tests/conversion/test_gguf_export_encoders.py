"""ALiBi BERT -> GGUF (llama.cpp `jina-bert-v2`): every key and tensor its loader reads, the WordPiece vocabulary in
llama.cpp's `bert` form, refusals by name; and, where `llama_cpp` is importable, llama.cpp's mean-pooled embeddings
against ours (close, not equal: ggml's GELU is the tanh approximation)."""

import gguf
import numpy as np
import pytest
import torch

from encoder_reference import jina_config, save_source, tiny_state, wordpiece_tokenizer
from hf_alibi import AlibiBertForSequenceClassification, AlibiBertModel, convert, export
from hf_alibi.cli import run
from test_gguf_export import read_fields

TENSORS = {  # ours (bare) -> llama.cpp's, per block
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "mlp.wo": "ffn_down",
    "mlp.layernorm": "layer_output_norm",
}


@pytest.fixture
def imported(tmp_path):
    """A tiny jina-embeddings-v2 checkpoint with its WordPiece tokenizer, imported: our folder."""
    config = jina_config()
    folder = save_source(tmp_path / "source", config, tiny_state(config, "base", fused=False), pickled=False)
    wordpiece_tokenizer(folder)
    return convert(str(folder), tmp_path / "ours")


def test_gguf_has_every_key_and_tensor_of_jina_bert_v2(imported, tmp_path):
    run(["export", str(imported), str(tmp_path / "model.gguf"), "--to", "gguf"])
    fields, tensors = read_fields(tmp_path / "model.gguf")
    expected_fields = {
        "general.architecture": "jina-bert-v2",
        "jina-bert-v2.context_length": 8192,
        "jina-bert-v2.embedding_length": 24,
        "jina-bert-v2.block_count": 2,
        "jina-bert-v2.feed_forward_length": 40,
        "jina-bert-v2.attention.head_count": 6,
        "jina-bert-v2.attention.causal": False,
        "jina-bert-v2.pooling_type": gguf.PoolingType.MEAN.value,
        "tokenizer.ggml.model": "bert",
        "tokenizer.ggml.token_type_count": 2,
    }
    assert {key: fields.get(key) for key in expected_fields} == expected_fields
    assert fields["jina-bert-v2.attention.max_alibi_bias"] == pytest.approx(8.0)
    state = {key: value.numpy() for key, value in AlibiBertModel.from_pretrained(imported).state_dict().items()}
    expected = {
        "token_embd.weight": state["embeddings.word_embeddings.weight"],
        "token_types.weight": state["embeddings.token_type_embeddings.weight"],
        "token_embd_norm.weight": state["embeddings.LayerNorm.weight"],
        "token_embd_norm.bias": state["embeddings.LayerNorm.bias"],
    }
    for i in range(2):
        expected[f"blk.{i}.ffn_up.weight"] = state[f"encoder.layer.{i}.mlp.gated_layers.weight"]  # (2I, C) fused
        for ours, theirs in TENSORS.items():
            for part in ("weight", "bias"):
                expected[f"blk.{i}.{theirs}.{part}"] = state[f"encoder.layer.{i}.{ours}.{part}"]
    assert set(tensors) == set(expected), set(tensors) ^ set(expected)  # no pooler, no head
    for name, array in expected.items():
        assert tensors[name].shape == array.shape and np.array_equal(tensors[name], array), name


def test_wordpiece_goes_in_as_llama_cpp_bert_vocabulary(imported, tmp_path):
    from transformers import AutoTokenizer

    export(str(imported), "gguf", tmp_path / "model.gguf")
    tokens = read_fields(tmp_path / "model.gguf")[0]["tokenizer.ggml.tokens"]
    vocab = AutoTokenizer.from_pretrained(imported).get_vocab()
    assert tokens[vocab["[CLS]"]] == "[CLS]" and tokens[vocab["##ing"]] == "ing"
    assert tokens[vocab["fox"]] == "\u2581fox"


@pytest.mark.parametrize(
    "model_class, fields, named",
    [
        (AlibiBertModel, dict(feed_forward_type="reglu"), "'relu'"),
        (AlibiBertModel, dict(feed_forward_type="glu", hidden_act="silu"), "'silu'"),
        (AlibiBertForSequenceClassification, {}, "sequence_classification"),
    ],
)
def test_gguf_refuses_what_jina_bert_v2_cannot_hold_and_writes_nothing(
    imported, tmp_path, make_encoder, model_class, fields, named
):
    from transformers import AutoTokenizer

    model = make_encoder(model_class, **fields)
    with pytest.raises(ValueError, match=named):
        export(model, "gguf", tmp_path / "out.gguf", tokenizer=AutoTokenizer.from_pretrained(imported))
    assert not (tmp_path / "out.gguf").exists()


def test_llama_cpp_embeddings_are_close_to_ours(imported, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    path = export(str(imported), "gguf", tmp_path / "model.gguf")
    tokenizer, model = AutoTokenizer.from_pretrained(imported), AlibiBertModel.from_pretrained(imported).eval()
    text = "the quick brown fox jumps over the lazy dog " * 20
    ids = tokenizer(text)["input_ids"]
    llm = llama_cpp.Llama(
        str(path),
        embedding=True,
        n_ctx=1024,
        verbose=False,
        n_threads=1,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )
    assert llm.tokenize(text.encode(), add_bos=True) == ids
    theirs = torch.tensor(llm.embed(text, normalize=False)).double()
    with torch.no_grad():
        ours = model(torch.tensor([ids])).last_hidden_state[0].mean(0).double()
    error = ((theirs - ours).abs().max() / ours.abs().max()).item()
    assert error < 2e-3, f"llama.cpp's embedding differs by {error:.2e} of its scale (tanh GELU: ~4e-4 expected)"
