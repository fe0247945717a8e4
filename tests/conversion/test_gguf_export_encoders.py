"""ALiBi BERT -> GGUF (llama.cpp `jina-bert-v2`): every key and tensor its loader reads, base-code's layer in the same
graph (its GLU split into `ffn_up`/`ffn_gate`), the WordPiece vocabulary in llama.cpp's `bert` form, refusals by name;
and, where `llama_cpp` is importable, llama.cpp's tokens and mean-pooled embeddings against ours for both layers (close,
not equal: ggml's GELU is the tanh approximation, read from an fp16 table)."""

import copy

import gguf
import numpy as np
import pytest
import torch

from encoder_reference import JINA_BASE_CODE, jina_config, save_source, tiny_state, wordpiece_tokenizer
from hf_alibi import AlibiBertForSequenceClassification, AlibiBertModel, convert, export
from hf_alibi.cli import run
from test_gguf_export import read_fields

ATTENTION = {  # ours (bare) -> llama.cpp's, per block
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
}
LAYER = {  # layer_layout -> the rest of a block but its GLU's up/gate weight
    "jina": {"mlp.wo": "ffn_down", "mlp.layernorm": "layer_output_norm"},
    "jina_code": {
        "attention.self.layer_norm_q": "attn_q_norm",
        "attention.self.layer_norm_k": "attn_k_norm",
        "layer_norm_1": "attn_norm_2",
        "mlp.down_layer": "ffn_down",
        "layer_norm_2": "layer_output_norm",
    },
}
TOLERANCE = 2e-3  # of the embedding's scale: ggml's tanh GELU from an fp16 table against the exact one, ~4e-4 measured
CODE = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, 2))\n"


@pytest.fixture
def imported(tmp_path):
    """A tiny jina-embeddings-v2 checkpoint with its WordPiece tokenizer, imported: our folder."""
    config = jina_config()
    folder = save_source(tmp_path / "source", config, tiny_state(config, "base", fused=False), pickled=False)
    wordpiece_tokenizer(folder)
    return convert(str(folder), tmp_path / "ours")


@pytest.fixture
def base_code(tmp_path):
    """A tiny jina-embeddings-v2-base-code imported (`layer_layout="jina_code"`) with a byte-level BPE whose
    post-processor wraps a text in <s> ... </s>, as base-code's RobertaTokenizer does: (our folder, tokenizer)."""
    from tokenizers import ByteLevelBPETokenizer, processors
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe.train_from_iterator([CODE] * 20, vocab_size=300, special_tokens=special, show_progress=False)
    bpe._tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    names = ("bos_token", "pad_token", "eos_token", "unk_token", "mask_token")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, cls_token="<s>", sep_token="</s>", **dict(zip(names, special))
    )
    config = jina_config(code=JINA_BASE_CODE) | {"vocab_size": 304, "pad_token_id": 1}
    folder = save_source(tmp_path / "source", config, tiny_state(config, "base", fused=False), pickled=False)
    tokenizer.save_pretrained(folder)
    return convert(str(folder), tmp_path / "ours"), tokenizer


def assert_holds_every_tensor(path, folder, layout: str) -> None:
    """The gguf holds our encoder's tensors and nothing else (no pooler, no head), bit for bit: Jina's fused
    `gated_layers` as one `ffn_up`, base-code's `up_gated_layer` split into `ffn_up` (first half) and `ffn_gate`."""
    tensors = read_fields(path)[1]
    state = {key: value.numpy() for key, value in AlibiBertModel.from_pretrained(folder).state_dict().items()}
    expected = {
        "token_embd.weight": state["embeddings.word_embeddings.weight"],
        "token_types.weight": state["embeddings.token_type_embeddings.weight"],
        "token_embd_norm.weight": state["embeddings.LayerNorm.weight"],
        "token_embd_norm.bias": state["embeddings.LayerNorm.bias"],
    }
    for i in range(2):
        layer = f"encoder.layer.{i}."
        for ours, theirs in (ATTENTION | LAYER[layout]).items():
            for part in ("weight", "bias"):
                expected[f"blk.{i}.{theirs}.{part}"] = state[f"{layer}{ours}.{part}"]
        if layout == "jina":  # (2I, C) fused: llama.cpp's GEGLU is act(g[:I]) * g[I:], as Jina's
            expected[f"blk.{i}.ffn_up.weight"] = state[layer + "mlp.gated_layers.weight"]
        else:  # base-code's u[:I] * act(u[I:]): llama.cpp's act(ffn_gate) * ffn_up
            up, gate = np.split(state[layer + "mlp.up_gated_layer.weight"], 2)
            expected |= {f"blk.{i}.ffn_up.weight": up, f"blk.{i}.ffn_gate.weight": gate}
    assert set(tensors) == set(expected), set(tensors) ^ set(expected)
    for name, array in expected.items():
        assert tensors[name].shape == array.shape and np.array_equal(tensors[name], array), name


