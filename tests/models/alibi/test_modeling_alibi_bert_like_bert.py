"""The encoder behaves as transformers' `BertModel` where it should, side by side: output types and `return_dict=False`
tuples, recorded hidden states and attentions, the `token_type_ids` default, `inputs_embeds`, the attention mask
(an all-ones mask is no mask), the pooler switch, and gradient checkpointing (same gradients)."""

import pytest
import torch
from transformers import BertConfig, BertModel

from conftest import tiny_encoder_kwargs
from hf_alibi import AlibiBertModel


@pytest.fixture
def pair(make_encoder):
    """(ours, BERT's) of the same width, depth and heads, both eager (BERT's weights come from a normal init)."""
    ours = make_encoder(attn_implementation="eager")
    config = BertConfig(**tiny_encoder_kwargs())  # every key of the tiny encoder's config is one of BERT's too
    bert = BertModel._from_config(config, attn_implementation="eager").eval()
    return ours, bert


def call_both(pair, *args, **kwargs):
    with torch.no_grad():
        return [model(*args, **kwargs) for model in pair]


def test_outputs_carry_the_fields_bert_fills_with_the_same_shapes(pair):
    ids = torch.randint(1, 100, (2, 11))
    ours, bert = call_both(pair, ids, output_hidden_states=True, output_attentions=True)
    for field in ("last_hidden_state", "pooler_output"):
        assert ours[field].shape == bert[field].shape, field
    for field in ("hidden_states", "attentions"):
        assert [t.shape for t in ours[field]] == [t.shape for t in bert[field]], field


def test_return_dict_false_gives_bert_s_tuple(pair):
    ids = torch.randint(1, 100, (2, 11))
    ours, bert = call_both(pair, ids, return_dict=False, output_hidden_states=True)
    assert isinstance(ours, tuple) and isinstance(bert, tuple)
    assert len(ours) == len(bert) == 3  # last_hidden_state, pooler_output, hidden_states
    assert ours[0].shape == bert[0].shape and ours[1].shape == bert[1].shape and len(ours[2]) == len(bert[2])


def test_token_type_ids_default_to_zeros_as_in_bert(pair):
    ids = torch.randint(1, 100, (2, 11))
    zeros = torch.zeros_like(ids)
    for model in pair:
        with torch.no_grad():
            torch.testing.assert_close(model(ids).last_hidden_state, model(ids, token_type_ids=zeros).last_hidden_state)


def test_inputs_embeds_stand_for_input_ids_as_in_bert(pair):
    ids = torch.randint(1, 100, (2, 11))
    for model in pair:
        embeds = model.get_input_embeddings()(ids)
        with torch.no_grad():
            torch.testing.assert_close(model(inputs_embeds=embeds).last_hidden_state, model(ids).last_hidden_state)
        with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
            model(ids, inputs_embeds=embeds)


def test_an_all_ones_mask_is_no_mask_and_padded_keys_do_not_reach_real_rows_as_in_bert(pair):
    ids = torch.randint(1, 100, (2, 11))
    mask = torch.ones_like(ids)
    changed = ids.clone()
    changed[1, 7:] = 1 + ids[1, 7:] % 98  # other tokens behind the padding
    mask_padded = mask.clone()
    mask_padded[1, 7:] = 0
    for model in pair:
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, model(ids).last_hidden_state)
            a = model(ids, attention_mask=mask_padded).last_hidden_state[1, :7]
            b = model(changed, attention_mask=mask_padded).last_hidden_state[1, :7]
        torch.testing.assert_close(a, b)


def test_no_pooling_layer_gives_no_pooler_output_as_in_bert(make_encoder):
    model = AlibiBertModel(make_encoder().config, add_pooling_layer=False).eval()
    bert = BertModel(BertConfig(hidden_size=48, num_attention_heads=6, num_hidden_layers=1), add_pooling_layer=False)
    ids = torch.randint(1, 100, (1, 5))
    assert model(ids).pooler_output is None and bert(ids).pooler_output is None
    assert not any(name.startswith("pooler") for name in model.state_dict())


def test_gradient_checkpointing_gives_the_same_gradients(make_encoder):
    grads = {}
    ids = torch.randint(1, 100, (2, 30))
    for checkpointing in (False, True):
        model = make_encoder().train()
        if checkpointing:
            # transformers 5.23 renamed gradient_checkpointing_enable (the old name warns from then on)
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        calls = []
        model.encoder.layer[0].attention.self.register_forward_hook(lambda *args, calls=calls: calls.append(1))
        model(ids).last_hidden_state.square().sum().backward()
        assert len(calls) == (2 if checkpointing else 1)  # a checkpointed layer runs again in the backward
        grads[checkpointing] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, msg=name)
