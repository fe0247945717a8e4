"""Falcon-RW -> ALiBi GPT-2 is exact against transformers' Falcon on its SDPA path (its eager path adds ALiBi twice)."""

import math

import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM

from family_checks import BACKENDS, VOCAB, assert_same_logits, perturb
from hf_alibi import convert, get_alibi_slopes
from hf_alibi.conversion import convert_falcon

# 6 heads: not a power of two (interleaved slopes 2^-2 .. 2^-8, 2^-1, 2^-3) yet every slope a power of two, which
# transformers' Falcon, rounding its slopes and its `m * j` to bfloat16, represents exactly up to 256 tokens.
HEADS = (4, 6)
FALCON_RW = dict(alibi=True, bias=True, parallel_attn=False, multi_query=False, new_decoder_architecture=False)


def tiny_falcon(n_head: int, **overrides) -> FalconForCausalLM:
    settings = FALCON_RW | overrides
    config = FalconConfig(
        vocab_size=VOCAB, hidden_size=8 * n_head, num_hidden_layers=2, num_attention_heads=n_head, **settings
    )
    return perturb(FalconForCausalLM._from_config(config, attn_implementation="sdpa"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n_head", HEADS)
def test_imported_falcon_matches_transformers_falcon_sdpa_padded_and_cached(n_head, backend):
    falcon = tiny_falcon(n_head)
    assert falcon.config._attn_implementation == "sdpa"
    assert_same_logits(convert(falcon), falcon, backend)


def test_falcon_slopes_are_scaled_by_inverse_sqrt_head_dim():
    alibi = convert_falcon(tiny_falcon(6))
    expected = get_alibi_slopes(6).double() / math.sqrt(8)  # head_dim 8; 6-head slopes are exact in bf16
    torch.testing.assert_close(alibi.transformer.alibi_slopes.double(), expected, atol=0, rtol=1e-7)
    assert alibi.config.activation_function == "gelu"  # Falcon's default: the exact erf GELU


def test_falcon_without_linear_biases_imports_with_zero_biases():
    falcon = tiny_falcon(4, bias=False)
    alibi = convert_falcon(falcon)
    assert alibi.config.bias  # its LayerNorms keep their biases
    assert torch.count_nonzero(alibi.transformer.h[0].attn.c_attn.bias) == 0
    assert_same_logits(alibi, falcon, "sdpa")


@pytest.mark.parametrize(
    "field, overrides",
    [
        ("parallel_attn", {"parallel_attn": True}),
        ("multi_query", {"multi_query": True}),
        ("new_decoder_architecture", {"new_decoder_architecture": True, "num_kv_heads": 4}),
        ("alibi", {"alibi": False}),
    ],
)
def test_falcon_variants_that_are_not_alibi_gpt2_are_refused_by_name(field, overrides):
    with pytest.raises(ValueError, match=field):
        convert(tiny_falcon(4, **overrides))
