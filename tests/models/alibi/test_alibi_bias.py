"""ALiBi slopes against the paper, HF BLOOM and MPT; the slopes buffer stays fixed through training and loading."""

import math
import re

import pytest
import torch
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from hf_alibi import AlibiGPT2LMHeadModel, get_alibi_slopes

PAPER_12_HEADS = [2.0**-h for h in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]


def bloom_slopes(num_heads: int) -> torch.Tensor:
    # build_alibi_tensor gives slope * position for each head; position 1 of an all-ones mask is the slope itself
    return build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)[:, 0, 1]  # (H,)


def mpt_slopes(num_heads: int, max_bias: float) -> torch.Tensor:
    # MPT's bias is slope * (j - i) over the last row; at distance 1 it is -slope
    return -build_mpt_alibi_tensor(num_heads, 2, alibi_bias_max=max_bias)[:, 0, 0]  # (H,)


def assert_relative_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    relative = ((actual.double() - expected.double()).abs() / expected.double().abs().clamp_min(1e-30)).max().item()
    assert relative <= rtol, f"{what}: largest relative difference {relative:.3g} > {rtol}\n{actual}\n{expected}"


def test_slopes_for_12_heads_are_the_papers_values():
    slopes = get_alibi_slopes(12)
    assert slopes.dtype == torch.float32 and slopes.shape == (12,)
    assert_relative_close(slopes, torch.tensor(PAPER_12_HEADS), 1e-7, "12-head slopes vs the paper")


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16, 32, 64, 128])
def test_power_of_two_slopes_follow_the_geometric_rule(num_heads):
    expected = torch.tensor([2.0 ** (-8 * h / num_heads) for h in range(1, num_heads + 1)])
    assert_relative_close(get_alibi_slopes(num_heads), expected, 1e-7, f"{num_heads} heads")


def test_slopes_match_hf_bloom_for_every_head_count_up_to_128():
    for num_heads in range(1, 129):
        slopes = get_alibi_slopes(num_heads)
        assert slopes.dtype == torch.float32 and slopes.shape == (num_heads,)
        # BLOOM raises to powers in fp32, so it differs in the last bit or so
        assert_relative_close(slopes, bloom_slopes(num_heads), 1e-6, f"{num_heads} heads vs BLOOM")


@pytest.mark.parametrize("max_bias", [1.0, 4.0, 8.0, 12.5, 16.0])
def test_max_bias_scales_the_exponents_as_mpt_does(max_bias):
    for num_heads in (1, 3, 6, 8, 12, 20, 32, 40):
        slopes = get_alibi_slopes(num_heads, max_bias)
        assert_relative_close(slopes, mpt_slopes(num_heads, max_bias), 1e-6, f"{num_heads} heads vs MPT")
        # every slope is 2 ** (-8 * e): max_bias multiplies each exponent e by max_bias / 8
        scaled = get_alibi_slopes(num_heads).double() ** (max_bias / 8)
        assert_relative_close(slopes, scaled, 1e-6, f"{num_heads} heads, exponents * {max_bias}/8")


@pytest.mark.parametrize("num_heads", [0, -1, 2.0, True, None, "12"])
def test_bad_head_count_raises_value_error(num_heads):
    with pytest.raises(ValueError, match=re.escape(repr(num_heads))):
        get_alibi_slopes(num_heads)


@pytest.mark.parametrize("max_bias", [0.0, -8.0, math.nan, math.inf])
def test_bad_max_bias_raises_value_error(max_bias):
    with pytest.raises(ValueError, match="max_bias"):
        get_alibi_slopes(12, max_bias)


def test_config_slopes_and_max_bias_reach_the_model_buffer(make_model):
    custom = [0.9, 0.0, 0.3, 2.0, 0.01, 0.5, 0.25, 0.125, 1e-4, 0.7, 0.6, 0.05]
    model = make_model(alibi_slopes=custom)
    assert torch.equal(model.transformer.alibi_slopes, torch.tensor(custom))
    model = make_model(alibi_max_bias=4.0)
    assert torch.equal(model.transformer.alibi_slopes, get_alibi_slopes(12, 4.0))
    model = make_model()
    assert torch.equal(model.transformer.alibi_slopes, get_alibi_slopes(12))


def test_all_zero_slopes_are_accepted_and_run(make_model, random_ids):
    model = make_model(alibi_slopes=[0.0] * 12)
    assert torch.equal(model.transformer.alibi_slopes, torch.zeros(12))
    logits = model(random_ids(2, 20)).logits
    assert torch.isfinite(logits).all()


def test_slopes_are_a_non_persistent_buffer_not_a_parameter(tiny_model):
    slopes = tiny_model.transformer.alibi_slopes
    assert all(p is not slopes for p in tiny_model.parameters())
    assert "transformer.alibi_slopes" in dict(tiny_model.named_buffers())
    assert not any("alibi_slopes" in key for key in tiny_model.state_dict())
    assert not slopes.requires_grad


def test_slopes_unchanged_by_an_optimizer_step_with_a_huge_learning_rate(tiny_model, random_ids):
    tiny_model.train()
    before = tiny_model.transformer.alibi_slopes.clone()
    weights_before = tiny_model.transformer.h[0].attn.c_attn.weight.detach().clone()
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e3)
    ids = random_ids(2, 12)
    tiny_model(ids, labels=ids).loss.backward()
    optimizer.step()
    assert not torch.equal(tiny_model.transformer.h[0].attn.c_attn.weight, weights_before)  # the step happened
    assert torch.equal(tiny_model.transformer.alibi_slopes, before)


@pytest.mark.parametrize("overrides", [{}, {"alibi_max_bias": 5.0}, {"alibi_slopes": [0.3] * 6 + [0.0, 1.5] * 3}])
def test_slopes_are_correct_after_save_and_from_pretrained(make_model, tmp_path, overrides):
    model = make_model(**overrides)
    expected = model.transformer.alibi_slopes.clone()
    model.save_pretrained(tmp_path)
    # from_pretrained builds on the meta device: the non-persistent buffer must be refilled, not left as garbage
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.transformer.alibi_slopes.device.type == "cpu"
    assert torch.equal(loaded.transformer.alibi_slopes, expected), (loaded.transformer.alibi_slopes, expected)


def test_slopes_stay_exact_fp32_after_casting_the_model_to_bfloat16(tiny_model):
    tiny_model.to(torch.bfloat16)
    slopes = tiny_model.transformer.alibi_slopes
    difference = (slopes.float() - get_alibi_slopes(12)).abs().max().item()
    assert slopes.dtype == torch.float32 and difference == 0, f"{slopes.dtype}, largest difference {difference:.3g}"
