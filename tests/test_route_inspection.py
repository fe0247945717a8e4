"""`hf_alibi.attention_route`: the route a forward takes, and why, answered without running the layers; checked
against the plan every attention layer of a real forward reads, for padding, packed rows, cache decoding, long inputs
(the split, certified skipping), each backend and the encoder."""

import contextlib

import pytest
import torch
from transformers import DynamicCache

import hf_alibi
from conftest import recorded_plans
from hf_alibi.models.alibi.attention_routes import ROUTES
from hf_alibi.models.alibi.cpu_flash_kernels import split_kernels_work
from hf_alibi.models.alibi.modeling_alibi_bert import AlibiBertSelfAttention


@contextlib.contextmanager
def encoder_plans(model):
    plans = []
    hooks = [
        module.register_forward_pre_hook(lambda module, args: plans.append(args[1]))  # forward(hidden, plan, ...)
        for module in model.modules()
        if isinstance(module, AlibiBertSelfAttention)
    ]
    try:
        yield plans
    finally:
        for hook in hooks:
            hook.remove()


def assert_route_is_the_forwards(model, record=recorded_plans, **inputs):
    """`attention_route` answers before the forward; every layer of the forward then reads a plan on that route."""
    report = hf_alibi.attention_route(model, **inputs)
    with record(model) as plans, torch.no_grad():
        model(**inputs)
    assert plans and {plan.path for plan in plans} == {report.name}, (report, {plan.path for plan in plans})
    assert report.reason == plans[0].route.reason and report.description == ROUTES[report.name].when
    return report


def padded_mask():
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    return mask


PACKED = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]).expand(2, -1)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_the_route_is_the_one_the_forward_takes(make_model, random_ids, backend):
    model = make_model(backend)
    ids = random_ids(2, 12)
    plain = assert_route_is_the_forwards(model, input_ids=ids)
    padded = assert_route_is_the_forwards(model, input_ids=ids, attention_mask=padded_mask())
    packed = assert_route_is_the_forwards(model, input_ids=ids, position_ids=PACKED)
    assert not plain.padded and padded.padded and packed.packed and plain.query_length == 12
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    step = assert_route_is_the_forwards(model, input_ids=random_ids(2, 1), past_key_values=cache, use_cache=True)
    assert step.cached_tokens == 13 - 1 and step.key_length == 13 and step.query_length == 1
    weights = assert_route_is_the_forwards(model, input_ids=ids, output_attentions=True)
    assert weights.name == "eager" and "output_attentions" in weights.reason


def test_sdpa_routes_named_by_the_report(make_model, random_ids):
    model = make_model("sdpa")
    ids = random_ids(2, 12)
    split = "sdpa_split" if split_kernels_work() else "sdpa_bank"
    assert hf_alibi.attention_route(model, ids).name == split
    packed = hf_alibi.attention_route(model, ids, position_ids=PACKED)
    if split_kernels_work():
        assert packed.name == "sdpa_packed" and packed.document_routes == {
            5: "sdpa_split",
            3: "sdpa_split",
            4: "sdpa_split",
        }
    bank = hf_alibi.attention_route(make_model("sdpa", alibi_sdpa_split=False), ids)
    assert bank.name == "sdpa_bank" and "alibi_sdpa_split=False" in bank.reason


@pytest.mark.skipif(not split_kernels_work(), reason="the CPU flash kernels are unavailable")
@pytest.mark.parametrize("eps", [1e-5, "auto"])
def test_long_inputs_take_the_certified_routes_the_report_names(make_model, random_ids, eps):
    model = make_model("sdpa", n_positions=64, n_layer=1, alibi_skip_eps=eps)
    ids = random_ids(1, 1100)
    prefill = assert_route_is_the_forwards(model, input_ids=ids)
    packed = assert_route_is_the_forwards(
        model, input_ids=ids, position_ids=torch.cat([torch.arange(600), torch.arange(500)])[None]
    )
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    step = assert_route_is_the_forwards(model, input_ids=random_ids(1, 1), past_key_values=cache, use_cache=True)
    if eps == "auto":  # the tiny model's slopes at 1100 tokens: the measured rule says skipping does not pay
        assert (prefill.name, step.name, prefill.skip_eps) == ("sdpa_split", "sdpa_bank", 0.0)
    else:
        assert (prefill.name, step.name, prefill.skip_eps) == ("sdpa_split_certified", "sdpa_decode_certified", eps)
        assert set(packed.document_routes.values()) == {"sdpa_split_certified"}
    flex = make_model("flex_attention", n_positions=64, n_layer=1, alibi_skip_eps=1e-5)
    assert assert_route_is_the_forwards(flex, input_ids=random_ids(1, 300)).name == "flex_attention_certified"


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex_attention"])
def test_the_encoders_route_is_the_one_its_forward_takes(make_encoder, backend):
    model = make_encoder(attn_implementation=backend)
    ids = torch.randint(3, 100, (2, 20))
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, 15:] = 0
    plain = assert_route_is_the_forwards(model, encoder_plans, input_ids=ids)
    assert not plain.causal
    assert assert_route_is_the_forwards(model, encoder_plans, input_ids=ids, attention_mask=mask).padded
    packed = torch.tensor([list(range(8)) + list(range(12))]).expand(2, -1)
    assert assert_route_is_the_forwards(model, encoder_plans, input_ids=ids, position_ids=packed).packed


def test_a_model_without_alibi_attention_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(TypeError, match="not an ALiBi model"):
        hf_alibi.attention_route(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2)), torch.tensor([[1, 2]]))
