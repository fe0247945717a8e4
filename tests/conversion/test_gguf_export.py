"""ALiBi GPT-2 -> GGUF (llama.cpp `mpt`): every key and tensor its loader needs, the tokenizer, refusals; and, where
`llama_cpp` is importable, llama.cpp's own logits and greedy tokens against ours."""

import json

import gguf
import numpy as np
import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

from hf_alibi import export
from hf_alibi.conversion.gguf_export import _pre_tokenizer_name

TEXT = ["the quick brown fox jumps over the lazy dog. ", "def add(x, y):\n    return x + y\n", "hello world! "]
KEYS = {
    "general.architecture": "mpt",
    "mpt.context_length": 64,
    "mpt.embedding_length": 96,
    "mpt.block_count": 2,
    "mpt.feed_forward_length": 384,
    "mpt.attention.head_count": 12,
    "mpt.attention.head_count_kv": 12,
    "mpt.attention.max_alibi_bias": 8.0,
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
}


@pytest.fixture(scope="module")
def tokenizer():
    """A real byte-level BPE (GPT-2's kind) of 269 ids, trained in a blink; the test models have 272 rows."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT * 20, vocab_size=269, special_tokens=["<|endoftext|>"], show_progress=False)
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=eos, bos_token=eos)


def gguf_model(make_model, **overrides):
    settings = dict(vocab_size=272, n_positions=64, bos_token_id=0, eos_token_id=0, pad_token_id=None) | overrides
    model = make_model(**settings)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def read_fields(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {t.name: np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    return fields, tensors


def test_gguf_has_every_key_and_tensor_llama_cpp_mpt_needs(make_model, tokenizer, tmp_path):
    model = gguf_model(make_model, clip_qkv=4.0)
    path = export(model, "gguf", tmp_path / "model.gguf", tokenizer=tokenizer)
    fields, tensors = read_fields(path)
    for key, value in KEYS.items():
        assert fields[key] == pytest.approx(value) if isinstance(value, float) else fields[key] == value, key
    assert fields["mpt.attention.clamp_kqv"] == pytest.approx(4.0)
    assert fields["mpt.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    expected = {
        "token_embd.weight": state["transformer.wte.weight"],
        "output_norm.weight": state["transformer.ln_f.weight"],
        "output_norm.bias": state["transformer.ln_f.bias"],
    }
    names = {
        "ln_1": "attn_norm",
        "attn.c_attn": "attn_qkv",
        "attn.c_proj": "attn_output",
        "ln_2": "ffn_norm",
        "mlp.c_fc": "ffn_up",
        "mlp.c_proj": "ffn_down",
    }
    for i in range(2):
        for ours, theirs in names.items():
            weight = state[f"transformer.h.{i}.{ours}.weight"]
            expected[f"blk.{i}.{theirs}.weight"] = weight.T if weight.ndim == 2 else weight  # (out, in)
            expected[f"blk.{i}.{theirs}.bias"] = state[f"transformer.h.{i}.{ours}.bias"]
    assert set(tensors) == set(expected), set(tensors) ^ set(expected)  # tied head: no `output.weight`
    for name, array in expected.items():
        assert tensors[name].shape == array.shape and np.array_equal(tensors[name], array), name


def test_gguf_carries_the_tokenizer_padded_to_the_vocabulary(make_model, tokenizer, tmp_path):
    path = export(gguf_model(make_model), "gguf", tmp_path / "model.gguf", tokenizer=tokenizer)
    fields, _ = read_fields(path)
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokenizer) == 269 and len(tokens) == 272 and tokens[269:] == ["[PAD269]", "[PAD270]", "[PAD271]"]
    vocab = tokenizer.get_vocab()
    assert all(tokens[index] == token for token, index in vocab.items())
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    assert len(fields["tokenizer.ggml.merges"]) == len(spec["model"]["merges"])
    assert fields["tokenizer.ggml.token_type"][0] == gguf.TokenType.CONTROL  # <|endoftext|>
    assert fields["tokenizer.ggml.eos_token_id"] == 0 and fields["tokenizer.ggml.add_bos_token"] is False


def test_bloom_pre_tokenizer_is_named_and_unknown_ones_refused():
    split = {"type": "Split", "pattern": {"Regex": " ?[^(\\s|[.,!?…。，、।۔،])]+"}, "behavior": "Isolated"}
    bloom = {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, {"type": "ByteLevel", "use_regex": False}]}}
    assert _pre_tokenizer_name(bloom) == "bloom"
    with pytest.raises(ValueError, match="Metaspace"):
        _pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}})


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("activation_function", {"activation_function": "gelu"}),
        ("embedding_layernorm", {"embedding_layernorm": True}),
        ("scale_attn_weights", {"scale_attn_weights": False}),
        ("alibi_slopes", {"alibi_slopes": [0.5] * 12}),
        ("alibi_scaling.train_seq_len", {"alibi_scaling": {"type": "linear", "train_seq_len": 8}}),
    ],
)
def test_gguf_refuses_what_llama_cpp_cannot_run_exactly_and_writes_nothing(
    make_model, tokenizer, tmp_path, field, overrides
):
    with pytest.raises(ValueError, match=field):
        export(make_model(vocab_size=272, **overrides), "gguf", tmp_path / "model.gguf", tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_gguf_needs_a_tokenizer(make_model, tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        export(make_model(), "gguf", tmp_path / "model.gguf")


def test_cli_export_gguf_takes_the_folders_tokenizer(make_model, tokenizer, tmp_path):
    from hf_alibi.cli import run

    gguf_model(make_model).save_pretrained(tmp_path / "alibi")
    tokenizer.save_pretrained(tmp_path / "alibi")
    destination = str(tmp_path / "out" / "model.gguf")
    run(["export", str(tmp_path / "alibi"), destination, "--to", "gguf", "--max-seq-len", "99"])
    fields, tensors = read_fields(tmp_path / "out" / "model.gguf")
    assert fields["general.architecture"] == "mpt" and fields["mpt.context_length"] == 99
    assert len(fields["tokenizer.ggml.tokens"]) == 272 and "blk.1.ffn_down.weight" in tensors
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.gguf"]  # no temporary left behind


def test_gguf_general_fields_name_the_folder_not_its_path_with_its_card_licence(make_model, tokenizer, tmp_path):
    from hf_alibi.cli import run

    folder = tmp_path / "deep" / "my-alibi"
    gguf_model(make_model).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "README.md").write_text(
        "---\nlicense: bigscience-bloom-rail-1.0\nbase_model: bigscience/bloom-560m\n---\n# my-alibi\n"
    )
    run(["export", str(folder), str(tmp_path / "model.gguf"), "--to", "gguf"])
    fields, _ = read_fields(tmp_path / "model.gguf")
    assert fields["general.name"] == "my-alibi", fields["general.name"]  # llama.cpp and Ollama show it
    assert str(tmp_path) not in json.dumps({k: v for k, v in fields.items() if k.startswith("general.")}, default=str)
    assert fields["general.type"] == "model" and fields["general.size_label"].endswith("K")
    assert fields["general.license"] == "bigscience-bloom-rail-1.0"
    assert fields["general.base_model.count"] == 1
    assert fields["general.base_model.0.repo_url"] == "https://huggingface.co/bigscience/bloom-560m"


def test_zero_slopes_are_written_as_max_alibi_bias_zero(make_model, tokenizer, tmp_path):
    path = export(gguf_model(make_model, alibi_slopes=[0.0] * 12), "gguf", tmp_path / "m.gguf", tokenizer=tokenizer)
    assert read_fields(path)[0]["mpt.attention.max_alibi_bias"] == 0.0


def llama_cpp_model(llama_cpp, path):
    """llama.cpp on CPU with an F32 KV cache (its default F16 cache adds its own rounding) and no flash attention."""
    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(
        str(path),
        n_ctx=512,
        n_batch=512,
        n_ubatch=512,
        logits_all=True,
        verbose=False,
        n_threads=1,
        flash_attn=False,
        type_k=f32,
        type_v=f32,
    )


def both_logits(llm, model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's and our logits (L, V) for `ids`, one pass each."""
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]))  # (L, V)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0]  # (L, V)
    return theirs, ours


