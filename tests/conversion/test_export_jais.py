"""ALiBi GPT-2 -> Jais / BTLM layout round-trips bit for bit both ways (one table applied both ways), writes the config
keys their code reads, refuses what their architecture cannot hold; -> GGUF as llama.cpp's `jais` architecture holds a
gated model exactly (llama.cpp's own logits where `llama_cpp` is importable)."""

import json

import numpy as np
import pytest
import torch

from family_checks import left_padded_batch
from hf_alibi import convert, export
from hf_alibi.cli import run
from hf_alibi.conversion import convert_cerebras, export_bloom, export_cerebras, export_mpt
from hf_alibi.conversion.remote_code import Checkpoint
from jais_checkpoints import GENERATIONS, byte_level_tokenizer, save_source, their_logits, tiny_checkpoint
from test_gguf_export import both_logits, llama_cpp_model, read_fields

MODEL_TYPES = {"jais_13b": "jais", "jais_family": "jais", "btlm": "btlm"}


def without_mask_buffers(state: dict) -> dict:
    return {name: tensor for name, tensor in state.items() if not name.endswith((".attn.bias", ".attn.masked_bias"))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_their_checkpoint_to_ours_and_back_gives_every_tensor_back_bit_for_bit(generation, dtype):
    source = tiny_checkpoint(generation)
    source = source._replace(
        state_dict={
            name: tensor.to(dtype) if tensor.is_floating_point() else tensor
            for name, tensor in source.state_dict.items()
        }
    )
    back = export_cerebras(convert_cerebras(source), MODEL_TYPES[generation]).state_dict
    expected = without_mask_buffers(source.state_dict)  # their code rebuilds those buffers and ignores saved ones
    assert set(back) == set(expected), set(back) ^ set(expected)
    differing = [name for name, tensor in expected.items() if not torch.equal(back[name], tensor)]
    assert not differing, f"changed in the round trip: {differing}"


@pytest.mark.parametrize("model_type", ["jais", "btlm"])
def test_ours_to_their_layout_and_back_gives_the_same_model(make_model, random_ids, model_type):
    model = make_model(
        n_head=6,
        n_embd=48,
        gated_mlp=True,
        activation_function="silu",
        n_inner=100,
        attn_scale_power=1.0,
        embedding_scale=7.5,
        logit_scale=0.3,
        alibi_scaling={"type": "linear", "factor": 2.0},
    )
    back = convert_cerebras(export_cerebras(model, model_type))
    for name in ("gated_mlp", "attn_scale_power", "embedding_scale", "logit_scale", "alibi_scaling"):
        assert getattr(back.config, name) == getattr(model.config, name), name
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    ids = random_ids(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_exported_keys_read_as_their_code_reads_them_give_our_logits(generation):
    model = convert_cerebras(tiny_checkpoint(generation))
    exported = export_cerebras(model, MODEL_TYPES[generation])
    config = exported.config
    assert config["model_type"] == MODEL_TYPES[generation] and config["position_embedding_type"] == "alibi"
    assert config["activation_function"] == "swiglu" and config["mup_scale_qk_dot_by_d"] is True
    assert ("width_scale" in config) == (MODEL_TYPES[generation] == "jais")  # jais-13b's code reads these keys
    ids, mask = left_padded_batch()
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
    old_keys = ("width_scale", "embeddings_scale", "scale_qk_dot_by_d")  # jais-13b's code reads these when present
    mup_only = {key: value for key, value in config.items() if key not in old_keys}  # as the mup_* code reads it
    for name, keys in (("all keys", config), ("mup_* keys", mup_only)):
        theirs = their_logits(Checkpoint(keys, exported.state_dict), ids, mask)
        error = (ours.double() - theirs)[mask.bool()].abs().max().item()
        assert error < 2e-5, f"read by its {name}, the export differs from ours by {error:.2e}"


def test_export_folder_reimports_exactly_with_n_positions_from_max_seq_len(tmp_path):
    source = tiny_checkpoint("btlm")
    save_source(source, tmp_path / "source")
    byte_level_tokenizer().save_pretrained(tmp_path / "source")
    run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    run(["export", str(tmp_path / "alibi"), str(tmp_path / "btlm"), "--to", "btlm", "--max-seq-len", "8192"])
    config = json.loads((tmp_path / "btlm" / "config.json").read_text())
    assert config["n_positions"] == 8192
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_btlm.BTLMLMHeadModel"
    assert (tmp_path / "btlm" / "model.safetensors").is_file() and (tmp_path / "btlm" / "tokenizer.json").is_file()
    again = convert(str(tmp_path / "btlm"))
    original = convert(str(tmp_path / "source"))
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in original.state_dict().items())


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("activation_function", dict(gated_mlp=True, activation_function="gelu_new")),
        ("attn_scale_power", dict(gated_mlp=True, activation_function="silu", attn_scale_power=0.75)),
        (
            "alibi_scaling.factor",
            dict(gated_mlp=True, activation_function="silu", alibi_scaling={"type": "linear", "factor": 0.5}),
        ),
        (
            "alibi_scaling.train_seq_len",
            dict(gated_mlp=True, activation_function="silu", alibi_scaling={"type": "linear", "train_seq_len": 1}),
        ),
        ("bias", dict(bias=False)),
        ("embedding_layernorm", dict(embedding_layernorm=True)),
        ("clip_qkv", dict(clip_qkv=2.0)),
    ],
)
def test_export_to_their_layout_refuses_what_their_code_cannot_run(make_model, tmp_path, field, overrides):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        export(make_model(**overrides), "jais", tmp_path / "jais")
    assert not (tmp_path / "jais").exists()


