"""Every attention backend against the formula written out in plain PyTorch (backend selection in the model:
`test_backend_selection.py`).

Reference (`alibi_reference.py`): softmax(q . k / sqrt(d) - m_h * (i - j)) @ v over keys j <= i that are not padding,
in float64, with query i sitting at absolute position offset + row (offset = cached tokens).
"""

import pytest
import torch

import alibi_reference
from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.transformers_compat import output_cache

HEADS, DIM = 12, 8
SCALE = DIM**-0.5


def reference_attention(query, key, value, slopes, key_padding=None, offset=None):
    """`alibi_reference.reference_attention` at this scale, output (B, q, H, D) as the backends return it."""
    output, weights, has_keys = alibi_reference.reference_attention(
        query, key, value, slopes, scale=SCALE, offset=offset, key_padding=key_padding
    )
    return output.transpose(1, 2), weights, has_keys


def padding_mask(lengths, total, side):
    """(B, total) 0/1 mask with `lengths[b]` real tokens on the right (left padding) or on the left."""
    positions = torch.arange(total)[None]
    lengths = torch.tensor(lengths)[:, None]
    real = positions >= total - lengths if side == "left" else positions < lengths
    return real.long()


# (query length, key length, attention mask or None); lengths are not multiples of the chunk of 16
SCENARIOS = {
    "self": (37, 37, None),
    "cache_offset": (5, 29, None),
    "one_token_decode": (1, 20, None),
    "left_padding": (37, 37, padding_mask([37, 20, 3], 37, "left")),
    "right_padding": (37, 37, padding_mask([37, 20, 3], 37, "right")),
    "left_padding_with_cache": (19, 40, padding_mask([40, 33, 25], 40, "left")),
    "fully_padded_sequence": (21, 21, padding_mask([21, 0, 5], 21, "left")),
}
BACKENDS = ["eager", "sdpa", "sdpa_chunked", "flex_attention"]


def plan(backend, query, key, slopes, mask=None, offset=None, **options):
    """The plan of one forward for these tensors: `backend` is an attn_implementation, or "sdpa_chunked" for SDPA's
    bias-bank path (packed rows, dropout, compilation, other devices), here with several chunks, the last partial."""
    if backend == "sdpa_chunked":
        backend, options = "sdpa", dict(sdpa_split=False, query_chunk=16, **options)
    return plan_alibi_attention(
        backend,
        slopes,
        query.shape[0],
        query.shape[2],
        key.shape[2],
        offset,
        attention_mask=mask,
        dtype=query.dtype,
        **options,
    )


def run_backend(backend, query, key, value, slopes, mask, offset=None, output_attentions=False):
    """The backend's output; with `output_attentions`, (output, weights, the plan)."""
    if output_attentions:  # the model plans the forward for the eager path when weights are asked for
        backend = "eager"
    inputs = plan(backend, query, key, slopes, mask, offset)
    with torch.no_grad():  # FlexAttention has no CPU backward
        output, weights = alibi_attention(query, key, value, inputs, SCALE, output_attentions=output_attentions)
    return (output, weights, inputs) if output_attentions else output


def qkv(batch, q_len, kv_len, dtype=torch.float32):
    query = torch.randn(batch, HEADS, q_len, DIM, dtype=dtype)
    key = torch.randn(batch, HEADS, kv_len, DIM, dtype=dtype)
    value = torch.randn(batch, HEADS, kv_len, DIM, dtype=dtype)
    return query, key, value


