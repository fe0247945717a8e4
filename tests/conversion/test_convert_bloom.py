"""BLOOM -> ALiBi GPT-2 is exact (logits of transformers' BloomForCausalLM) and BLOOM -> ours -> BLOOM is lossless."""

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, BloomForCausalLM

from family_checks import BACKENDS, VOCAB, assert_same_logits, assert_same_weights, perturb
from hf_alibi import convert, export, get_alibi_slopes
from hf_alibi.conversion import convert_bloom, export_bloom

HEADS = (4, 12)  # a power of two, and the paper's interleaved slopes (2^-0.5, ... after the first 8)


def tiny_bloom(n_head: int, **overrides) -> BloomForCausalLM:
    config = BloomConfig(vocab_size=VOCAB, hidden_size=8 * n_head, n_layer=2, n_head=n_head, **overrides)
    return perturb(BloomForCausalLM(config))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_head", HEADS)
def test_imported_bloom_matches_transformers_bloom_padded_and_cached(n_head, backend):
    bloom = tiny_bloom(n_head)
    assert_same_logits(convert(bloom), bloom, backend)


def test_bloom_import_copies_slopes_and_sets_the_embedding_norm():
    alibi = convert_bloom(tiny_bloom(12))
    assert alibi.config.embedding_layernorm and alibi.config.bias and alibi.config.activation_function == "gelu_new"
    torch.testing.assert_close(alibi.transformer.alibi_slopes, get_alibi_slopes(12), atol=0, rtol=1e-7)
    assert alibi.lm_head.weight.data_ptr() == alibi.transformer.wte.weight.data_ptr()  # still tied


@pytest.mark.parametrize("n_head", HEADS)
def test_bloom_to_alibi_to_bloom_gives_back_the_original_weights(n_head):
    bloom = tiny_bloom(n_head)
    assert_same_weights(bloom, export_bloom(convert_bloom(bloom)))


def test_bloom_import_keeps_bf16_weights_bit_for_bit():
    bloom = tiny_bloom(4).to(torch.bfloat16)
    alibi = convert_bloom(bloom)
    assert alibi.dtype == torch.bfloat16 and alibi.transformer.alibi_slopes.dtype == torch.float32
    assert_same_weights(bloom, export_bloom(alibi))


def test_bloom_with_post_layernorm_residual_is_refused():
    with pytest.raises(ValueError, match="apply_residual_connection_post_layernorm"):
        convert(tiny_bloom(4, apply_residual_connection_post_layernorm=True))


def test_export_to_bloom_refuses_models_bloom_cannot_hold(make_model):
    with pytest.raises(ValueError, match="embedding_layernorm"):
        export_bloom(make_model())
    with pytest.raises(ValueError, match="bias"):
        export_bloom(make_model(embedding_layernorm=True, bias=False))
    with pytest.raises(ValueError, match="clip_qkv"):
        export_bloom(make_model(embedding_layernorm=True, clip_qkv=3.0))
    with pytest.raises(ValueError, match="activation_function"):
        export_bloom(make_model(embedding_layernorm=True, activation_function="gelu"))
    with pytest.raises(ValueError, match="alibi_slopes"):
        export_bloom(make_model(embedding_layernorm=True, alibi_max_bias=4.0))


def test_export_folder_loads_as_transformers_bloom_with_the_original_weights(tmp_path):
    bloom = tiny_bloom(4)
    alibi = convert_bloom(bloom)
    folder = export(alibi, "bloom", tmp_path / "bloom")
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(loaded) is BloomForCausalLM
    assert_same_weights(bloom, loaded)


def test_a_refused_export_writes_nothing(make_model, tmp_path):
    with pytest.raises(ValueError, match="embedding_layernorm"):
        export(make_model(), "bloom", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