@pytest.mark.parametrize(
    "field",
    ["gated_mlp", "attn_scale_power", "embedding_scale", "logit_scale", "alibi_slopes", "alibi_scaling.train_seq_len"],
)
def test_bloom_and_mpt_exports_refuse_the_jais_switches(make_model, field):
    switch = {
        "gated_mlp": dict(gated_mlp=True),
        "attn_scale_power": dict(attn_scale_power=1.0),
        "embedding_scale": dict(embedding_scale=2.0),
        "logit_scale": dict(logit_scale=0.5),
        "alibi_slopes": dict(alibi_scaling={"type": "linear", "factor": 2.0}),
        "alibi_scaling.train_seq_len": dict(alibi_scaling={"type": "linear", "train_seq_len": 8}),
    }[field]
    field = field.replace(".", r"\.")
    with pytest.raises(ValueError, match=field):
        export_bloom(make_model(embedding_layernorm=True, **switch))
    with pytest.raises(ValueError, match=field):
        export_mpt(make_model(bias=False, activation_function="gelu", n_head=4, n_embd=32, **switch))


@pytest.mark.parametrize("scaling", [{"type": "linear", "factor": 2.0}, {"type": "linear", "train_seq_len": 6}])
@pytest.mark.parametrize("generation", ["jais_family", "btlm"])
def test_hf_alibi_export_writes_alibi_scaling_back_and_it_reimports_to_the_same_logits(tmp_path, generation, scaling):
    save_source(tiny_checkpoint(generation, alibi_scaling=scaling), tmp_path / "source")
    run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    model_type = MODEL_TYPES[generation]
    run(["export", str(tmp_path / "alibi"), str(tmp_path / "back"), "--to", model_type])
    assert json.loads((tmp_path / "back" / "config.json").read_text())["alibi_scaling"] == scaling
    original, again = convert(str(tmp_path / "source")), convert(str(tmp_path / "back"))
    assert original.config.alibi_scaling == again.config.alibi_scaling == scaling
    ids, mask = left_padded_batch(14)  # past train_seq_len: the scale of K = 14
    with torch.no_grad():
        torch.testing.assert_close(
            again(ids, attention_mask=mask).logits, original(ids, attention_mask=mask).logits, atol=0, rtol=0
        )


def gguf_jais(generation="btlm", vocab=None):
    overrides = {} if vocab is None else {"vocab_size": vocab}
    return convert_cerebras(tiny_checkpoint(generation, n_positions=512, **overrides))


