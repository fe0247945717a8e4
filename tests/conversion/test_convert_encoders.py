"""jina-embeddings-v2 (base-code's layout too), jina-reranker-v1, MosaicBERT and DNABERT-2 -> ALiBi BERT is exact: hidden states, pooler, MLM and
classifier logits equal the float64 reference of their code (`encoder_reference`) within fp32 rounding, on a padded
batch, on every attention backend, past 8192 tokens; both weight layouts; tokenizer files as shipped (their config
listing the tokenizer's inputs); what cannot be held exactly is refused by name, with nothing written."""

import json

import pytest
import torch

from encoder_reference import (
    JINA_BASE_CODE,
    VOCAB,
    jina_config,
    mosaic_config,
    reference_forward,
    save_source,
    tiny_state,
    wordpiece_tokenizer,
)
from hf_alibi import convert
from hf_alibi.cli import run

ATOL = 2e-5  # fp32 against float64 for outputs of order 1-10; measured up to 8e-6
BACKENDS = ("eager", "sdpa", "flex_attention")
# name -> (their config, head, fused Wqkv, pytorch_model.bin)
SOURCES = {
    "jina-embeddings-v2": (jina_config(), "base", False, False),
    "jina-reranker-v1": (jina_config("sequence_classification"), "sequence_classification", False, False),
    "jina-mlm-reglu": (jina_config("masked_lm", "reglu"), "masked_lm", False, False),
    "jina-embeddings-v2-base-code": (jina_config(code=JINA_BASE_CODE), "base", False, False),
    "jina-base-code-mlm-reglu": (jina_config("masked_lm", "reglu", JINA_BASE_CODE), "masked_lm", False, False),
    "mosaicbert": (mosaic_config(), "masked_lm", True, True),
    "mosaicbert-classifier": (mosaic_config(head="sequence_classification"), "sequence_classification", True, True),
    "dnabert-2": (mosaic_config(dnabert2=True), "masked_lm", True, True),
}


def source(tmp_path, name: str, **state_kwargs):
    """The tiny checkpoint `name` saved in its own layout: (folder, config dict, state dict)."""
    config, head, fused, pickled = SOURCES[name]
    state = tiny_state(config, head, fused, **state_kwargs)
    return save_source(tmp_path / name, config, state, pickled=pickled), config, state


def padded_batch(length: int = 37):
    """Two rows of random ids (type ids mixed), the second right-padded by 9."""
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(5, VOCAB, (2, length), generator=generator)  # (B, L)
    types = torch.randint(0, 2, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, length - 9 :] = 0
    return ids, mask, types


def assert_matches_reference(model, config, state, ids, mask, types=None) -> None:
    """Last hidden states at every real token, the pooler output and the head's logits, against float64."""
    expected = reference_forward(config, state, ids, mask, types)
    real = mask.bool()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    got = {"hidden": out.hidden_states[-1] if out.hidden_states is not None else out.last_hidden_state}
    if getattr(out, "pooler_output", None) is not None:
        got["pooled"] = out.pooler_output
    if getattr(out, "logits", None) is not None:
        got["logits"] = out.logits
    assert set(expected) <= set(got) | ({"pooled"} if "logits" in got else set()), (set(expected), set(got))
    for name, tensor in got.items():
        difference = tensor.double() - expected[name]
        error = (difference[real] if tensor.dim() == 3 else difference).abs().max().item()
        assert error < ATOL, f"{name} differs from their code's by {error:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SOURCES))
def test_import_matches_their_code_on_a_padded_batch(tmp_path, name, backend):
    folder, config, state = source(tmp_path, name)
    model = convert(str(folder))
    model.set_attn_implementation(backend)
    assert_matches_reference(model, config, state, *padded_batch())


def test_import_holds_past_8192_tokens(tmp_path):
    """Their Jina code builds its bias for max_position_embeddings (8192) tokens; ours has no cap. One layer of two
    heads keeps the float64 reference's 8300 x 8300 scores to seconds."""
    config = jina_config() | {"num_hidden_layers": 1, "num_attention_heads": 2}
    state = tiny_state(config, "base", fused=False)
    model = convert(str(save_source(tmp_path / "long", config, state, pickled=False)))
    ids = torch.randint(5, VOCAB, (1, 8300), generator=torch.Generator().manual_seed(0))
    assert_matches_reference(model, config, state, ids, torch.ones_like(ids))


def test_the_classes_and_switches_each_source_needs(tmp_path):
    got = {}
    for name in SOURCES:
        model = convert(str(source(tmp_path, name)[0]))
        config = model.config
        got[name] = (
            type(model).__name__,
            config.feed_forward_type,
            config.layer_layout,
            config.max_position_embeddings,
        )
    assert got == {
        "jina-embeddings-v2": ("AlibiBertModel", "geglu", "jina", 8192),
        "jina-reranker-v1": ("AlibiBertForSequenceClassification", "geglu", "jina", 8192),
        "jina-mlm-reglu": ("AlibiBertForMaskedLM", "reglu", "jina", 8192),
        "jina-embeddings-v2-base-code": ("AlibiBertModel", "geglu", "jina_code", 8192),
        "jina-base-code-mlm-reglu": ("AlibiBertForMaskedLM", "reglu", "jina_code", 8192),
        "mosaicbert": ("AlibiBertForMaskedLM", "geglu", "jina", 512),
        "mosaicbert-classifier": ("AlibiBertForSequenceClassification", "geglu", "jina", 512),
        "dnabert-2": ("AlibiBertForMaskedLM", "geglu", "jina", 512),
    }