def llama_cpp_embedding(llama_cpp, path, text: str) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's tokens of `text` and its mean-pooled (unnormalized) embedding, in float64."""
    llm = llama_cpp.Llama(
        str(path),
        embedding=True,
        n_ctx=1024,
        verbose=False,
        n_threads=1,
        pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
    )
    return llm.tokenize(text.encode(), add_bos=True), torch.tensor(llm.embed(text, normalize=False)).double()


def mean_embedding(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0].mean(0).double()


def relative_error(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return ((theirs - ours).abs().max() / ours.abs().max()).item()


def test_gguf_has_every_key_and_tensor_of_jina_bert_v2(imported, tmp_path):
    run(["export", str(imported), str(tmp_path / "model.gguf"), "--to", "gguf"])
    fields = read_fields(tmp_path / "model.gguf")[0]
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
    assert_holds_every_tensor(tmp_path / "model.gguf", imported, "jina")


def test_base_code_layer_goes_into_jina_bert_v2_with_its_glu_split_into_up_and_gate(base_code, tmp_path):
    folder, _ = base_code
    run(["export", str(folder), str(tmp_path / "model.gguf"), "--to", "gguf"])
    fields = read_fields(tmp_path / "model.gguf")[0]
    assert (fields["general.architecture"], fields["jina-bert-v2.feed_forward_length"]) == ("jina-bert-v2", 40)
    assert (fields["tokenizer.ggml.model"], fields["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert_holds_every_tensor(tmp_path / "model.gguf", folder, "jina_code")


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
        (AlibiBertModel, dict(feed_forward_type="reglu", layer_layout="jina_code", qk_layer_norm=True), "'relu'"),
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
    tokens, theirs = llama_cpp_embedding(llama_cpp, path, text)
    assert tokens == ids
    error = relative_error(theirs, mean_embedding(model, ids))
    assert error < TOLERANCE, f"llama.cpp's embedding differs by {error:.2e} of its scale (tanh GELU: ~4e-4 expected)"


def test_llama_cpp_runs_base_code_close_to_ours_and_the_halves_order_matters(base_code, tmp_path):
    """The same tolerance as Jina's layer. The halves' order is what llama.cpp's GLU reads: the model with
    `up_gated_layer`'s halves swapped exports to exactly the file an exporter writing them in the wrong order would
    write for the real one, and llama.cpp's embedding of that file must be far from ours."""
    llama_cpp = pytest.importorskip("llama_cpp")
    folder, tokenizer = base_code
    model = AlibiBertModel.from_pretrained(folder).eval()
    ids = tokenizer(CODE)["input_ids"]
    ours = mean_embedding(model, ids)
    tokens, theirs = llama_cpp_embedding(llama_cpp, export(str(folder), "gguf", tmp_path / "code.gguf"), CODE)
    assert tokens == ids  # <s> ... </s>, as base-code's tokenizer
    error = relative_error(theirs, ours)
    assert error < TOLERANCE, f"llama.cpp's embedding differs by {error:.2e} of its scale (tanh GELU: ~4e-4 expected)"
    swapped = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in swapped.named_parameters():
            if name.endswith("up_gated_layer.weight"):
                parameter.copy_(torch.cat(parameter.chunk(2)[::-1]))
    path = export(swapped, "gguf", tmp_path / "swapped.gguf", tokenizer=tokenizer)
    wrong = relative_error(llama_cpp_embedding(llama_cpp, path, CODE)[1], ours)
    assert wrong > 50 * TOLERANCE, f"the halves swapped give {wrong:.2e}: this test could not tell their order"