def test_gguf_of_a_gated_model_is_llama_cpps_jais_with_the_multipliers_folded(tmp_path):
    tokenizer = byte_level_tokenizer()
    model = gguf_jais(vocab=len(tokenizer))
    path = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tokenizer)
    fields, tensors = read_fields(path)
    assert fields["general.architecture"] == "jais" and fields["jais.feed_forward_length"] == 100
    assert fields["jais.attention.max_alibi_bias"] == pytest.approx(8.0)
    state = {name: tensor.numpy() for name, tensor in model.state_dict().items()}
    wte = state["transformer.wte.weight"]
    assert np.array_equal(tensors["token_embd.weight"], wte * np.float32(14.6))  # mup_embeddings_scale
    assert np.array_equal(tensors["output.weight"], wte * np.float32(2.22 * 0.1))  # mup_output_alpha * mup_width_scale
    for ours, theirs in (("mlp.c_fc", "ffn_up"), ("mlp.c_fc2", "ffn_gate"), ("mlp.c_proj", "ffn_down")):
        assert np.array_equal(tensors[f"blk.1.{theirs}.weight"], state[f"transformer.h.1.{ours}.weight"].T), theirs
        assert np.array_equal(tensors[f"blk.1.{theirs}.bias"], state[f"transformer.h.1.{ours}.bias"]), theirs
    assert {name for name in tensors if name.startswith("blk.0.")} == {
        f"blk.0.{name}.{part}"
        for name in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_gate", "ffn_down")
        for part in ("weight", "bias")
    }


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("attn_scale_power", dict(attn_scale_power=0.5)),
        ("alibi_scaling.factor", dict(alibi_scaling={"type": "linear", "factor": 2.0})),
        ("alibi_scaling.train_seq_len", dict(alibi_scaling={"type": "linear", "train_seq_len": 8})),
        ("activation_function", dict(activation_function="gelu_new")),
        ("bias", dict(bias=False)),
    ],
)
def test_gguf_refuses_gated_models_llama_cpps_jais_cannot_hold(make_model, tmp_path, field, overrides):
    settings = dict(gated_mlp=True, activation_function="silu", attn_scale_power=1.0) | overrides
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        export(make_model(**settings), "gguf", tmp_path / "m.gguf", tokenizer=byte_level_tokenizer())
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("field", ["embedding_scale", "logit_scale"])
def test_gguf_mpt_refuses_multipliers_it_has_no_place_for(make_model, tmp_path, field):
    with pytest.raises(ValueError, match=field):
        export(make_model(**{field: 2.0}), "gguf", tmp_path / "m.gguf", tokenizer=byte_level_tokenizer())


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_llama_cpp_jais_gives_our_logits_and_greedy_tokens(tmp_path, generation):
    llama_cpp = pytest.importorskip("llama_cpp")
    tokenizer = byte_level_tokenizer()
    model = gguf_jais(generation, vocab=len(tokenizer))
    path = export(model, "gguf", tmp_path / "m.gguf", tokenizer=tokenizer)
    ids = torch.randint(3, len(tokenizer), (300,), generator=torch.Generator().manual_seed(4)).tolist()
    llm = llama_cpp_model(llama_cpp, path)
    theirs, ours = both_logits(llm, model, ids)  # (L, V) each
    error = (theirs - ours).abs().max().item()
    assert error < 2e-5, f"llama.cpp's jais logits differ by {error:.2e}"  # logits of order 10; measured up to 6e-6
    llm.reset()
    theirs_greedy = [token for token, _ in zip(llm.generate(ids[:20], temp=0.0, top_k=1), range(12))]
    ours_greedy = list(ids[:20])
    with torch.no_grad():  # plain argmax steps, as llama.cpp's loop takes them (no eos handling)
        for _ in range(12):
            ours_greedy.append(model(torch.tensor([ours_greedy])).logits[0, -1].argmax().item())
    assert theirs_greedy == ours_greedy[20:]
