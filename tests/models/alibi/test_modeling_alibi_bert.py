"""AlibiBertModel against the float64 reference written from the layout (`alibi_bert_reference.py`): every CPU
backend, right padding, packed rows, the GLU and qk-LayerNorm variants, inputs past `max_position_embeddings` and past
8192 tokens; attention weights; slopes after loading and after a cast."""

import pytest
import torch
from alibi_bert_reference import paper_slopes, reference_encoder

from hf_alibi import AlibiBertForMaskedLM, AlibiBertModel, get_alibi_slopes

BACKENDS = ["eager", "sdpa", "flex_attention"]


def right_padding(lengths, length):
    return (torch.arange(length)[None] < torch.tensor(lengths)[:, None]).long()  # (B, L)


def assert_matches(output, expected, rows=None, rtol=2e-5):
    """Compare hidden states on the real rows (`rows`: (B, L) bool), printing the largest difference."""
    difference = (output.double() - expected).abs()
    if rows is not None:
        difference = difference[rows.bool()]
    bound = rtol * max(expected.abs().max().item(), 1.0)
    assert difference.max().item() <= bound, f"largest difference {difference.max().item():.3g} > {bound:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_matches_the_reference_with_right_padding_and_segments(make_encoder, backend):
    model = make_encoder(attn_implementation=backend)
    length = 300  # past max_position_embeddings (64), two of the split's 256-row blocks
    ids = torch.randint(1, 100, (2, length))
    mask = right_padding([length, 170], length)
    segments = torch.randint(0, 2, (2, length))
    with torch.no_grad():
        output = model(ids, attention_mask=mask, token_type_ids=segments).last_hidden_state
    assert_matches(output, reference_encoder(model, ids, mask, segments), mask)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(qk_layer_norm=True),
        dict(feed_forward_type="reglu"),
        dict(feed_forward_type="glu", hidden_act="silu"),
        dict(layer_layout="jina_code", qk_layer_norm=True),
        dict(layer_layout="jina_code", feed_forward_type="reglu"),
    ],
    ids=["qk_layer_norm", "reglu", "glu_silu", "jina_code", "jina_code_reglu"],
)
def test_variants_match_the_reference(make_encoder, overrides):
    model = make_encoder(**overrides)
    ids = torch.randint(1, 100, (2, 40))
    with torch.no_grad():
        output = model(ids).last_hidden_state
    assert_matches(output, reference_encoder(model, ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_right_padding_gives_each_row_its_unpadded_outputs(make_encoder, backend):
    model = make_encoder(attn_implementation=backend)
    ids = torch.randint(1, 100, (3, 90))
    lengths = [90, 57, 3]
    mask = right_padding(lengths, 90)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).last_hidden_state
        for row, n in enumerate(lengths):
            alone = model(ids[row : row + 1, :n]).last_hidden_state[0]
            torch.testing.assert_close(padded[row, :n], alone, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_rows_attend_each_document_alone(make_encoder, backend):
    """Restarting `position_ids` (padding-free collators) or `cu_seq_lens_q` (flash-attention style): each document
    of the flattened row gets exactly the outputs it gets alone."""
    model = make_encoder(AlibiBertForMaskedLM, attn_implementation=backend)
    lengths = [70, 1, 260, 33]
    ids = torch.randint(1, 100, (1, sum(lengths)))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seq_lens = torch.tensor([0, 70, 71, 331, 364])
    documents = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None]
    with torch.no_grad():
        by_positions = model.bert(ids, position_ids=position_ids).last_hidden_state
        by_boundaries = model(ids, cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=260).logits
        alone = [model.bert(part).last_hidden_state for part in ids.split(lengths, dim=1)]
        alone_logits = [model(part).logits for part in ids.split(lengths, dim=1)]
    torch.testing.assert_close(by_positions, torch.cat(alone, dim=1), atol=2e-5, rtol=0)
    torch.testing.assert_close(by_boundaries, torch.cat(alone_logits, dim=1), atol=1e-4, rtol=0)
    assert_matches(by_positions, reference_encoder(model, ids, documents=documents))


def test_the_split_runs_past_8192_tokens_and_matches_the_reference(make_encoder):
    model = make_encoder(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=16)
    ids = torch.randint(1, 100, (1, 8192 + 200))  # no cap at max_position_embeddings (64) nor at 8192
    rows = torch.cat([torch.arange(0, 300), torch.arange(4000, 4300), torch.arange(8092, 8392)])  # ends and middle
    with torch.no_grad():
        output = model(ids).last_hidden_state
    assert_matches(output[:, rows], reference_encoder(model, ids, rows=rows), rtol=5e-5)


def test_output_attentions_gives_the_eager_weights_of_every_layer(make_encoder):
    model = make_encoder()  # sdpa: asking for weights plans the eager path, as BERT does
    ids = torch.randint(1, 100, (2, 30))
    mask = right_padding([30, 12], 30)
    with torch.no_grad():
        outputs = model(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        plain = model(ids, attention_mask=mask).last_hidden_state
    assert len(outputs.attentions) == 2 and len(outputs.hidden_states) == 3  # as BERT: embeddings + each layer
    for weights in outputs.attentions:
        assert weights.shape == (2, 6, 30, 30)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 6, 30))
        assert weights[1, :, :, 12:].abs().max().item() == 0.0  # padded keys get no weight
    torch.testing.assert_close(outputs.last_hidden_state, plain, atol=2e-5, rtol=0)
    torch.testing.assert_close(outputs.hidden_states[-1], plain, atol=2e-5, rtol=0)


def test_slopes_are_the_papers_after_loading_and_stay_fp32_after_a_cast(make_encoder, tmp_path):
    model = make_encoder()
    model.save_pretrained(tmp_path)
    loaded = AlibiBertModel.from_pretrained(tmp_path)  # built on the meta device: the buffer must be refilled
    assert torch.equal(loaded.alibi_slopes, paper_slopes(6).float())
    loaded.to(torch.bfloat16)
    assert loaded.alibi_slopes.dtype == torch.float32 and torch.equal(loaded.alibi_slopes, get_alibi_slopes(6))


@pytest.mark.slow
def test_the_compiled_model_matches_eager_mode_with_padding(make_encoder):
    """torch.compile(fullgraph=True) of the whole encoder: inside the graph the plan takes the bias bank (two
    256-row chunks, each a view of one (H, 256, 2L - 1) bank), no graph break (~60 s on 2 cores)."""
    model = make_encoder(AlibiBertForMaskedLM)
    ids = torch.randint(1, 100, (2, 300))
    mask = right_padding([300, 200], 300)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        compiled = torch.compile(model, fullgraph=True)(ids, attention_mask=mask).logits
    torch.testing.assert_close(compiled, expected, atol=1e-5, rtol=0)
