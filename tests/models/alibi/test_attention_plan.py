"""The attention plan: one place chooses the path and its variant, the plan is only read, and what it expresses (a
subset of heads) holds on every path against the float64 reference."""

import dataclasses

import pytest
import torch

from alibi_reference import reference_attention
from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_plan import choose_path, plan_facts
from hf_alibi.models.alibi.attention_routes import PATHS
from hf_alibi.models.alibi.attention_routes import ROUTES as REGISTRY

HEADS, DIM = 12, 8
SCALE = DIM**-0.5
SLOPES = get_alibi_slopes(HEADS)
# attn_implementation and plan options that reach each path from an uncached call (sdpa_mask: a static cache's step)
ROUTES = {
    "eager": ("eager", {}),
    "sdpa_split": ("sdpa", {}),
    "sdpa_bank": ("sdpa", dict(sdpa_split=False, query_chunk=8)),
    "flex_attention": ("flex_attention", {}),
}


def facts(query_length=20, key_length=20, offset=None, documents=None, dropout=0.0):
    offset = key_length - query_length if offset is None else offset
    plan = plan_facts(SLOPES, 1, query_length, key_length, offset, dropout=dropout)
    return dataclasses.replace(plan, documents=documents)


@pytest.mark.parametrize(
    "implementation, plan, options, expected",
    [
        ("sdpa", facts(), {}, "sdpa_split"),
        ("sdpa", facts(), dict(sdpa_split=False), "sdpa_bank"),
        ("sdpa", facts(query_length=1), {}, "sdpa_bank"),  # decoding: one row, a per-key bias
        ("sdpa", facts(documents=torch.zeros(1, 20, dtype=torch.long)), {}, "sdpa_packed"),  # packed rows
        ("sdpa", facts(dropout=0.1), {}, "sdpa_bank"),  # the CPU flash kernel has no dropout
        ("sdpa", facts(), dict(device="cuda"), "sdpa_bank"),
        ("sdpa", facts(), dict(tracing=True), "sdpa_bank"),  # compiled and exported graphs: public ops only
        ("sdpa", facts(), dict(kernels_work=lambda: False), "sdpa_bank"),  # the private kernels failed their probe
        ("sdpa", facts(query_length=1, key_length=30, offset=torch.tensor(5)), {}, "sdpa_mask"),  # static, compiled
        ("eager", facts(), {}, "eager"),
        ("eager", facts(), dict(skip_eps=1e-7), "eager"),  # the reference never skips
        ("flex_attention", facts(), {}, "flex_attention"),
        ("flex_attention", facts(), dict(device="cuda"), "flex_attention+compiled"),  # an eager model on a GPU
        ("flex_attention", facts(), dict(device="cuda", tracing=True), "flex_attention"),  # compiled with the model
        ("flash_attention_2", facts(), {}, "flash_attention_2"),
        ("flash_attention_2", facts(documents=torch.zeros(1, 20, dtype=torch.long)), {}, "flash_attention_2_varlen"),
        # certified skipping: outside tracing, on the split (training too), FlexAttention and decoding rows
        ("sdpa", facts(), dict(skip_eps=1e-7), "sdpa_split_certified"),
        ("sdpa", facts(), dict(skip_eps=1e-7, tracing=True), "sdpa_bank"),
        ("sdpa", facts(), dict(skip_eps=1e-7, sdpa_split=False), "sdpa_bank"),
        ("sdpa", facts(query_length=1), dict(skip_eps=1e-7), "sdpa_decode_certified+segmented"),
        ("sdpa", facts(query_length=1, dropout=0.1), dict(skip_eps=1e-7), "sdpa_decode_certified"),
        ("sdpa", facts(query_length=1), dict(skip_eps=1e-7, device="cuda"), "sdpa_decode_certified"),
        ("sdpa", facts(query_length=1), dict(skip_eps=1e-7, kernels_work=lambda: False), "sdpa_decode_certified"),
        (
            "sdpa",
            facts(query_length=1, key_length=30, offset=torch.tensor(5)),
            dict(skip_eps=1e-7, tracing=True),
            "sdpa_mask",
        ),
        ("flex_attention", facts(), dict(skip_eps=1e-7), "flex_attention_certified"),
        ("flex_attention", facts(), dict(skip_eps=1e-7, device="cuda"), "flex_attention_certified+compiled"),
        ("flex_attention", facts(), dict(skip_eps=1e-7, device="cuda", tracing=True), "flex_attention"),
        # continuous batching's flattened row
        ("sdpa", facts(), dict(paged=True), "paged"),
        ("flash_attention_2", facts(), dict(paged=True), "paged_flash_attention_2"),
        ("flash_attention_2", facts(), dict(paged=True, block_table=True), "paged_flash_attention_2+kvcache"),
    ],
)
def test_one_function_chooses_every_path_and_its_variant(implementation, plan, options, expected):
    """`expected` is the path, then `+variant` for each of the route's variant flags that is set."""
    arguments = dict(device="cpu", tracing=False, sdpa_split=True, kernels_work=lambda: True) | options
    route = choose_path(implementation, plan, **arguments)
    variants = [name for name in ("segmented", "compiled", "kvcache") if getattr(route, name)]
    assert "+".join([route.path, *variants]) == expected


