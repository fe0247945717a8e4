"""Bidirectional ALiBi (an encoder's `-m |i - j|`, `causal=False`) through the shared attention core: every path
against the float64 reference written from the formula (`alibi_bert_reference.py`), with right padding and packed
rows, across the split's chunk boundaries and past 8192 tokens; the decoder-only paths refused in `choose_path`
(certified skipping on both sides: `test_attention_skip_bidirectional.py`)."""

import pytest
import torch
from alibi_bert_reference import paper_slopes, reference_attention, visibility

from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_plan import choose_path, plan_facts
from hf_alibi.models.alibi.attention_sdpa_split import SPLIT_CHUNKS, split_kernels_work

HEADS, DIM = 6, 8  # 6 heads: the paper's interleaved slopes (not a power of two)
requires_split = pytest.mark.skipif(not split_kernels_work(), reason="the CPU flash kernels are unavailable")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def qkv(batch, length, heads=HEADS, dtype=torch.float32):
    return [torch.randn(batch, heads, length, DIM, dtype=dtype) for _ in range(3)]


def right_padding(lengths, length):
    return (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()  # (B, L)


def attend(implementation, query, key, value, **planning):
    batch, heads, length, _ = query.shape
    plan = plan_alibi_attention(
        implementation, get_alibi_slopes(heads), batch, length, length, causal=False, **planning
    )
    output, _ = alibi_attention(query, key, value, plan, DIM**-0.5)
    return plan.path, output.transpose(1, 2)  # (B, H, L, D)


def assert_close_on(output, expected, rows=None, atol=2e-5):
    """Compare (B, H, L, D) outputs on the real rows (`rows`: (B, L) bool) and print the largest difference."""
    difference = (output.double() - expected).abs()
    if rows is not None:
        difference = difference.transpose(1, 2)[rows.bool()]
    assert difference.max().item() <= atol, f"largest difference {difference.max().item():.3g}"


def test_the_reference_slopes_are_the_papers_interleaved_slopes():
    expected = [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]  # 6 heads, as jina-embeddings-v2-small's NOTES give
    assert paper_slopes(6).tolist() == expected == get_alibi_slopes(6).tolist()


# (implementation, planning arguments, path it must take); lengths cross the split's 1024- and 256-row chunks
PATHS = [
    ("eager", {}, "eager"),
    pytest.param("sdpa", {}, "sdpa_split", marks=requires_split),
    ("sdpa", dict(sdpa_split=False, query_chunk=96), "sdpa_bank"),
    ("flex_attention", {}, "flex_attention"),
]


@pytest.mark.parametrize("implementation, planning, path", PATHS)
def test_every_path_matches_the_reference_with_right_padding(implementation, planning, path):
    length = SPLIT_CHUNKS[0] + 300  # a partial first-level chunk, partial blocks, keys on both sides of every chunk
    query, key, value = qkv(2, length)
    mask = right_padding([length, length - 333], length)
    taken, output = attend(implementation, query, key, value, attention_mask=mask, **planning)
    assert taken == path
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(mask, None, 2, length))
    assert_close_on(output, expected, mask)


@pytest.mark.parametrize("implementation, planning, path", PATHS)
def test_every_path_attends_each_packed_document_alone(implementation, planning, path):
    lengths = [300, 1, 170, 29]  # restarting position_ids, as transformers' padding-free collators send
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    query, key, value = qkv(1, sum(lengths))
    taken, output = attend(implementation, query, key, value, position_ids=position_ids, **planning)
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(None, documents, 1, 500))
    assert_close_on(output, expected)
    cu_seq_lens = torch.tensor([0, 300, 301, 471, 500])  # flash-attention style boundaries: the same documents
    _, from_boundaries = attend(implementation, query, key, value, cu_seq_lens=cu_seq_lens, **planning)
    assert_close_on(from_boundaries, expected)
    if path == "sdpa_split":
        assert taken == "sdpa_packed"  # each document through the split alone: no mask over the whole row


@requires_split
def test_split_gradient_matches_the_float64_reference():
    length = 700  # three 256-row blocks: keys left and right of each
    exact = [t.double().requires_grad_() for t in qkv(1, length)]
    expected, _ = reference_attention(*exact, paper_slopes(HEADS))
    grad = torch.randn_like(expected)
    reference_grads = torch.autograd.grad(expected, exact, grad)
    inputs = [t.detach().float().requires_grad_() for t in exact]
    path, output = attend("sdpa", *inputs)
    assert path == "sdpa_split"
    grads = torch.autograd.grad(output, inputs, grad.float())
    for got, want in zip(grads, reference_grads):
        assert (got.double() - want).abs().max().item() <= 2e-5 * max(want.abs().max().item(), 1.0)


@requires_split
def test_split_matches_the_reference_past_8192_tokens_with_no_length_cap():
    length = 8192 + 300
    query, key, value = qkv(1, length, heads=2)
    path, output = attend("sdpa", query, key, value)
    assert path == "sdpa_split"
    rows = torch.cat([torch.arange(0, 300), torch.arange(4000, 4300), torch.arange(length - 300, length)])
    expected, _ = reference_attention(query, key, value, paper_slopes(2), rows=rows)  # the reference's cost is per row
    assert_close_on(output[:, :, rows], expected, atol=5e-5)


def test_compiled_flex_attention_matches_the_reference_with_padding():
    length = 200
    query, key, value = qkv(2, length)
    mask = right_padding([length, 123], length)
    plan = plan_alibi_attention(
        "flex_attention", get_alibi_slopes(HEADS), 2, length, length, attention_mask=mask, causal=False
    )
    with torch.no_grad():
        output, _ = torch.compile(alibi_attention)(query, key, value, plan, DIM**-0.5)
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(mask, None, 2, length))
    assert_close_on(output.transpose(1, 2), expected, mask)


def test_eager_weights_are_the_reference_probabilities():
    length = 40
    query, key, value = qkv(2, length)
    mask = right_padding([length, 25], length)
    plan = plan_alibi_attention(
        "sdpa", get_alibi_slopes(HEADS), 2, length, length, attention_mask=mask, causal=False, output_attentions=True
    )
    assert plan.path == "eager"
    _, weights = alibi_attention(query, key, value, plan, DIM**-0.5, output_attentions=True)
    _, expected = reference_attention(query, key, value, paper_slopes(HEADS), visibility(mask, None, 2, length))
    assert (weights.double() - expected).abs().max().item() <= 1e-6
    assert weights[1, :, :, 25:].abs().max().item() == 0.0  # padded keys get no weight


def test_decoder_only_paths_are_refused_for_a_bidirectional_plan():
    facts = plan_facts(get_alibi_slopes(HEADS), 1, 600, 600, causal=False)
    with pytest.raises(ValueError, match="paged"):
        choose_path("sdpa", facts, "cpu", tracing=False, paged=True)
    with pytest.raises(ValueError, match="reads no cache"):
        plan_facts(get_alibi_slopes(HEADS), 1, 1, 600, causal=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_flash_attention_2_without_causality_is_the_symmetric_bias(padded):
    pytest.importorskip("flash_attn")
    length = 300
    query, key, value = qkv(2, length, dtype=torch.bfloat16)
    mask = right_padding([length, 211] if padded else [length, length], length)
    path, output = attend("flash_attention_2", query.cuda(), key.cuda(), value.cuda(), attention_mask=mask.cuda())
    assert path == ("flash_attention_2_varlen" if padded else "flash_attention_2")
    expected, _ = reference_attention(query, key, value, paper_slopes(HEADS), visibility(mask, None, 2, length))
    assert_close_on(output.cpu(), expected, mask, atol=2e-2)
