"""Which attention backend and SDPA path the model runs: `attn_implementation` at build, load and switch time, the
config's `alibi_sdpa_split`, and clear errors for backends it cannot run."""

import pytest
import torch

from hf_alibi import AlibiGPT2LMHeadModel, attention_route
from hf_alibi.models.alibi.transformers_compat import output_cache


def paths_used_by(model, ids, **inputs):
    """The route a forward on these inputs takes (`hf_alibi.attention_route`, held to the forward's own plans by
    tests/test_route_inspection.py)."""
    return {attention_route(model, ids, **inputs).name}


EXPECTED_PATH = {"eager": "eager", "sdpa": "sdpa_split", "flex_attention": "flex_attention"}


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_attn_implementation_selects_backend_in_from_config_and_from_pretrained(
    backend, make_config, random_ids, tmp_path
):
    from transformers import AutoModelForCausalLM

    expected = {EXPECTED_PATH[backend]}
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation=backend)
    assert model.config._attn_implementation == backend
    assert paths_used_by(model, random_ids(1, 9)) == expected
    model.save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation=backend)
    assert paths_used_by(loaded, random_ids(1, 9)) == expected


def test_set_attn_implementation_switches_backend(tiny_model, random_ids):
    ids = random_ids(1, 9)
    for backend in ("eager", "flex_attention", "sdpa", "eager"):
        tiny_model.set_attn_implementation(backend)
        assert paths_used_by(tiny_model, ids) == {EXPECTED_PATH[backend]}


def test_unsupported_attn_implementation_raises_clear_error(make_config, random_ids):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="not_a_backend"):
        AutoModelForCausalLM.from_config(make_config(), attn_implementation="not_a_backend")
    # transformers accepts its paged names; the model must refuse them by name rather than compute garbage
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="paged|eager")
    with pytest.raises(ValueError, match=r"paged\|eager"):
        model(random_ids(1, 5))


def test_flash_attention_2_without_flash_attn_or_cuda_raises_clear_error(make_config, random_ids):
    from transformers import AutoModelForCausalLM

    # flash-attn missing: transformers refuses at build time; installed but CPU tensors: the model refuses
    with pytest.raises((ImportError, ValueError), match="(?i)flash"):
        model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="flash_attention_2")
        model(random_ids(1, 5))


@pytest.mark.parametrize("split", [True, False])
def test_config_alibi_sdpa_split_selects_the_sdpa_path(split, make_model, random_ids):
    model = make_model("sdpa", alibi_sdpa_split=split, alibi_sdpa_query_chunk=16)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :17] = 0  # left padding
    assert paths_used_by(model, random_ids(2, 40), attention_mask=mask) == {"sdpa_split" if split else "sdpa_bank"}


def test_sdpa_takes_the_bank_for_decoding_and_dropout_and_each_document_alone_for_packed_rows(make_model, random_ids):
    model = make_model("sdpa")
    ids = random_ids(1, 12)
    with torch.no_grad():
        cache = output_cache(model(ids[:, :11], use_cache=True))
    assert paths_used_by(model, ids[:, 11:], cache=cache) == {"sdpa_bank"}  # one row: a per-key bias
    packed = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    assert paths_used_by(model, ids, position_ids=packed) == {"sdpa_packed"}  # its keys only: no whole-row mask
    model.config.attn_pdrop = 0.5
    model.train()
    assert paths_used_by(model, ids) == {"sdpa_bank"}  # the CPU flash kernel has no dropout
    model.eval()
    assert paths_used_by(model, ids) == {"sdpa_split"}