def test_bert_prefixed_and_bare_jina_weights_import_alike(tmp_path):
    config, _, _, _ = SOURCES["jina-embeddings-v2"]
    state = tiny_state(config, "base", fused=False)
    bare = convert(str(save_source(tmp_path / "bare", config, state, pickled=False)))
    prefixed_state = {"bert." + key: value for key, value in state.items()}
    prefixed_state["bert.embeddings.position_ids"] = torch.arange(512)[None]  # a buffer older checkpoints saved
    prefixed = convert(str(save_source(tmp_path / "prefixed", config, prefixed_state, pickled=True)))
    assert type(bare) is type(prefixed)
    for key, tensor in bare.state_dict().items():
        assert torch.equal(tensor, prefixed.state_dict()[key]), key


@pytest.mark.parametrize("name", ["jina-embeddings-v2", "mosaicbert"])
def test_query_and_key_norms_their_code_ignores_are_refused_by_name(tmp_path, name):
    """jina-bert-implementation and MosaicBERT build no layer_norm_q/k (base-code's qk-post-norm code does):
    `from_pretrained` drops such keys, so an import applying them would not be their model."""
    folder, _, _ = source(tmp_path, name, qk_norm=True)
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self\.layer_norm_k\.bias and 7 more"):
        convert(str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_folder_keeps_the_tokenizer_files_as_shipped_its_config_listing_the_tokenizers_inputs(tmp_path):
    folder, _, _ = source(tmp_path, "jina-embeddings-v2")
    wordpiece_tokenizer(folder)
    destination = convert(str(folder), tmp_path / "out")
    for name in ("vocab.txt", "tokenizer.json"):
        assert (destination / name).read_bytes() == (folder / name).read_bytes(), name
    theirs = json.loads((folder / "tokenizer_config.json").read_text())
    assert "model_input_names" not in theirs and theirs["tokenizer_class"] == "BertTokenizer"
    inputs = ["input_ids", "token_type_ids", "attention_mask"]  # BertTokenizer's
    assert json.loads((destination / "tokenizer_config.json").read_text()) == {**theirs, "model_input_names": inputs}


def test_folder_tokenizer_gives_a_pair_the_same_inputs_as_the_source_tokenizer(tmp_path):
    """transformers 5.0-5.2 build the generic tokenizer for an `alibi_bert` folder, with no token_type_ids unless
    tokenizer_config.json lists them: a reranker would score a pair's second text as if it were the first's."""
    from transformers import AutoTokenizer

    folder, _, _ = source(tmp_path, "jina-reranker-v1")
    theirs = wordpiece_tokenizer(folder)
    ours = AutoTokenizer.from_pretrained(convert(str(folder), tmp_path / "out"))
    pairs = (["hello world", "lazy dog"], ["the quick brown fox", "a long text of many words"])
    expected, got = theirs(*pairs, padding=True), ours(*pairs, padding=True)
    assert dict(got) == dict(expected) and 1 in sum(got["token_type_ids"], [])


def test_cli_convert_says_the_import_is_exact(tmp_path, capsys):
    folder, _, _ = source(tmp_path, "dnabert-2")
    run(["convert", str(folder), str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "ALiBi BERT" in out and "exact" in out, out
    assert (tmp_path / "out" / "model.safetensors").is_file()


def _without(state: dict, suffix: str) -> dict:
    return {key: value for key, value in state.items() if not key.endswith(suffix)}


REFUSALS = {
    # name -> (how the source is changed, what the refusal names)
    "plain BERT": (lambda c, s: ({**c, "auto_map": {}}, _plain_bert(s)), "no sign of ALiBi"),
    "original MLP": (lambda c, s: ({**c, "feed_forward_type": "original"}, s), "feed_forward_type='original'"),
    "unknown MLP": (lambda c, s: ({**c, "feed_forward_type": "swiglu"}, s), "feed_forward_type='swiglu'"),
    "absolute positions": (lambda c, s: ({**c, "position_embedding_type": "absolute"}, s), "position_embedding_type"),
    "missing weight": (lambda c, s: (c, _without(s, "encoder.layer.1.mlp.wo.bias")), "encoder.layer.1.mlp.wo.bias"),
}


def _renamed(state: dict, renames: dict) -> dict:
    """`state` with each `old` part of its keys replaced by `new`."""
    renamed = {}
    for key, value in state.items():
        for old, new in renames.items():
            key = key.replace(old, new)
        renamed[key] = value
    return renamed


def _plain_bert(state: dict) -> dict:
    """BERT's own MLP names instead of the GLU's: nothing says ALiBi."""
    names = {"mlp.gated_layers": "intermediate.dense", "mlp.wo": "output.dense", "mlp.layernorm": "output.LayerNorm"}
    return _renamed(state, names)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_what_cannot_be_held_exactly_is_refused_by_name_and_nothing_written(tmp_path, case):
    change, named = REFUSALS[case]
    config, state = change(jina_config(), tiny_state(jina_config(), "base", fused=False))
    folder = save_source(tmp_path / "source", config, state, pickled=False)
    with pytest.raises(ValueError, match=named):
        convert(str(folder), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mosaic_mlm_refuses_an_eps_its_head_does_not_use(tmp_path):
    config, head, fused, _ = SOURCES["mosaicbert"]
    config = {**config, "layer_norm_eps": 1e-5}
    folder = save_source(tmp_path / "source", config, tiny_state(config, head, fused), pickled=True)
    with pytest.raises(ValueError, match="layer_norm_eps=1e-05"):
        convert(str(folder))
