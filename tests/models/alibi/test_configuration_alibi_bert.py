"""AlibiBertConfig: Jina's key names and defaults, every bad value a ValueError naming its field, the auto_map a
saved config carries, and a round trip through config.json."""

import pytest
from transformers import AutoConfig

from hf_alibi import AlibiBertConfig
from hf_alibi.models.alibi.configuration_alibi_bert import AUTO_MAP


def test_defaults_are_jina_embeddings_v2_base_and_the_model_type_is_its_own():
    config = AlibiBertConfig()
    assert config.model_type == "alibi_bert"  # never "bert": transformers would build a plain BERT
    expected = dict(
        vocab_size=30528,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        hidden_act="gelu",
        feed_forward_type="geglu",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
        type_vocab_size=2,
        initializer_range=0.02,
        layer_norm_eps=1e-12,
        pad_token_id=0,
        classifier_dropout=None,
        qk_layer_norm=False,
        layer_layout="jina",
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    assert {name: getattr(config, name) for name in expected} == expected


@pytest.mark.parametrize(
    "feed_forward_type, hidden_act, activation",
    [("geglu", "relu", "gelu"), ("reglu", "gelu", "relu"), ("glu", "silu", "silu")],
)
def test_the_glu_activation_comes_from_feed_forward_type_and_hidden_act_only_for_glu(
    feed_forward_type, hidden_act, activation
):
    config = AlibiBertConfig(feed_forward_type=feed_forward_type, hidden_act=hidden_act)
    assert config.glu_activation == activation


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=100, num_attention_heads=12), "hidden_size"),
        (dict(feed_forward_type="swiglu"), "feed_forward_type"),
        (dict(hidden_act="nope"), "hidden_act"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(intermediate_size=-1), "intermediate_size"),
        (dict(vocab_size=True), "vocab_size"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(hidden_dropout_prob=1.0), "hidden_dropout_prob"),
        (dict(attention_probs_dropout_prob=-0.1), "attention_probs_dropout_prob"),
        (dict(classifier_dropout=2), "classifier_dropout"),
        (dict(layer_norm_eps=0), "layer_norm_eps"),
        (dict(qk_layer_norm="yes"), "qk_layer_norm"),
        (dict(layer_layout="jina-code"), "layer_layout"),
    ],
)
def test_every_bad_value_is_a_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        AlibiBertConfig(**overrides)


def test_saved_config_round_trips_and_carries_the_auto_map_for_remote_code(tmp_path):
    config = AlibiBertConfig(hidden_size=64, num_attention_heads=4, qk_layer_norm=True, feed_forward_type="reglu")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is AlibiBertConfig
    assert loaded.to_diff_dict() | {"_name_or_path": ""} == config.to_diff_dict() | {"_name_or_path": ""}
    assert loaded.auto_map == AUTO_MAP
    assert set(AUTO_MAP) == {
        "AutoConfig",
        "AutoModel",
        "AutoModelForMaskedLM",
        "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification",
    }