def test_llama_cpp_runs_attention_norms_and_head_exactly(make_model, tokenizer, tmp_path):
    """With the MLP's output zeroed (ggml's GELU is the one approximate op), llama.cpp equals ours to fp32 rounding:
    the slopes of 12 interleaved heads, the qkv layout, the biases and the tied head are all written right."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = gguf_model(make_model, n_positions=512)
    with torch.no_grad():
        for block in model.transformer.h:
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
    path = export(model, "gguf", tmp_path / "model.gguf", tokenizer=tokenizer)
    ids = tokenizer("".join(TEXT) * 30)["input_ids"][:500]
    llm = llama_cpp_model(llama_cpp, path)
    theirs, ours = both_logits(llm, model, ids)  # (L, V) each
    error = (theirs - ours).abs().max().item()
    assert error < 1e-5, f"llama.cpp logits differ by {error:.2e}"


def test_llama_cpp_tokens_logits_and_greedy_decoding_match_ours(make_model, tokenizer, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    model = gguf_model(make_model, n_positions=256)
    path = export(model, "gguf", tmp_path / "model.gguf", tokenizer=tokenizer)
    ids = tokenizer("".join(TEXT) * 3)["input_ids"][:120]
    llm = llama_cpp_model(llama_cpp, path)
    text = "".join(TEXT) + "unseen words 12345!"
    assert llm.tokenize(text.encode(), add_bos=False) == tokenizer(text)["input_ids"]  # text in ...
    assert llm.detokenize(tokenizer(text)["input_ids"]).decode() == text  # ... and text out
    theirs, ours = both_logits(llm, model, ids)  # (L, V) each
    scale = ours.abs().max().item()
    error = (theirs - ours).abs().max().item()
    assert error < 1e-3 * scale, f"llama.cpp logits differ by {error:.2e} (logit scale {scale:.2f})"
    llm.reset()
    theirs_greedy = [token for token, _ in zip(llm.generate(ids[:20], temp=0.0, top_k=1), range(15))]
    ours_greedy = list(ids[:20])
    with torch.no_grad():  # plain argmax steps: generate() would stop at (or suppress) eos, llama.cpp's loop does not
        for _ in range(15):
            ours_greedy.append(model(torch.tensor([ours_greedy])).logits[0, -1].argmax().item())
    assert theirs_greedy == ours_greedy[20:]


@pytest.fixture(scope="module")
def byte_tokenizer():
    """The byte-level demo's kind: the 256 byte tokens and <|endoftext|>, no merges at all."""
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=257, special_tokens=["<|endoftext|>"], show_progress=False)
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=eos, bos_token=eos)


def test_a_bpe_of_bytes_alone_gets_one_inert_merge_and_tokenizes_as_ours(make_model, byte_tokenizer, tmp_path):
    """llama.cpp refuses a gpt2 vocabulary without merges ("cannot find tokenizer merges") and gguf cannot store an
    empty list: the export writes one merge whose result is no token, which llama.cpp's tokenizer undoes."""
    assert json.loads(byte_tokenizer.backend_tokenizer.to_str())["model"]["merges"] == []
    model = gguf_model(make_model, vocab_size=257, n_positions=64)
    path = export(model, "gguf", tmp_path / "bytes.gguf", tokenizer=byte_tokenizer)
    fields, _ = read_fields(path)
    (merge,) = fields["tokenizer.ggml.merges"]
    first, second = merge.split(" ")
    tokens = set(fields["tokenizer.ggml.tokens"])
    assert {first, second} <= tokens and first + second not in tokens
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp_model(llama_cpp, path)
    joined = byte_tokenizer.convert_tokens_to_string([first, second])  # the merged pair, as text
    text = "".join(TEXT) + joined * 3 + " é ü 12345"
    assert llm.tokenize(text.encode(), add_bos=False) == byte_tokenizer(text)["input_ids"]