def test_the_route_holds_every_decision_path_eps_and_host_offset():
    """`choose_path` alone decides what changes the route: weights asked for, `"auto"` per shape (a packed row's
    documents, a static cache's step), and whether a static cache's 0-d count is read to the host."""
    from hf_alibi.models.alibi.attention_certified import skipping_pays
    from hf_alibi.models.alibi.attention_plan import AUTO_EPS, Route

    cpu = dict(device="cpu", tracing=False, kernels_work=lambda: True, skip_pays=skipping_pays)
    slopes = get_alibi_slopes(4)  # the demo's: "auto" skips a 12k prefill (from ~11.3k) and a ~15.3k-key decoding row

    def demo(query_length, key_length, offset=None, documents=None):
        plan = plan_facts(slopes, 1, query_length, key_length, offset)
        return dataclasses.replace(plan, documents=documents)

    assert choose_path("sdpa", facts(), output_attentions=True, **cpu) == Route("eager")
    assert choose_path("sdpa", demo(12288, 12288), skip_eps="auto", **cpu) == Route("sdpa_split_certified", AUTO_EPS)
    assert choose_path("sdpa", demo(2048, 2048), skip_eps="auto", **cpu) == Route("sdpa_split")
    assert choose_path("sdpa", demo(1, 16384), skip_eps="auto", **cpu) == Route(
        "sdpa_decode_certified", AUTO_EPS, segmented=True
    )
    assert choose_path("eager", demo(1, 16384), skip_eps=1e-7, **cpu) == Route("eager")  # eps only where it skips
    # a static cache's decoding step: 16383 cached tokens in a 20000-slot buffer, the count a 0-d tensor
    static = demo(1, 20000, torch.tensor(16383))
    assert choose_path("sdpa", static, skip_eps="auto", **cpu) == Route(
        "sdpa_decode_certified", AUTO_EPS, host_offset=True, segmented=True
    )
    assert choose_path("sdpa", demo(1, 20000, torch.tensor(99)), skip_eps="auto", **cpu) == Route("sdpa_mask")
    assert choose_path("flash_attention_2", static, **cpu) == Route("flash_attention_2", host_offset=True)
    # packed rows: by each document's length
    two = torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([12288, 100]))[None]  # (1, 12388)
    small = torch.repeat_interleave(torch.tensor([0, 1]), torch.tensor([2048, 2148]))[None]
    assert choose_path("sdpa", demo(12388, 12388, documents=two), skip_eps="auto", **cpu) == Route(
        "sdpa_packed", AUTO_EPS
    )
    assert choose_path("sdpa", demo(4196, 4196, documents=small), skip_eps="auto", **cpu) == Route("sdpa_packed")


def test_every_route_is_declared_once_with_its_name_description_and_call():
    assert tuple(REGISTRY) == PATHS
    for name, route in REGISTRY.items():
        assert route.name == name and route.when and callable(route.call)
        assert route.prepare is None or callable(route.prepare)
    assert {name for name, route in REGISTRY.items() if route.composite} == {"paged", "sdpa_packed"}


def test_the_chosen_route_says_why():
    facts = plan_facts(SLOPES, 1, 9, 9)
    cpu = dict(device="cpu", tracing=False, kernels_work=lambda: True)
    assert "split" in choose_path("sdpa", facts, **cpu).reason
    assert "alibi_sdpa_split=False" in choose_path("sdpa", facts, sdpa_split=False, **cpu).reason
    assert "output_attentions" in choose_path("sdpa", facts, output_attentions=True, **cpu).reason
    assert "probe" in choose_path("sdpa", facts, device="cpu", tracing=False).reason  # no probe: not applicable
    assert plan_alibi_attention("eager", SLOPES, 1, 9, 9).route.reason == choose_path("eager", facts, **cpu).reason


def test_planner_options_group_and_keywords_agree():
    from hf_alibi.models.alibi.attention_plan import PlanOptions

    grouped = plan_alibi_attention("sdpa", SLOPES, 1, 9, 9, options=PlanOptions(sdpa_split=False))
    assert grouped.path == plan_alibi_attention("sdpa", SLOPES, 1, 9, 9, sdpa_split=False).path == "sdpa_bank"
    with pytest.raises(TypeError):
        plan_alibi_attention("sdpa", SLOPES, 1, 9, 9, no_such_option=1)


