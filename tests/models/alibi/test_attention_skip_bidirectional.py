"""Certified skipping on an encoder's bidirectional rows (`certified_split` on a `causal=False` plan): each (head,
block of rows) reads a certified window of keys on both sides, and the output, its gradients, padded rows and packed
rows stay within the bound of Theorem 1 of the float64 reference written from `-m |i - j|`; `choose_path` routes it
(the split alone; `"auto"` by the bidirectional rule) and the encoder's config carries the switch."""

import pytest
import torch
from alibi_bert_reference import paper_slopes, reference_attention, visibility

from hf_alibi import AlibiBertConfig, AlibiBertModel, get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import (
    AUTO_BIDIRECTIONAL_KEPT,
    AUTO_PREFILL_KEPT,
    certified_split,
    predicted_kept,
    skipping_pays,
)
from hf_alibi.models.alibi.attention_plan import AUTO_EPS, choose_path, plan_facts
from hf_alibi.models.alibi.attention_sdpa_split import split_kernels_work

pytestmark = pytest.mark.skipif(not split_kernels_work(), reason="the CPU flash kernels are unavailable")
HEADS, DIM, EPS = 4, 16, 1e-7


def steep_problem(batch, length, seed=0):
    """Queries, keys and values whose steep heads certify narrow windows (unit-scale logits, the paper's slopes for
    4 heads: 1/4 .. 1/256), so the path really skips."""
    generator = torch.Generator().manual_seed(seed)
    return [0.5 * torch.randn(batch, HEADS, length, DIM, generator=generator) for _ in range(3)]


def certified(query, key, value, **planning):
    batch, _, length, _ = query.shape
    plan = plan_alibi_attention(
        "sdpa", get_alibi_slopes(HEADS), batch, length, length, causal=False, skip_eps=EPS, **planning
    )
    assert plan.path in ("sdpa_split_certified", "sdpa_packed"), plan.path
    output, _ = alibi_attention(query, key, value, plan, DIM**-0.5)
    return plan, output.transpose(1, 2)  # (B, H, L, D)


def within_theorem_1(output, expected, value, rows=None):
    """|output - dense| <= 2 eps max|v| plus fp32 rounding on every real row."""
    difference = (output.double() - expected).abs()
    if rows is not None:
        difference = difference.transpose(1, 2)[rows.bool()]
    bound = 2 * EPS * value.abs().max().item() + 3e-6
    assert difference.max().item() <= bound, f"{difference.max().item():.3e} > {bound:.3e}"


def test_both_sides_are_skipped_and_the_output_stays_within_the_bound():
    length = 1000  # not a multiple of the 256-row blocks
    query, key, value = steep_problem(1, length)
    plan = plan_alibi_attention("sdpa", get_alibi_slopes(HEADS), 1, length, length, causal=False, skip_eps=EPS)
    output, ranges = certified_split(query, key, value, plan, DIM**-0.5)
    starts, ends = ranges.first_key, ranges.end_key  # (H, blocks) each
    blocks = torch.arange(0, length, 256)
    assert bool((starts <= blocks).all()) and bool((ends >= (blocks + 256).clamp(max=length)).all())
    assert int(starts[0, -1]) > 0 and int(ends[0, 0]) < length, "the steepest head skips keys on both sides"
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(None, None, 1, length))
    within_theorem_1(output, expected, value)


def test_right_padding_and_a_batch_of_two():
    length = 700
    query, key, value = steep_problem(2, length, seed=1)
    mask = (torch.arange(length)[None] < torch.tensor([[length], [530]])).long()  # (B, L)
    _, output = certified(query, key, value, attention_mask=mask)
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(mask, None, 2, length))
    within_theorem_1(output, expected, value, rows=mask)


def test_packed_rows_skip_each_document_alone():
    lengths = [600, 300, 124]
    length = sum(lengths)
    query, key, value = steep_problem(1, length, seed=2)
    cu_seq_lens = torch.tensor([0, 600, 900, length])
    plan, output = certified(query, key, value, cu_seq_lens=cu_seq_lens)
    assert plan.path == "sdpa_packed"
    assert {part.path for *_, part in plan.payload.parts} == {"sdpa_split_certified"}
    documents = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]  # (1, L)
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(None, documents, 1, length))
    within_theorem_1(output, expected, value)


def test_gradients_are_those_of_the_attention_computed_within_the_bound():
    length = 600
    query, key, value = (t.requires_grad_() for t in steep_problem(1, length, seed=3))
    _, output = certified(query, key, value)
    upstream = torch.randn_like(output)
    (output * upstream).sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (query, key, value)]
    expected, _ = reference_attention(*exact, paper_slopes(HEADS), visibility(None, None, 1, length))
    (expected * upstream.double()).sum().backward()
    for got, want in zip((query, key, value), exact):
        assert (got.grad.double() - want.grad).abs().max().item() <= 1e-5


def test_the_route_skips_on_the_split_alone_and_auto_follows_the_bidirectional_rule():
    facts = plan_facts(get_alibi_slopes(HEADS), 1, 600, 600, causal=False)
    cpu = dict(tracing=False, kernels_work=lambda: True)
    route = choose_path("sdpa", facts, "cpu", skip_eps=1e-5, **cpu)
    assert (route.path, route.eps) == ("sdpa_split_certified", 1e-5)
    assert choose_path("flex_attention", facts, "cpu", skip_eps=1e-5, **cpu).path == "flex_attention"  # dense
    asked = []

    def rule(*args):
        asked.append(args)
        return True

    route = choose_path("sdpa", facts, "cpu", skip_eps="auto", skip_pays=rule, **cpu)
    assert (route.path, route.eps) == ("sdpa_split_certified", AUTO_EPS)
    assert asked[0][1:] == (600, 600, False), "the bidirectional rule is asked"


def test_the_bidirectional_rule_skips_long_rows_only():
    slopes = get_alibi_slopes(HEADS)
    # each side of an encoder's row keeps what a causal row keeps back: the same predicted share of all its pairs
    assert predicted_kept(slopes, 8192, 8192) == pytest.approx(0.394, abs=0.01)
    assert not skipping_pays(slopes, 2048, 2048, False)
    assert skipping_pays(slopes, 65536, 65536, False)
    assert 0.0 < AUTO_BIDIRECTIONAL_KEPT < 1.0 and 0.0 < AUTO_PREFILL_KEPT < 1.0


def test_the_encoder_config_carries_the_switch_and_its_model_skips():
    with pytest.raises(ValueError, match="alibi_skip_eps"):
        AlibiBertConfig(alibi_skip_eps=1.5)
    with pytest.raises(ValueError, match="alibi_skip_eps"):
        AlibiBertConfig(alibi_skip_eps="always")
    assert AlibiBertConfig().alibi_skip_eps == "auto"
    config = AlibiBertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=64
    )
    torch.manual_seed(0)
    model = AlibiBertModel(config).eval()
    ids = torch.randint(0, 64, (1, 900))
    outputs = {}
    for eps in (0.0, EPS):
        model.config.alibi_skip_eps = eps
        with torch.no_grad():
            outputs[eps] = model(ids).last_hidden_state
    assert (outputs[EPS] - outputs[0.0]).abs().max().item() <= 1e-4
