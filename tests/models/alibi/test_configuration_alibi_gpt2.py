"""AlibiGPT2Config: GPT-2's argument names and defaults, the usual aliases, eager validation, Auto registration."""

import math
import re

import pytest
from transformers import AutoConfig, GPT2Config

from hf_alibi import AlibiGPT2Config

# GPT-2 arguments the ALiBi config keeps (position embeddings are gone, so nothing else differs)
SHARED_WITH_GPT2 = (
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "layer_norm_epsilon",
    "initializer_range",
    "scale_attn_weights",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)


def test_defaults_are_gpt2s():
    ours, gpt2 = AlibiGPT2Config(), GPT2Config()
    pairs = {name: (getattr(ours, name), getattr(gpt2, name)) for name in SHARED_WITH_GPT2}
    differing = {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}
    assert not differing, f"defaults differ from GPT-2 (ours, GPT-2): {differing}"
    assert ours.model_type == "alibi_gpt2"
    assert ours.alibi_max_bias == 8.0 and ours.alibi_slopes is None


def test_gpt2_keyword_arguments_carry_over():
    kwargs = dict(vocab_size=300, n_positions=64, n_embd=72, n_layer=3, n_head=6, n_inner=100)
    kwargs["activation_function"] = "relu"
    ours, gpt2 = AlibiGPT2Config(**kwargs), GPT2Config(**kwargs)
    assert {n: getattr(ours, n) for n in kwargs} == {n: getattr(gpt2, n) for n in kwargs}


def test_aliases_read_and_write_gpt2_names():
    config = AlibiGPT2Config(hidden_size=64, num_attention_heads=8, num_hidden_layers=3, max_position_embeddings=32)
    assert (config.n_embd, config.n_head, config.n_layer, config.n_positions) == (64, 8, 3, 32)
    assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (64, 8, 3)
    # no max_position_embeddings attribute: generate() would warn past it, and ALiBi has no maximum length
    assert not hasattr(config, "max_position_embeddings")


BAD_VALUES = [
    (dict(n_embd=50, n_head=12), ["50", "12"]),
    (dict(vocab_size=0), ["vocab_size", "0"]),
    (dict(n_positions=-4), ["n_positions", "-4"]),
    (dict(n_embd=0), ["n_embd", "0"]),
    (dict(n_layer=0), ["n_layer", "0"]),
    (dict(n_head=-2), ["n_head", "-2"]),
    (dict(n_inner=0), ["n_inner", "0"]),
    (dict(activation_function="swishy"), ["swishy"]),
    (dict(attn_pdrop=1.5), ["attn_pdrop", "1.5"]),
    (dict(alibi_max_bias=0.0), ["alibi_max_bias", "0.0"]),
    (dict(alibi_max_bias=-1.0), ["alibi_max_bias", "-1.0"]),
    (dict(alibi_max_bias=math.nan), ["alibi_max_bias", "nan"]),
    (dict(alibi_max_bias=math.inf), ["alibi_max_bias", "inf"]),
    (dict(n_head=4, alibi_slopes=[0.5, 0.25, 0.125]), ["3", "4"]),
    (dict(n_head=4, alibi_slopes=[0.5, 0.25, 0.125, 0.1, 0.05]), ["5", "4"]),
    (dict(n_head=4, alibi_slopes=[0.5, -0.25, 0.125, 0.1]), ["-0.25"]),
    (dict(n_head=4, alibi_slopes=[0.5, math.nan, 0.125, 0.1]), ["nan"]),
    (dict(n_head=4, alibi_slopes=[0.5, 0.25, math.inf, 0.1]), ["inf"]),
    (dict(alibi_sdpa_query_chunk=0), ["alibi_sdpa_query_chunk", "0"]),
    (dict(alibi_sdpa_query_chunk=16.0), ["alibi_sdpa_query_chunk", "16.0"]),
    (dict(alibi_sdpa_split="no"), ["alibi_sdpa_split", "'no'"]),
]


@pytest.mark.parametrize("kwargs, named", BAD_VALUES, ids=[repr(k) for k, _ in BAD_VALUES])
def test_bad_value_raises_value_error_naming_it(kwargs, named):
    with pytest.raises(ValueError) as error:
        AlibiGPT2Config(**{"n_embd": 48, "n_head": 4, **kwargs})
    missing = [word for word in named if not re.search(re.escape(word), str(error.value))]
    assert not missing, f"message {str(error.value)!r} does not name {missing}"


def test_all_zero_slopes_are_a_valid_config():
    config = AlibiGPT2Config(n_embd=48, n_head=4, alibi_slopes=[0, 0, 0, 0])
    assert config.alibi_slopes == [0.0, 0.0, 0.0, 0.0]


def test_auto_config_for_model_builds_the_alibi_config():
    config = AutoConfig.for_model("alibi_gpt2", n_layer=2, n_head=6, n_embd=48, alibi_max_bias=4.0)
    assert type(config) is AlibiGPT2Config
    assert (config.n_layer, config.n_head, config.n_embd, config.alibi_max_bias) == (2, 6, 48, 4.0)
    with pytest.raises(ValueError, match="50"):
        AutoConfig.for_model("alibi_gpt2", n_embd=50, n_head=6)


def test_to_dict_from_dict_round_trip():
    slopes = [0.5, 0.0, 0.2, 1.0]
    config = AlibiGPT2Config(vocab_size=200, n_embd=48, n_head=4, n_layer=3, n_positions=40, alibi_slopes=slopes)
    as_dict = config.to_dict()
    assert as_dict["model_type"] == "alibi_gpt2" and as_dict["alibi_slopes"] == slopes
    restored = AlibiGPT2Config.from_dict(dict(as_dict))  # a copy: transformers 5.0's from_dict adds keys to its input
    assert restored.to_dict() == as_dict
    assert AutoConfig.for_model(**as_dict).to_dict() == as_dict


def test_save_and_load_config_round_trip(tmp_path):
    config = AlibiGPT2Config(n_embd=48, n_head=6, n_layer=2, alibi_max_bias=6.0)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is AlibiGPT2Config
    ignored = {"_name_or_path"}
    assert {k: v for k, v in loaded.to_dict().items() if k not in ignored} == {
        k: v for k, v in config.to_dict().items() if k not in ignored
    }


@pytest.mark.parametrize("gated_mlp", [False, True])
def test_every_tensor_parallel_rule_names_a_module_of_the_model(gated_mlp):
    """`base_model_tp_plan` (what `tp_plan="auto"` applies): every rule matches a module, so transformers' "rules ...
    match nothing" warning never fires; the gate's rule is there exactly when the MLP has a gate."""
    from hf_alibi import AlibiGPT2Model

    model = AlibiGPT2Model(AlibiGPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, gated_mlp=gated_mlp))
    names = {re.sub(r"\.\d+(?=\.|$)", ".*", name) for name, _ in model.named_modules()}  # h.0.attn -> h.*.attn
    plan = model.config.base_model_tp_plan
    assert set(plan) <= names, f"rules that match nothing: {sorted(set(plan) - names)}"
    assert ("h.*.mlp.c_fc2" in plan) == gated_mlp
