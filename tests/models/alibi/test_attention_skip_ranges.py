"""Certified key skipping in the model (`alibi_skip_eps`): outputs equal dense attention within fp32 rounding on every
path that skips (the split, FlexAttention, cached decoding), with padding, packed rows and caches; keys really are
skipped; nothing skips with gradients on; the decoding summary of key norms stays an upper bound."""

import pytest
import torch
from transformers import DynamicCache

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.attention_certified import (
    KEY_BLOCK,
    ROW_GROUP,
    ROWS,
    certified_decode_ranges,
    certified_split,
)
from hf_alibi.models.alibi.attention_skip import certified_key_starts, key_block_norms
from hf_alibi.models.alibi.transformers_compat import output_cache

EPS = 1e-7


def steep_model(backend="sdpa", **overrides):
    """4 heads with slopes 1/4 .. 1/256 (the demo's), scaled-up weights so that some keys are far from negligible."""
    config = AlibiGPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=64,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation=backend,
        **overrides,
    )
    torch.manual_seed(0)
    model = AlibiGPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(8.0)  # larger q.k: certificates have to work for their keys
    return model


def assert_close_to_dense(skipping, dense, real=None):
    skipping, dense = (t if real is None else t[real] for t in (skipping, dense))
    difference = (skipping - dense).abs().max().item()
    scale = dense.abs().max().item()
    assert difference <= 1e-6 * scale, f"largest difference {difference:.3g} at scale {scale:.3g}"


def logits(model, ids, eps, **inputs):
    model.config.alibi_skip_eps = eps
    with torch.no_grad():
        return model(ids, **inputs).logits


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("batch", [1, 3], ids=["batch_of_one", "left_padded_batch"])
def test_prefill_with_skipping_equals_dense_within_fp32_rounding(backend, batch):
    model = steep_model(backend)
    ids = torch.randint(0, 64, (batch, 700))
    mask = torch.ones_like(ids)
    mask[1:, :300] = 0  # left padding for the other rows
    real = mask.bool()
    assert_close_to_dense(
        logits(model, ids, EPS, attention_mask=mask), logits(model, ids, 0.0, attention_mask=mask), real
    )


def test_prefill_after_a_cached_prefix_with_skipping_equals_dense():
    model = steep_model()
    ids = torch.randint(0, 64, (1, 900))
    results = {}
    for eps in (0.0, EPS):
        model.config.alibi_skip_eps = eps
        with torch.no_grad():
            cache = output_cache(model(ids[:, :500], use_cache=True))
            results[eps] = model(ids[:, 500:], cache=cache).logits  # 400 rows at offset 500: the split, cached
    assert_close_to_dense(results[EPS], results[0.0])


def test_packed_rows_with_skipping_equal_dense():
    model = steep_model("flex_attention")
    ids = torch.randint(0, 64, (1, 600))
    positions = torch.cat([torch.arange(350), torch.arange(250)])[None]  # two documents
    assert_close_to_dense(
        logits(model, ids, EPS, position_ids=positions), logits(model, ids, 0.0, position_ids=positions)
    )


def test_greedy_decoding_with_skipping_gives_the_dense_tokens_and_the_model_a_summary_of_the_cache():
    model = steep_model()
    prompt = torch.randint(0, 64, (2, 600))
    mask = torch.ones_like(prompt)
    mask[1, :150] = 0
    tokens = {}
    for eps in (0.0, EPS):
        model.config.alibi_skip_eps = eps
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            tokens[eps] = model.generate(
                prompt, attention_mask=mask, max_new_tokens=12, do_sample=False, cache=cache, pad_token_id=0
            )
    assert torch.equal(tokens[EPS], tokens[0.0])
    norms = model.transformer.key_norms[cache]  # the decoding steps kept the cache's summary in the model
    keys = cache.layers[0].keys
    expected = key_block_norms(keys, KEY_BLOCK)  # padded keys too: the bound holds whatever mask comes next
    torch.testing.assert_close(norms.layers[0][0], expected.amax(0, keepdim=True), rtol=0, atol=1e-12)


def steep_plan(query, key, path_backend="sdpa", **options):
    return plan_alibi_attention(
        path_backend, get_alibi_slopes(4), query.shape[0], query.shape[2], key.shape[2], skip_eps=EPS, **options
    )


def qkv(batch, q_len, kv_len, scale=3.0, model_layout=False):
    """(B, 4, n, 16) query, key, value; `model_layout`: laid out (B, n, 4, 16) in memory, as the model's are."""
    generator = torch.Generator().manual_seed(1)
    if model_layout:
        shapes = [(batch, n, 4, 16) for n in (q_len, kv_len, kv_len)]
        return [scale * torch.randn(shape, generator=generator).transpose(1, 2) for shape in shapes]
    return [scale * torch.randn(batch, 4, n, 16, generator=generator) for n in (q_len, kv_len, kv_len)]


