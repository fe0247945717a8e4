"""ALiBi GPT-2 -> Baichuan layout (`--to baichuan`): `W_pack` fused again, Baichuan2's head normalised, their config
keys; import -> export -> import gives every tensor back bit for bit, and the exported files read as their code and
llama.cpp's converter read them (keys, shapes, config keys) give our logits. What their layout cannot hold is refused
by name, and every other layout refuses an imported Baichuan naming its RMSNorm."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from baichuan_checkpoints import GENERATIONS, HEADS, HIDDEN, INTERMEDIATE, LAYERS, VOCAB, save_source, their_logits
from baichuan_checkpoints import tiny_checkpoint as their_checkpoint
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, convert, export
from hf_alibi.cli import run
from hf_alibi.conversion import convert_baichuan, export_baichuan
from hf_alibi.conversion.baichuan import check_baichuan_exportable
from hf_alibi.conversion.remote_code import Checkpoint

# Their config class's keys (llama.cpp's converter reads num_hidden_layers, num_attention_heads, hidden_size,
# intermediate_size, rms_norm_eps and model_max_length of them)
CONFIG_KEYS = {
    "model_type",
    "architectures",
    "auto_map",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_act",
    "model_max_length",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "torch_dtype",
}


def published_shapes(layers: int = LAYERS) -> dict[str, tuple[int, ...]]:
    """The keys and shapes of a Baichuan-13B checkpoint of this size, as their modeling code declares them."""
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "self_attn.W_pack.weight": (3 * HIDDEN, HIDDEN),
            layer + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            layer + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            layer + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            layer + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            layer + "input_layernorm.weight": (HIDDEN,),
            layer + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_their_checkpoint_to_ours_and_back_gives_their_tensors_back_bit_for_bit(generation, dtype):
    source = their_checkpoint(generation, dtype=dtype)
    model = convert_baichuan(source)
    assert model.dtype == dtype
    back = export_baichuan(model)
    assert set(back.state_dict) == set(source.state_dict)
    expected = dict(source.state_dict)
    if generation == "baichuan2_13b":  # the head as their NormHead uses it, normalised in its own dtype
        expected["lm_head.weight"] = F.normalize(expected["lm_head.weight"], dim=-1)
    differing = [name for name, tensor in expected.items() if not torch.equal(back.state_dict[name], tensor)]
    assert not differing, f"changed in the round trip: {differing}"
    again = convert_baichuan(back)  # a normalised head is kept as it is: import -> export -> import is exact
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    assert export_baichuan(again).config == back.config


@pytest.mark.parametrize("generation", sorted(GENERATIONS))
def test_exported_folder_has_their_layout_and_reads_as_their_code_reads_it(tmp_path, generation):
    source = their_checkpoint(generation)
    save_source(source, tmp_path / "source")
    run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    run(["export", str(tmp_path / "alibi"), str(tmp_path / "back"), "--to", "baichuan", "--max-seq-len", "4096"])
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    v2 = generation == "baichuan2_13b"
    assert set(config) == CONFIG_KEYS | ({"z_loss_weight"} if v2 else set())
    assert (config["model_type"], config["architectures"], config["model_max_length"]) == (
        "baichuan",
        ["BaichuanForCausalLM"],
        4096,
    )
    expected_config = {key: value for key, value in source.config.items() if key in CONFIG_KEYS - {"model_max_length"}}
    assert {key: config[key] for key in expected_config} == expected_config  # the source's own values
    state = load_file(tmp_path / "back" / "model.safetensors")
    assert {name: tuple(tensor.shape) for name, tensor in state.items()} == published_shapes()
    ids = torch.randint(3, VOCAB, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    ours = AlibiGPT2LMHeadModel.from_pretrained(tmp_path / "alibi").eval()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits.double()
    theirs = their_logits(Checkpoint(config, state), ids, mask)  # their NormHead normalises the head once more
    error = (got - theirs)[mask.bool()].abs().max().item()
    assert error <= 1e-5 * theirs[mask.bool()].abs().max().item(), f"the export read as theirs differs by {error:.2e}"
    again = convert(str(tmp_path / "back"))
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in ours.state_dict().items())


def baichuan_shaped(**overrides) -> AlibiGPT2Config:
    fields = dict(n_embd=HIDDEN, n_head=HEADS, n_layer=1, vocab_size=VOCAB, n_inner=INTERMEDIATE)
    switches = dict(norm_type="rms_norm", bias=False, tie_word_embeddings=False, gated_mlp=True)
    return AlibiGPT2Config(**(fields | switches | dict(activation_function="silu") | overrides))


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(norm_type="layer_norm"), "norm_type='layer_norm'"),
        (dict(bias=True), "bias=True"),
        (dict(gated_mlp=False), "gated_mlp=False"),
        (dict(activation_function="gelu_new"), "activation_function='gelu_new'"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (dict(attn_scale_power=1.0), "attn_scale_power=1.0"),
        (dict(alibi_scaling={"type": "linear", "factor": 2.0}), "alibi_scaling="),
        (dict(alibi_max_bias=4.0), "alibi_slopes"),
        (dict(n_embd=4096, n_head=32, n_inner=None), "rotary.*n_embd=4096"),
    ],
)
def test_export_refuses_what_their_layout_cannot_hold_naming_the_field(overrides, named):
    with pytest.raises(ValueError, match=named):
        check_baichuan_exportable(baichuan_shaped(**overrides))


@pytest.mark.parametrize("layout", ["bloom", "mpt", "jais", "gguf"])
def test_every_other_layout_refuses_an_imported_baichuan_naming_its_rms_norm(tmp_path, layout):
    model = convert_baichuan(their_checkpoint("baichuan_13b"))
    destination = tmp_path / ("model.gguf" if layout == "gguf" else "out")
    with pytest.raises(ValueError, match="norm_type='rms_norm'.*--to baichuan"):
        export(model, layout, destination, tokenizer=object())
    assert not destination.exists()
