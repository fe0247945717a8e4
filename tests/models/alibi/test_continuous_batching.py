"""Continuous batching (transformers' `generate_batch` / `init_continuous_batching` on a `PagedAttentionCache`): every
request's greedy tokens equal `generate()` on that request alone, whatever else shares its batches."""

import time

import pytest
import torch

from conftest import CONTINUOUS_BATCHING, NO_CONTINUOUS_BATCHING

if not CONTINUOUS_BATCHING:
    pytest.skip(NO_CONTINUOUS_BATCHING, allow_module_level=True)
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    MptConfig,
    MptForCausalLM,
)

from hf_alibi import convert
from hf_alibi.models.alibi.attention_alibi import plan_alibi_attention as _plan

NEW_TOKENS = 12
PROMPT_LENGTHS = (5, 17, 40, 1, 64)
# A small paged cache: by default transformers sizes it from free memory (GiBs on a CPU), seconds of zeroing a call
SMALL_CACHE = dict(page_size=16, num_blocks=64, max_batch_tokens=256)


def paged_plan(implementation, slopes, length, position_ids, paged_kwargs, **options):
    """The one planner's plan of a continuous-batching forward over `length` flattened tokens."""
    return _plan(
        implementation, slopes, 1, length, length, position_ids=position_ids, paged_kwargs=paged_kwargs, **options
    )


