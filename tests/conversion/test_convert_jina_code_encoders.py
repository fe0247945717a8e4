"""jina-embeddings-v2-base-code (`jina-bert-v2-qk-post-norm`) -> ALiBi BERT with `layer_layout="jina_code"` is exact:
hidden states, pooler and MLM logits equal the float64 reference of their layer (`encoder_reference`: the input added
a second time after the attention block, the GLU's activation on the second half) within fp32 rounding, padded, on
every attention backend, past 8192 tokens; the layout is told from the auto_map or the keys alone; the import is a
key-for-key copy and exports back bit for bit; what their code cannot hold is refused (its GGUF export:
test_gguf_export_encoders).
The padded batch on every backend (base, and masked-LM with reglu) runs in test_convert_encoders, whose SOURCES hold
base-code's checkpoints."""

import json

import pytest
import torch
from safetensors.torch import load_file

from encoder_reference import JINA_BASE_CODE, jina_config, save_source, tiny_state
from hf_alibi import convert, export
from hf_alibi.cli import run
from hf_alibi.conversion.encoders import encoder_family
from test_convert_encoders import assert_matches_reference


def base_code(tmp_path, head: str = "base", **changes):
    """A tiny jina-embeddings-v2-base-code checkpoint saved as the Hub holds it: (folder, config, state)."""
    config = jina_config(head, code=JINA_BASE_CODE) | changes
    state = tiny_state(config, head, fused=False)
    return save_source(tmp_path / f"base-code-{head}", config, state, pickled=False), config, state


def test_base_code_import_holds_past_8192_tokens(tmp_path):
    """One layer of two heads keeps the float64 reference's 8300 x 8300 scores to seconds."""
    folder, config, state = base_code(tmp_path, num_hidden_layers=1, num_attention_heads=2)
    ids = torch.randint(5, 64, (1, 8300), generator=torch.Generator().manual_seed(0))
    assert_matches_reference(convert(str(folder)), config, state, ids, torch.ones_like(ids))


def test_base_code_import_is_a_key_for_key_copy_with_the_layout_switch(tmp_path):
    folder, _, state = base_code(tmp_path)
    model = convert(str(folder))
    assert (model.config.layer_layout, model.config.qk_layer_norm) == ("jina_code", True)
    ours = model.state_dict()
    assert set(ours) == set(state), set(ours) ^ set(state)
    assert all(torch.equal(ours[key], tensor) for key, tensor in state.items())


def test_the_layout_is_told_from_the_auto_map_or_from_the_keys_alone(tmp_path):
    config = jina_config(code=JINA_BASE_CODE)
    keys = tiny_state(config, "base", fused=False)
    assert encoder_family(config, ()) == "jina_code"
    assert encoder_family({**config, "auto_map": {}}, keys) == "jina_code"
    assert encoder_family(jina_config(), ()) == "jina"


def test_base_code_without_its_query_and_key_norms_is_refused_by_name(tmp_path):
    config = jina_config(code=JINA_BASE_CODE)
    state = {k: v for k, v in tiny_state(config, "base", fused=False).items() if "layer_norm_q" not in k}
    folder = save_source(tmp_path / "source", config, state, pickled=False)
    with pytest.raises(ValueError, match="layer_norm_q"):
        convert(str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("head", ["base", "masked_lm"])
def test_base_code_import_then_export_gives_back_the_source_bit_for_bit(tmp_path, head):
    folder, config, _ = base_code(tmp_path, head)
    run(["convert", str(folder), str(tmp_path / "ours")])
    run(["export", str(tmp_path / "ours"), str(tmp_path / "theirs"), "--to", "jina_code"])
    source, exported = (load_file(f / "model.safetensors") for f in (folder, tmp_path / "theirs"))
    if head == "masked_lm":  # the Jina export writes the decoder bias under BERT's saved name (their code reads both)
        source["cls.predictions.bias"] = source.pop("cls.predictions.decoder.bias")
    assert set(exported) == set(source), set(exported) ^ set(source)
    assert not [key for key, tensor in source.items() if not torch.equal(exported[key], tensor)]
    theirs = json.loads((tmp_path / "theirs" / "config.json").read_text())
    keys = ("auto_map", "architectures", "feed_forward_type", "position_embedding_type", "hidden_act", "vocab_size")
    assert {key: theirs[key] for key in keys} == {key: config[key] for key in keys}


EXPORT_REFUSALS = {  # (layer_layout of the model, target) -> what the refusal names
    ("jina_code", "jina"): "layer_layout='jina_code'",
    ("jina_code", "mosaic"): "layer_layout='jina_code'",
    ("jina", "jina_code"): "layer_layout='jina'",
    ("jina_code_without_qk_norms", "jina_code"): "qk_layer_norm=False",
}


@pytest.mark.parametrize("case", sorted(EXPORT_REFUSALS))
def test_a_layout_other_than_the_models_refuses_by_name_and_writes_nothing(tmp_path, make_encoder, case):
    layer_layout, target = case
    qk_norms = not layer_layout.endswith("without_qk_norms")
    model = make_encoder(layer_layout=layer_layout.removesuffix("_without_qk_norms"), qk_layer_norm=qk_norms)
    with pytest.raises(ValueError, match=EXPORT_REFUSALS[case]):
        export(model, target, tmp_path / "out")
    assert not (tmp_path / "out").exists()
