"""ALiBi BERT -> jina-bert-implementation and MosaicBERT layouts: an import exported again gives back the source's
tensors bit for bit and the config keys their code reads; an export imported again is the same model; what a layout
cannot hold is refused by name, with nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file

from encoder_reference import jina_config, mosaic_config, save_source, tiny_state
from hf_alibi import AlibiBertForTokenClassification, AlibiBertModel, export
from hf_alibi.cli import run
from hf_alibi.conversion import convert_encoder

# name -> (their config, head, layout, their weights file)
ROUND_TRIPS = {
    "jina-embeddings-v2": (jina_config(), "base", "jina", "model.safetensors"),
    "jina-reranker-v1": (
        jina_config("sequence_classification"),
        "sequence_classification",
        "jina",
        "model.safetensors",
    ),
    "mosaicbert": (mosaic_config(), "masked_lm", "mosaic", "pytorch_model.bin"),
    "mosaicbert-classifier": (
        mosaic_config(head="sequence_classification"),
        "sequence_classification",
        "mosaic",
        "pytorch_model.bin",
    ),
}
# The keys their code reads that an export writes as the source had them (dropouts and sizes included)
READ_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "type_vocab_size",
    "layer_norm_eps",
    "pad_token_id",
    "max_position_embeddings",
    "auto_map",
    "architectures",
    "model_type",
)


def their_files(folder, weights: str) -> dict:
    if weights.endswith(".bin"):
        return torch.load(folder / weights, weights_only=True)
    return load_file(folder / weights)


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_import_then_export_gives_back_the_source_bit_for_bit(tmp_path, name):
    config, head, layout, weights = ROUND_TRIPS[name]
    state = tiny_state(config, head, fused=layout == "mosaic")
    folder = save_source(tmp_path / "source", config, state, pickled=layout == "mosaic")
    run(["convert", str(folder), str(tmp_path / "ours")])
    run(["export", str(tmp_path / "ours"), str(tmp_path / "theirs"), "--to", layout])
    source, exported = their_files(folder, weights), their_files(tmp_path / "theirs", weights)
    assert set(exported) == set(source), set(exported) ^ set(source)
    differing = [key for key, tensor in source.items() if not torch.equal(exported[key], tensor)]
    assert not differing, f"tensors changed on the way: {differing}"
    theirs = json.loads((tmp_path / "theirs" / "config.json").read_text())
    changed = {key: (config.get(key), theirs.get(key)) for key in READ_KEYS if config.get(key) != theirs.get(key)}
    assert not changed, changed


def test_export_then_import_is_the_same_model(make_encoder):
    model = make_encoder(feed_forward_type="reglu")
    back = convert_encoder(export(model, "jina"))  # their config dict and state dict, read as a checkpoint
    for key, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    assert back.config.feed_forward_type == "reglu"


EXPORT_REFUSALS = {
    "jina q/k norms": ("jina", dict(qk_layer_norm=True), AlibiBertModel, "qk_layer_norm=True"),
    "mosaic reglu": ("mosaic", dict(feed_forward_type="reglu"), AlibiBertModel, "feed_forward_type='reglu'"),
    "mosaic token head": ("mosaic", {}, AlibiBertForTokenClassification, "token_classification"),
}


@pytest.mark.parametrize("case", sorted(EXPORT_REFUSALS))
def test_a_layout_that_cannot_hold_the_model_refuses_by_name_and_writes_nothing(tmp_path, make_encoder, case):
    layout, fields, model_class, named = EXPORT_REFUSALS[case]
    with pytest.raises(ValueError, match=named):
        export(make_encoder(model_class, **fields), layout, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gpt2_layouts_refuse_an_encoder_and_encoder_layouts_a_decoder(tmp_path, make_model, make_encoder):
    with pytest.raises(ValueError, match="layout='mpt'"):
        export(make_encoder(), "mpt", tmp_path / "a")
    with pytest.raises(ValueError, match="layout='jina'"):
        export(make_model(), "jina", tmp_path / "b")