def greedy_config(max_new_tokens: int = NEW_TOKENS) -> GenerationConfig:
    # eos disabled: every request runs its full length, so decoding rows keep meeting prefill rows in batches
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def prompts(lengths=PROMPT_LENGTHS, vocab: int = 256) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def alone(model, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """`generate()` on one request: the reference (a dynamic cache, batch 1)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=greedy_config(max_new_tokens))
    return out[0, len(prompt) :].tolist()


def batched(model, inputs, cb_config=None, max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    cb_config = ContinuousBatchingConfig(**SMALL_CACHE) if cb_config is None else cb_config
    outputs = model.generate_batch(
        inputs=inputs,
        generation_config=greedy_config(max_new_tokens),
        continuous_batching_config=cb_config,
        progress_bar=False,
    )
    assert len(outputs) == len(inputs), f"{len(outputs)} results for {len(inputs)} requests"
    return [outputs[f"req_{i}"].generated_tokens for i in range(len(inputs))]


def assert_each_request_as_alone(model, inputs, cb_config=None):
    expected = [alone(model, prompt) for prompt in inputs]
    got = batched(model, inputs, cb_config)
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, f"request {i} ({len(inputs[i])} prompt tokens): {have} != generate()'s {want}"


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_generate_batch_gives_every_request_its_generate_tokens(make_model, backend):
    model = make_model(backend)
    assert_each_request_as_alone(model, prompts())
    assert model.config._attn_implementation == backend  # the manager switched back after the batch


def test_imported_bloom_and_mpt_decode_under_continuous_batching_as_alone():
    bloom = BloomForCausalLM(BloomConfig(vocab_size=256, hidden_size=48, n_layer=2, n_head=6)).eval()
    mpt = MptForCausalLM(
        MptConfig(vocab_size=256, d_model=48, n_layers=2, n_heads=6, no_bias=True, attn_config={"clip_qkv": 4.0})
    ).eval()
    for source in (bloom, mpt):
        model = convert(source).eval()
        assert_each_request_as_alone(model, prompts((7, 30, 2)))


def test_falcon_import_decodes_under_continuous_batching_as_alone():
    from transformers import FalconConfig, FalconForCausalLM

    falcon = FalconForCausalLM(
        FalconConfig(
            vocab_size=256,
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=6,
            alibi=True,
            bias=True,
            parallel_attn=False,
            multi_query=False,
            new_decoder_architecture=False,
        )
    ).eval()
    assert_each_request_as_alone(convert(falcon).eval(), prompts((9, 26)))


def test_jais_switches_decode_under_continuous_batching_as_alone(make_model):
    """The gated MLP, the 1/d attention scale, the muP multipliers and a slope scale, all on: the paged path too."""
    model = make_model(
        gated_mlp=True,
        activation_function="silu",
        n_inner=100,
        attn_scale_power=1.0,
        embedding_scale=3.0,
        logit_scale=0.4,
        alibi_scaling={"type": "linear", "factor": 2.0},
    )
    assert_each_request_as_alone(model, prompts((9, 26, 3)))


def test_long_prompts_split_over_several_batches_attend_their_earlier_chunks(make_model, record_plans):
    model = make_model()
    cb = ContinuousBatchingConfig(max_batch_tokens=16, num_blocks=64, page_size=16)
    inputs = prompts((70, 33, 4))
    with record_plans(model) as plans:
        assert_each_request_as_alone(model, inputs, cb)
    chunks = [s.plan for p in plans if p.path == "paged" for s in p.payload.segments]
    assert any(c.query_length > 1 and c.query_offset > 0 for c in chunks), "no prompt was continued in a later batch"
    assert max(p.query_length for p in plans if p.path == "paged") <= 16


def test_requests_joining_while_others_decode_get_their_own_tokens(make_model):
    model = make_model()
    inputs = prompts((20, 11, 35))
    expected = [alone(model, p, 40) for p in inputs]
    manager = model.init_continuous_batching(
        generation_config=greedy_config(40), continuous_batching_config=ContinuousBatchingConfig(**SMALL_CACHE)
    )
    manager.start()
    try:
        first = manager.add_request(inputs[0], max_new_tokens=40, streaming=True)
        # wait until the first request has produced tokens: it is decoding when the others arrive
        streamed = manager.get_result(first, timeout=30)
        assert streamed is not None and 0 < len(streamed.generated_tokens) < 40
        later = [manager.add_request(p, max_new_tokens=40) for p in inputs[1:]]
        results, deadline = {}, time.monotonic() + 60
        while len(results) < 3 and time.monotonic() < deadline:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=30)
    for request, want in zip([first, *later], expected):
        assert results.get(request) == want, f"{request}: {results.get(request)} != {want}"


def test_prefix_sharing_reuses_cached_blocks_and_keeps_each_requests_tokens(make_model, record_plans):
    model = make_model()
    shared = prompts((48,))[0]
    inputs = [shared + [7, 8, 9], shared + [11, 12]]
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=256, allow_block_sharing=True)
    expected = [alone(model, p) for p in inputs]
    manager = model.init_continuous_batching(generation_config=greedy_config(), continuous_batching_config=cb)
    manager.start()
    got = {}
    try:
        with record_plans(model) as plans:
            for prompt in inputs:  # one after the other: the second finds the first's full blocks cached
                request = manager.add_request(prompt, max_new_tokens=NEW_TOKENS)
                result = manager.get_result(request, timeout=60)
                got[request] = result.generated_tokens
    finally:
        manager.stop(block=True, timeout=30)
    assert list(got.values()) == expected
    prefills = [s.plan for p in plans if p.path == "paged" for s in p.payload.segments]
    # the second prompt's first 48 tokens (3 full blocks) were not recomputed: its prefill starts past them
    assert any(c.query_offset == 48 and c.query_length == len(inputs[1]) - 48 for c in prefills), [
        (c.query_offset, c.query_length) for c in prefills
    ]


def test_certified_skipping_under_continuous_batching_keeps_the_tokens(make_model, record_plans):
    model = make_model(alibi_skip_eps=1e-7)
    with record_plans(model) as plans:
        assert_each_request_as_alone(model, prompts((300, 9, 40)))
    skipping = [s.plan for p in plans if p.path == "paged" for s in p.payload.segments if "certified" in s.plan.path]
    assert any(c.query_length == 1 for c in skipping), "decoding rows did not skip"
    assert any(c.query_length > 1 for c in skipping), "prefill did not skip"


@pytest.mark.parametrize("backend, skip_eps", [("sdpa", "auto"), ("eager", "auto"), ("sdpa", 1e-7)])
def test_slope_interpolation_gives_each_request_the_scale_of_its_own_keys(make_model, backend, skip_eps):
    """`alibi_scaling.train_seq_len` 8: every request decodes past it, each at its own key count, as alone."""
    model = make_model(backend, alibi_scaling={"type": "linear", "train_seq_len": 8}, alibi_skip_eps=skip_eps)
    assert_each_request_as_alone(model, prompts())


@pytest.mark.parametrize("train_seq_len", [None, 6])
def test_paged_attention_gives_each_request_its_own_distances(make_model, train_seq_len):
    """Against the model's ordinary attention on each request alone and the float64 reference: prefill rows, a
    continued chunk, decoding rows and a zero-length padding entry, in one flattened batch; with slope interpolation,
    each request at the scale of its own key count."""
    from alibi_reference import interpolated_slopes, reference_attention
    from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention

    heads, dim = 12, 8
    slopes = make_model().transformer.alibi_slopes
    requests = [(5, 5), (1, 9), (3, 20), (1, 1), (0, 0), (1, 30)]  # (new tokens, keys) per request
    cu_q = torch.tensor([0] + [q for q, _ in requests]).cumsum(0)
    cu_k = torch.tensor([0] + [k for _, k in requests]).cumsum(0)
    positions = torch.cat([torch.arange(k - q, k) for q, k in requests])[None]
    query = torch.randn(1, heads, int(cu_q[-1]), dim)
    key, value = torch.randn(2, 1, heads, int(cu_k[-1]), dim)
    kwargs = {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": {"full_attention": cu_k}, "read_index": [], "write_index": []}
    for backend in ("sdpa", "eager"):
        plan = paged_plan(backend, slopes, query.shape[2], positions, kwargs, train_seq_len=train_seq_len)
        assert plan.payload.decode is not None and plan.payload.decode.rows.numel() == 3
        got, _ = alibi_attention(query, key, value, plan, dim**-0.5)  # (1, T, H, D)
        for r, (q, k) in enumerate(requests):
            if q == 0:
                continue
            rows, keys = slice(int(cu_q[r]), int(cu_q[r + 1])), slice(int(cu_k[r]), int(cu_k[r + 1]))
            single = plan_alibi_attention("eager", slopes, 1, q, k, k - q, train_seq_len=train_seq_len)
            want, _ = alibi_attention(query[:, :, rows], key[:, :, keys], value[:, :, keys], single, dim**-0.5)
            torch.testing.assert_close(got[:, rows], want, atol=2e-6, rtol=1e-5, msg=f"{backend}, request {r}")
            exact = reference_attention(
                query[:, :, rows],
                key[:, :, keys],
                value[:, :, keys],
                scale=dim**-0.5,
                slopes=interpolated_slopes(slopes, k, train_seq_len=train_seq_len),
            )[0]
            torch.testing.assert_close(got[:, rows].double(), exact.transpose(1, 2), atol=2e-6, rtol=1e-5)
        # a tensor-parallel rank's heads: the same rows, the slice of heads (their own slopes)
        heads_4_to_8 = alibi_attention(query[:, 4:8], key[:, 4:8], value[:, 4:8], plan, dim**-0.5, heads=slice(4, 8))
        torch.testing.assert_close(heads_4_to_8[0], got[:, :, 4:8], atol=2e-6, rtol=1e-5)


def test_paged_plans_refuse_what_they_cannot_run_by_name(make_model):
    slopes = make_model().transformer.alibi_slopes
    cu = torch.tensor([0, 3])
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": {"full_attention": cu}, "read_index": [], "write_index": []}
    with pytest.raises(ValueError, match="flex_attention"):
        paged_plan("flex_attention", slopes, 3, None, kwargs)
    with pytest.raises(ValueError, match="read_index"):
        paged_plan("sdpa", slopes, 3, None, {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu})
    with pytest.raises(ValueError, match="position_ids"):
        paged_plan("sdpa", slopes, 3, torch.tensor([[0, 1, 5]]), kwargs)
    with pytest.raises(ValueError, match="keys"):
        short = dict(kwargs, cu_seq_lens_k={"full_attention": torch.tensor([0, 2])})
        paged_plan("sdpa", slopes, 3, None, short)
    with pytest.raises(ValueError, match="sliding_attention"):
        hybrid = dict(kwargs, cu_seq_lens_k={"full_attention": cu, "sliding_attention": cu})
        paged_plan("sdpa", slopes, 3, None, hybrid)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and flash-attn")
def test_flash_attention_2_continuous_batching_matches_generate(make_model):
    pytest.importorskip("flash_attn")
    model = make_model("flash_attention_2").to("cuda", torch.bfloat16)
    reference = make_model("sdpa").to("cuda", torch.bfloat16)
    inputs = prompts()
    expected = [alone(reference, [*p]) for p in inputs]
    got = batched(model, inputs)
    assert got == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device and flash-attn")
def test_flash_attention_2_gives_each_request_the_scale_of_its_own_keys(make_model):
    """FlashAttention-2's per-sequence `alibi_slopes` (R, H): the varlen kernel over requests, and its paged decode."""
    pytest.importorskip("flash_attn")
    scaling = {"type": "linear", "train_seq_len": 8}
    model = make_model("flash_attention_2", alibi_scaling=scaling).to("cuda", torch.bfloat16)
    reference = make_model("sdpa", alibi_scaling=scaling).to("cuda", torch.bfloat16)
    inputs = prompts()
    expected = [alone(reference, [*p]) for p in inputs]
    assert batched(model, inputs) == expected