def test_no_function_outside_choose_path_reads_the_backend_or_the_skip_eps():
    """Every choice of path is made in `choose_path`: the functions of the table and the prepares read the plan."""
    import inspect

    for function in {route.call for route in REGISTRY.values()} | {r.prepare for r in REGISTRY.values() if r.prepare}:
        source = inspect.getsource(function)
        for name in ("skip_eps >", "is_grad_enabled", "is_compiling", "split_kernels_work()", "device.type =="):
            assert name not in source, f"{function.__name__} chooses by {name!r}"


def test_every_layer_reads_the_same_plan_and_none_changes_it(make_model, random_ids, record_plans):
    model = make_model("sdpa", alibi_sdpa_split=False, alibi_sdpa_query_chunk=4)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    with record_plans(model) as plans, torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(random_ids(2, 10), attention_mask=mask)
    assert len(plans) == model.config.n_layer and all(plan is plans[0] for plan in plans)
    plan = plans[0]
    assert (
        plan.payload.bias.dtype == torch.float32 and plan.payload.cast.dtype == torch.bfloat16
    )  # autocast's, cast once
    bank = plan.payload.bias.clone()
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            query, key, value = (torch.randn(2, model.config.n_head, 10, 8, dtype=dtype) for _ in range(3))
            alibi_attention(query, key, value, plan, SCALE)
    assert torch.equal(plan.payload.bias, bank), "a call changed the plan's fp32 bias"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.payload = None


def qkv(batch, q_len, kv_len):
    return (torch.randn(batch, HEADS, n, DIM) for n in (q_len, kv_len, kv_len))


@pytest.mark.parametrize("path", [*ROUTES, "sdpa_mask"])
def test_a_plan_for_some_heads_gives_those_heads_of_the_full_plan(path):
    """What a tensor-parallel rank runs: its heads' slice of q, k, v with `heads=` naming their global indices."""
    if path == "sdpa_mask":  # a static cache's decoding step
        implementation, options, q_len, offset = "sdpa", {}, 1, torch.tensor(16)
    else:
        (implementation, options), q_len, offset = ROUTES[path], 17, None
    query, key, value = qkv(2, q_len, 17)
    plan = plan_alibi_attention(implementation, SLOPES, 2, q_len, 17, offset, **options)
    assert plan.path == path
    heads = slice(4, 7)  # slopes 2^-5 .. 2^-7 of the 12: the wrong ones would show at once
    with torch.no_grad():
        full, _ = alibi_attention(query, key, value, plan, SCALE)  # (B, q, H, D)
        part, _ = alibi_attention(query[:, heads], key[:, heads], value[:, heads], plan, SCALE, heads=heads)
    torch.testing.assert_close(part, full[:, :, heads], atol=1e-6, rtol=0)


def test_bank_dropout_is_unbiased_on_the_exact_probabilities():
    """Training with attention dropout takes the bias bank: SDPA's own dropout, whose mean over many draws is the
    dropout-free output, and each draw differs from it."""
    query, key, value = (t[:1] for t in qkv(1, 9, 9))
    plan = plan_alibi_attention("sdpa", SLOPES, 1, 9, 9, dropout=0.1)
    assert plan.path == "sdpa_bank"
    expected, _, _ = reference_attention(query, key, value, SLOPES, scale=SCALE)  # (1, H, q, D)
    draws = torch.stack([alibi_attention(query, key, value, plan, SCALE)[0] for _ in range(3000)]).transpose(2, 3)
    assert (draws[0].double() - expected).abs().max() > 1e-3, "dropout was not applied"
    mean_error = (draws.double().mean(0) - expected).abs().max().item()
    assert mean_error <= 0.05, f"the mean over draws is {mean_error:.3g} from the dropout-free output"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(attention_mask=torch.ones(3, 20)), "batch 2"),
        (dict(attention_mask=torch.ones(2, 19)), r"\(2, 19\)"),
        (dict(attention_mask=torch.ones(2, 1, 20)), "must be 2-D"),
        (dict(position_ids=torch.arange(7)[None]), r"position_ids has shape \(1, 7\)"),
        (dict(cu_seq_lens=torch.tensor([0, 5, 19])), "ending at the row length 20"),
    ],
)
def test_bad_plan_inputs_raise_value_errors_naming_them(arguments, message):
    arguments = dict(implementation="sdpa", slopes=SLOPES, batch=2, query_length=20, key_length=20) | arguments
    if "cu_seq_lens" in arguments:
        arguments["batch"] = 1
    with pytest.raises(ValueError, match=message):
        plan_alibi_attention(**arguments)