def test_far_keys_are_skipped_for_steep_heads_and_kept_for_the_flattest():
    query, key, value = qkv(1, 2048, 2048, scale=1.0)
    with torch.no_grad():
        plan = steep_plan(query, key)
        assert plan.payload.eps == EPS and plan.path == "sdpa_split_certified"
        _, ranges = certified_split(query, key, value, plan, 0.25)
        from_diagonal_logits = certified_key_starts(
            query, key, plan.slopes, 0.25, 0, EPS, ROWS, KEY_BLOCK, row_group=ROW_GROUP
        )
    first = ranges.first_key  # (H, blocks)
    assert ranges.rows == ROWS and first.shape == (4, 2048 // ROWS)
    # the kernel's diagonal log-sum-exps bound each row's LSE at least as tightly as its diagonal logit alone
    assert (first >= from_diagonal_logits).all() and (first > from_diagonal_logits).any()
    assert first[0, -1] > 1024, f"slope 1/4 must skip most of 1792 earlier keys, starts at {first[0, -1]}"
    assert (first[0] >= first[-1]).all(), "a steeper head must never keep more than the flattest"
    with torch.no_grad():  # a decoding step at position 2047 over the same keys
        step = plan_alibi_attention("sdpa", get_alibi_slopes(4), 1, 1, 2048, skip_eps=EPS)
        assert step.payload.eps == EPS and step.path == "sdpa_decode_certified" and step.payload.segmented
        decode_first = certified_decode_ranges(step, query[:, :, -1:], key, 0.25, layer=0).first_key  # (H, 1)
    assert decode_first[0, 0] > 1024 and decode_first[0, 0] >= decode_first[-1, 0], decode_first.tolist()


@pytest.mark.parametrize(
    "batch, q_len, kv",
    [(2, 1500, 1500), (1, 1024, 1024), (2, 1, 1500), (1, 1, 9000)],
    # whole blocks, batch 1: the diagonals' kernel output is the running output; a long decoding range: segments
    ids=["prefill", "prefill_of_whole_blocks", "decoding_step", "decoding_step_in_segments"],
)
def test_one_call_with_certified_ranges_matches_dense(batch, q_len, kv):
    query, key, value = qkv(batch, q_len, kv, model_layout=batch == 1)
    mask = torch.ones(batch, kv, dtype=torch.long)
    mask[1:, :200] = 0
    with torch.no_grad():
        skipping = alibi_attention(query, key, value, steep_plan(query, key, attention_mask=mask), 0.25, layer=0)[0]
        dense_plan = plan_alibi_attention("sdpa", get_alibi_slopes(4), batch, q_len, kv, attention_mask=mask)
        dense = alibi_attention(query, key, value, dense_plan, 0.25)[0]
    assert_close_to_dense(skipping, dense, mask[:, -q_len:].bool())


def test_skipping_only_with_an_eps_never_on_the_reference_and_in_training_too(make_model):
    query, key, _ = qkv(1, 300, 300)
    assert steep_plan(query, key).path == "sdpa_split_certified", "training skips too"  # pytest records gradients
    with torch.no_grad():
        assert "certified" not in plan_alibi_attention("sdpa", get_alibi_slopes(4), 1, 300, 300).path
        assert "certified" not in steep_plan(query, key, "eager").path  # the reference path never skips


def test_alibi_skip_eps_is_validated_saved_and_given_to_from_pretrained(tmp_path):
    with pytest.raises(ValueError, match="alibi_skip_eps.*1.5"):
        AlibiGPT2Config(alibi_skip_eps=1.5)
    with pytest.raises(ValueError, match="alibi_skip_eps.*-1e-07"):
        AlibiGPT2Config(alibi_skip_eps=-1e-7)
    steep_model().save_pretrained(tmp_path)
    assert AlibiGPT2LMHeadModel.from_pretrained(tmp_path, alibi_skip_eps=EPS).config.alibi_skip_eps == EPS
    AlibiGPT2LMHeadModel.from_pretrained(tmp_path, alibi_skip_eps=EPS).save_pretrained(tmp_path / "again")
    assert AlibiGPT2Config.from_pretrained(tmp_path / "again").alibi_skip_eps == EPS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_flex_with_per_head_block_masks_equals_dense_in_fp32():
    """On CUDA the plan calls FlexAttention's fused kernel with the layer's per-head block masks."""
    model = steep_model("flex_attention").cuda()
    ids = torch.randint(0, 64, (2, 1024), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    with torch.no_grad():
        plan = plan_alibi_attention("flex_attention", model.transformer.alibi_slopes, 2, 1024, 1024, skip_eps=EPS)
    assert plan.path == "flex_attention_certified" and plan.payload.compiled and plan.payload.eps == EPS
    real = mask.bool()
    assert_close_to_dense(
        logits(model, ids, EPS, attention_mask=mask), logits(model, ids, 0.0, attention_mask=mask), real
    )


@pytest.fixture(scope="module")
def trained_model():
    """A byte-level model trained for a few seconds on standard-library text: real, position-using q.k, which
    random weights lack (the demo's checkpoints are not in a clean clone)."""
    import inspect

    torch.manual_seed(0)
    config = AlibiGPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=257, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = AlibiGPT2LMHeadModel(config)
    text = torch.tensor(list(inspect.getsource(torch.nn.modules.module).encode()[:200_000])) + 1  # bytes as ids 1..256
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(80):
        starts = torch.randint(0, len(text) - 129, (16,), generator=generator)
        rows = torch.stack([text[s : s + 128] for s in starts])  # (16, 128)
        model(rows, labels=rows).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), text


@pytest.mark.parametrize("case", ["left_padded", "packed", "cached"])
def test_a_trained_model_with_skipping_equals_dense_within_fp32_rounding(trained_model, case):
    model, text = trained_model
    ids = text[:1500][None].repeat(2, 1)  # (2, 1500)
    ids[1] = text[5000:6500]
    results = {}
    for eps in (0.0, EPS):
        model.config.alibi_skip_eps = eps
        with torch.no_grad():
            if case == "left_padded":
                mask = torch.ones_like(ids)
                mask[1, :400] = 0
                results[eps] = model(ids, attention_mask=mask).logits[mask.bool()]
            elif case == "packed":
                positions = torch.cat([torch.arange(900), torch.arange(600)])[None].expand(2, -1)
                results[eps] = model(ids, position_ids=positions).logits
            else:
                cache = output_cache(model(ids[:, :1000], use_cache=True))
                results[eps] = model(ids[:, 1000:], cache=cache).logits
    model.config.alibi_skip_eps = 0.0
    assert_close_to_dense(results[EPS], results[0.0])