def assert_matches_reference(output, expected, has_keys, atol):
    assert torch.isfinite(output).all(), "NaN or inf in the output (a fully masked row must stay finite)"
    keep = has_keys.transpose(1, 2).expand_as(expected)  # (B, q, H, D)
    difference = (output.double() - expected).abs().masked_fill(~keep, 0).max().item()
    assert difference <= atol, f"largest difference from the reference {difference:.3g} > {atol}"


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_formula_fp32(backend, scenario):
    q_len, kv_len, mask = SCENARIOS[scenario]
    batch = 1 if mask is None else mask.shape[0]
    query, key, value = qkv(batch, q_len, kv_len)
    slopes = get_alibi_slopes(HEADS)
    expected, _, has_keys = reference_attention(query, key, value, slopes, None if mask is None else mask.bool())
    output = run_backend(backend, query, key, value, slopes, mask)
    assert output.shape == (batch, q_len, HEADS, DIM)
    assert_matches_reference(output, expected, has_keys, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_with_steep_custom_slopes(backend):
    slopes = torch.tensor([0.0, 2.0, 0.5, 1e-3, 0.9, 0.0, 3.0, 0.1, 0.25, 0.7, 0.05, 1.5])
    mask = padding_mask([30, 17], 30, "left")
    query, key, value = qkv(2, 9, 30)
    expected, _, has_keys = reference_attention(query, key, value, slopes, mask.bool())
    output = run_backend(backend, query, key, value, slopes, mask)
    assert_matches_reference(output, expected, has_keys, atol=1e-5)


@pytest.mark.parametrize("scenario", ["left_padding_with_cache", "fully_padded_sequence"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_reference_in_bf16(backend, scenario):
    # bf16 inputs against the float64 reference of the same (rounded) inputs; bf16 has 8 bits of mantissa
    q_len, kv_len, mask = SCENARIOS[scenario]
    query, key, value = qkv(mask.shape[0], q_len, kv_len, torch.bfloat16)
    slopes = get_alibi_slopes(HEADS)
    expected, _, has_keys = reference_attention(query, key, value, slopes, mask.bool())
    output = run_backend(backend, query, key, value, slopes, mask)
    assert output.dtype == torch.bfloat16
    assert_matches_reference(output, expected, has_keys, atol=2e-2)


@pytest.mark.parametrize("output_attentions", [False, True], ids=["plain", "output_attentions"])
@pytest.mark.parametrize("offset", [0, 6], ids=["prefill", "second_chunk"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_buffer_matches_reference_and_only_its_filled_keys_are_used(backend, offset, output_attentions):
    """A static cache hands over its whole buffer (unwritten slots: anything) and its length as a 0-d tensor."""
    q_len, buffer = 23, 50
    filled = offset + q_len
    mask = padding_mask([filled, 14, 4], filled, "left")
    mask = torch.cat([mask, torch.ones(3, buffer - filled, dtype=mask.dtype)], dim=1)  # generate pads it with ones
    query, key, value = qkv(3, q_len, buffer)
    key[:, :, filled:], value[:, :, filled:] = 1e3, 1e3  # must never be read
    slopes = get_alibi_slopes(HEADS)
    expected, expected_weights, has_keys = reference_attention(query, key, value, slopes, mask.bool(), offset)
    offset = torch.tensor(offset)  # what the model reads from a static cache
    result = run_backend(backend, query, key, value, slopes, mask, offset, output_attentions)
    output, weights, inputs = result if output_attentions else (result, None, None)
    assert_matches_reference(output, expected, has_keys, atol=1e-5)
    if output_attentions:  # weights cover the buffer, as the cache's keys do, with 0 on the unwritten slots
        assert inputs.key_length == filled and (inputs.payload.bias.shape[-1] == filled)
        assert weights.shape == (3, HEADS, q_len, buffer)
        difference = (weights.double() - expected_weights).abs().masked_fill(~has_keys, 0).max().item()
        assert difference <= 1e-6, f"largest weight difference {difference:.3g}"


@pytest.mark.parametrize("path", ["bank", "one_mask"])
def test_a_call_in_a_wider_dtype_than_planned_gets_the_exact_fp32_bias(path):
    """A plan built for bf16 layers (autocast) keeps its fp32 bias: a layer that runs in fp32 all the same must not
    get the bf16-rounded one."""
    slopes, mask = get_alibi_slopes(HEADS), padding_mask([40, 23], 40, "left")
    if path == "bank":  # several chunks of the bias bank
        q_len, offset, backend = 40, None, "sdpa_chunked"
    else:  # a static cache's decoding step: its count is a 0-d tensor, its one mask is (B, H, 1, kv)
        q_len, offset, backend = 1, torch.tensor(39), "sdpa"
    query, key, value = qkv(2, q_len, 40)
    inputs = plan(backend, query.bfloat16(), key, slopes, mask, offset)
    assert inputs.path == ("sdpa_bank" if path == "bank" else "sdpa_mask")
    assert inputs.payload.cast.dtype == torch.bfloat16 and inputs.payload.bias.dtype == torch.float32
    with torch.no_grad():
        alibi_attention(query.bfloat16(), key.bfloat16(), value.bfloat16(), inputs, SCALE)
        output, _ = alibi_attention(query, key, value, inputs, SCALE)
    expected, _, has_keys = reference_attention(
        query, key, value, slopes, mask.bool(), offset=39 if q_len == 1 else None
    )
    assert_matches_reference(output, expected, has_keys, atol=1e-5)


def test_returned_attention_weights_match_reference_softmax():
    mask = padding_mask([25, 11], 25, "left")
    query, key, value = qkv(2, 7, 25)
    slopes = get_alibi_slopes(HEADS)
    _, expected, has_keys = reference_attention(query, key, value, slopes, mask.bool())
    _, weights = alibi_attention(query, key, value, plan("eager", query, key, slopes, mask), SCALE, True)
    difference = (weights.double() - expected).abs().masked_fill(~has_keys, 0).max().item()
    assert difference <= 1e-6, f"largest weight difference {difference:.3g}"


def test_attention_weights_from_a_plan_without_them_raise_naming_its_path():
    query, key, value = qkv(1, 7, 7)
    with pytest.raises(ValueError, match="sdpa_split"):
        alibi_attention(query, key, value, plan("sdpa", query, key, get_alibi_slopes(HEADS)), SCALE, True)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "sdpa_bank", "flex_attention"])
def test_whole_model_logits_agree_across_backends_beyond_n_positions(backend, make_model, random_ids):
    path = dict(alibi_sdpa_query_chunk=16, alibi_sdpa_split=backend != "sdpa_bank")
    ids = random_ids(3, 70)  # n_positions is 16
    mask = padding_mask([70, 41, 9], 70, "left")
    with torch.no_grad():
        expected = make_model("eager")(ids, attention_mask=mask).logits
        logits = make_model(backend.removesuffix("_bank"), **path)(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("split", [True, False], ids=["split", "bank"])
def test_sdpa_backward_gradients_match_eager(split, make_model, random_ids):
    ids = random_ids(2, 40)
    # Right padding, as in training batches. (With left padding the last pad's logits predict the first real token
    # from a fully masked row, whose output is arbitrary and backend-dependent.)
    mask = padding_mask([40, 23], 40, "right")
    labels = ids.masked_fill(mask == 0, -100)
    gradients = {}
    for backend in ("eager", "sdpa"):
        model = make_model(backend, alibi_sdpa_split=split, alibi_sdpa_query_chunk=16).train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        gradients[backend] = {name: p.grad for name, p in model.named_parameters()}
    for name, expected in gradients["eager"].items():
        scale = expected.abs().max().item()
        difference = (gradients["sdpa"][name] - expected).abs().max().item()
        assert difference <= 1e-5 * max(scale, 1e-3), f"{name}: largest gradient difference {difference:.3g}"


# GPU only: FlashAttention-2 (its own alibi_slopes) and compiled FlexAttention, bf16, left padding, a KV cache.
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["flash_attention_2", "compiled_flex_attention"])
def test_gpu_backend_matches_reference_in_bf16_with_padding_and_cache(backend):
    if backend == "flash_attention_2":
        pytest.importorskip("flash_attn")
    q_len, kv_len, mask = SCENARIOS["left_padding_with_cache"]
    query, key, value = qkv(mask.shape[0], q_len, kv_len, torch.bfloat16)
    slopes = get_alibi_slopes(HEADS)
    expected, _, has_keys = reference_attention(query, key, value, slopes, mask.bool())
    implementation = backend.removeprefix("compiled_")
    inputs = plan(implementation, query.cuda(), key.cuda(), slopes.cuda(), mask.cuda())
    attend = torch.compile(alibi_attention) if backend.startswith("compiled_") else alibi_attention
    with torch.no_grad():
        output, _ = attend(query.cuda(), key.cuda(), value.cuda(), inputs, SCALE)
    assert output.dtype == torch.bfloat16
    assert_matches_reference(output.cpu(), expected, has_keys, atol=2e-2)


@pytest.mark.gpu
@requires_cuda
def test_gpu_flash_model_prefill_and_cached_decode_match_eager_in_bf16(make_model, random_ids):
    pytest.importorskip("flash_attn")
    ids = random_ids(3, 24).cuda()
    mask = padding_mask([24, 15, 6], 24, "left").cuda()
    logits = {}
    for backend in ("eager", "flash_attention_2"):
        model = make_model(backend).to("cuda", torch.bfloat16)
        with torch.no_grad():
            out = model(ids[:, :20], attention_mask=mask[:, :20], use_cache=True)
            pieces = [out.logits]
            for t in range(20, 24):
                out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=output_cache(out))
                pieces.append(out.logits)
        logits[backend] = torch.cat(pieces, dim=1).float()[mask.bool()]  # real tokens only
    scale = logits["eager"].abs().max().item()
    torch.testing.assert_close(logits["flash_attention_2"], logits["eager"], atol=3e-2 * max(scale, 1.0), rtol=0)
