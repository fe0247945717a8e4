"""Arguments as transformers' models take them: deprecated names warn, GPT-2's token_type_ids work, no length cap
warning, and bad shapes fail early with a ValueError that names them."""

import logging
import warnings

import pytest
import torch

from conftest import PAD
from hf_alibi.models.alibi.transformers_compat import CACHE_FIELD, output_cache


def test_past_key_values_works_and_warns_only_where_transformers_renamed_it_cache(tiny_model, random_ids):
    """transformers 5.24 renamed the argument `cache` (its models warn on `past_key_values`); before 5.24
    `past_key_values` is the name generate() passes, taken silently."""
    ids = random_ids(2, 18)
    with torch.no_grad():
        full = tiny_model(ids).logits
        prefix = tiny_model(ids[:, :11], use_cache=True)
        if CACHE_FIELD == "cache":
            with pytest.warns(FutureWarning, match="`past_key_values` is deprecated.*Use `cache` instead"):
                rest = tiny_model(ids[:, 11:], past_key_values=output_cache(prefix))
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                rest = tiny_model(ids[:, 11:], past_key_values=output_cache(prefix))
    assert output_cache(rest).get_seq_length() == 18
    torch.testing.assert_close(rest.logits, full[:, 11:], atol=1e-5, rtol=0)


def test_cache_wins_over_past_key_values_and_the_warning_says_so(tiny_model, random_ids):
    ids = random_ids(1, 12)
    with torch.no_grad():
        full = tiny_model(ids).logits
        right = output_cache(tiny_model(ids[:, :8], use_cache=True))
        wrong = output_cache(tiny_model(random_ids(1, 3), use_cache=True))
        with pytest.warns(Warning, match="Both `past_key_values` and `cache` are set.*[Uu]sing `cache"):
            rest = tiny_model(ids[:, 8:], cache=right, past_key_values=wrong)
    torch.testing.assert_close(rest.logits, full[:, 8:], atol=1e-5, rtol=0)


def test_token_type_ids_add_their_wte_embedding_as_in_gpt2(tiny_model, random_ids):
    ids, segments = random_ids(2, 10), torch.randint(0, 2, (2, 10))
    with torch.no_grad():
        logits = tiny_model(ids, token_type_ids=segments).logits
        wte = tiny_model.transformer.wte
        expected = tiny_model(inputs_embeds=wte(ids) + wte(segments)).logits  # GPT2Model's rule
        plain = tiny_model(ids).logits
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)
    assert (logits - plain).abs().max() > 1e-3, "token_type_ids were ignored"


def test_generation_past_n_positions_warns_about_no_maximum_length(tiny_model, random_ids, caplog):
    with torch.no_grad(), caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_model.generate(random_ids(1, 10), max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    messages = [r.getMessage() for r in caplog.records] + [str(w.message) for w in caught]
    assert not [m for m in messages if "maximum length" in m], messages
    assert not hasattr(tiny_model.config, "max_position_embeddings")


BAD_INPUTS = {
    "mask_batch_differs": (dict(input_ids=(2, 7), attention_mask=(3, 7)), ["(3, 7)", "batch 2"]),
    "mask_length_differs": (dict(input_ids=(2, 7), attention_mask=(2, 9)), ["(2, 9)", "7"]),
    "empty_sequence": (dict(input_ids=(2, 0)), ["no tokens", "(2, 0)"]),
    "one_dimensional_ids": (dict(input_ids=(7,)), ["2-D", "(7,)"]),
    "token_types_differ": (dict(input_ids=(2, 7), token_type_ids=(2, 5)), ["(2, 5)", "(2, 7)"]),
    "three_dimensional_mask": (dict(input_ids=(2, 7), attention_mask=(2, 1, 7)), ["2-D", "(2, 1, 7)"]),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_shapes_raise_a_value_error_naming_them(case, tiny_model):
    shapes, fragments = BAD_INPUTS[case]
    inputs = {name: torch.ones(shape, dtype=torch.long) * 3 for name, shape in shapes.items()}
    with pytest.raises(ValueError) as error:
        tiny_model(**inputs)
    for fragment in fragments:
        assert fragment in str(error.value), f"{fragment!r} not in {error.value}"


def test_an_all_ones_mask_with_the_wrong_batch_is_not_accepted_silently(tiny_model, random_ids):
    with pytest.raises(ValueError, match="batch"):
        tiny_model(random_ids(2, 5), attention_mask=torch.ones(1, 5, dtype=torch.long))
