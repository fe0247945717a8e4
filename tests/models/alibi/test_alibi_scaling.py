"""Slope interpolation (`alibi_scaling`): every path a CPU runs uses the float64 reference's `interpolated_slopes` of
the forward's own key count K (cached + new, padding included), cached decoding computes each token at the scale of
the forward it was new in (Jais's and BTLM's semantics), static caches count their filled keys, and the config
refuses bad values naming the field."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import StaticCache

from alibi_reference import cached_row_slopes, interpolated_slopes, reference_logits
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.transformers_compat import output_cache

TRAIN = 8  # train_seq_len of the tiny models: the inputs run past it
SCALING = {"type": "linear", "train_seq_len": TRAIN}
ATOL = 2e-5  # fp32 against float64; measured <= 5e-7
# path -> (attn_implementation, config overrides) that select it; the paths each forward took are checked
BACKENDS = {
    "eager": ("eager", {}),
    "sdpa_split": ("sdpa", {}),
    "sdpa_bank": ("sdpa", {"alibi_sdpa_split": False, "alibi_sdpa_query_chunk": 4}),
    "sdpa_certified": ("sdpa", {"alibi_skip_eps": 1e-7}),
    "flex_attention": ("flex_attention", {}),
}
PREFILL_PATHS = {
    "eager": {"eager"},
    "sdpa_split": {"sdpa_split"},
    "sdpa_bank": {"sdpa_bank"},
    "sdpa_certified": {"sdpa_split_certified"},
    "flex_attention": {"flex_attention"},
}


def scaled_model(make_model, backend: str = "sdpa_split", **overrides) -> AlibiGPT2LMHeadModel:
    implementation, switches = BACKENDS[backend]
    return make_model(implementation, alibi_scaling=SCALING, **switches, **overrides)


def expected_logits(model, ids, mask, forward_lengths) -> torch.Tensor:
    """The float64 reference, each row with the interpolated slopes of the forward it was computed in."""
    config = model.config
    slopes = cached_row_slopes(get_alibi_slopes(config.n_head), forward_lengths, train_seq_len=TRAIN)  # (H, L)
    return reference_logits(
        model.state_dict(),
        ids,
        n_layer=config.n_layer,
        n_head=config.n_head,
        slopes=slopes,
        attn_scale=(config.n_embd // config.n_head) ** -0.5,
        attention_mask=mask,
    )


def cached_run(model, ids, mask, prefill: int, cache=None, step=None) -> torch.Tensor:
    """Logits (B, L, V) of a prefill of `prefill` tokens, then one cached decoding step per remaining token; a static
    `cache` takes `mask` as long as its buffer in every forward (as generate() pads it)."""
    step, static = model if step is None else step, cache is not None
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=mask if static else mask[:, :prefill], cache=cache, use_cache=True)
        logits, cache = [out.logits], output_cache(out)
        for t in range(prefill, ids.shape[1]):
            step_mask = mask if static else mask[:, : t + 1]
            out = step(ids[:, t : t + 1], attention_mask=step_mask, cache=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)  # (B, L, V)


def padded_batch(random_ids, length: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(2, length)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: counted in K, as Jais's key length counts it
    return ids, mask


def assert_close_on_real_rows(got, want, mask, what):
    real = mask.bool()
    difference = float((got.double() - want)[real].abs().max())
    assert difference <= ATOL, f"{what}: largest difference {difference:.2e} from the float64 reference"


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_path_divides_the_slopes_by_its_forwards_key_count_prefill_and_cached(
    make_model, random_ids, record_plans, backend
):
    model = scaled_model(make_model, backend)
    ids, mask = padded_batch(random_ids)
    with record_plans(model) as plans, torch.no_grad():
        prefill = model(ids, attention_mask=mask).logits
    assert {plan.path for plan in plans} == PREFILL_PATHS[backend]
    assert_close_on_real_rows(prefill, expected_logits(model, ids, mask, [13]), mask, "prefill at K = 13")
    unscaled = reference_logits(
        model.state_dict(),
        ids,
        n_layer=2,
        n_head=12,
        slopes=get_alibi_slopes(12),
        attn_scale=8**-0.5,
        attention_mask=mask,
    )  # what ignoring the rule gives
    assert float((unscaled - prefill.double())[mask.bool()].abs().max()) > 100 * ATOL, "the test cannot tell"
    cached = cached_run(model, ids, mask, prefill=10)
    assert_close_on_real_rows(cached, expected_logits(model, ids, mask, [10, 1, 1, 1]), mask, "cached decoding")


def test_a_decoding_step_equals_only_the_last_row_of_a_full_forward_over_its_keys(make_model, random_ids):
    """One layer (the same keys and values either way): the step at K keys is the full forward's last row at K; the
    earlier rows past train_seq_len differ, computed at their own forward's scale."""
    model = scaled_model(make_model, n_layer=1)
    ids, mask = padded_batch(random_ids)
    cached = cached_run(model, ids, mask, prefill=10)
    for length in (11, 12, 13):
        with torch.no_grad():
            full = model(ids[:, :length], attention_mask=mask[:, :length]).logits
        torch.testing.assert_close(cached[:, length - 1], full[:, -1], atol=1e-5, rtol=0)
        earlier = (cached[:, TRAIN : length - 1] - full[:, TRAIN:-1]).abs()  # rows at K' in (TRAIN, length)
        assert float(earlier.amax(-1).min()) > 1e-3, f"earlier rows of the K = {length} forward did not change"


@pytest.mark.parametrize("backend", ["eager", "sdpa_split", "sdpa_certified", "flex_attention"])
def test_a_static_cache_scales_by_its_filled_keys_not_its_buffer(make_model, random_ids, backend):
    model = scaled_model(make_model, backend)
    ids, mask = padded_batch(random_ids)
    cache = StaticCache(config=model.config, max_cache_len=32)
    buffer_mask = F.pad(mask, (0, 32 - mask.shape[1]), value=1)  # one shape for every step, as generate() pads it
    cached = cached_run(model, ids, buffer_mask, prefill=10, cache=cache)
    assert_close_on_real_rows(cached, expected_logits(model, ids, mask, [10, 1, 1, 1]), mask, "static cache")


@pytest.mark.slow
def test_a_compiled_static_cache_step_scales_in_the_graph_without_recompiling(make_model, random_ids):
    """fullgraph=True fails on a host read: the scale of K is a tensor op on the cache's 0-d count."""
    model = scaled_model(make_model, "sdpa_split")
    ids, mask = padded_batch(random_ids)
    cache = StaticCache(config=model.config, max_cache_len=32)
    buffer_mask = F.pad(mask, (0, 32 - mask.shape[1]), value=1)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(model.forward, fullgraph=True)
    cached = cached_run(model, ids, buffer_mask, prefill=9, cache=cache, step=step)
    assert_close_on_real_rows(cached, expected_logits(model, ids, mask, [9, 1, 1, 1, 1]), mask, "compiled steps")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, "decoding steps recompiled"


def test_an_exported_model_scales_by_its_dynamic_length(make_model, random_ids):
    model = scaled_model(make_model, use_cache=False)
    ids, mask = padded_batch(random_ids, 9)
    length = torch.export.Dim("length", min=2, max=4096)
    program = torch.export.export(
        model,
        (),
        kwargs=dict(input_ids=ids, attention_mask=mask),
        dynamic_shapes=dict(input_ids={1: length}, attention_mask={1: length}),
    )
    for new_length in (5, 13, 40):
        ids, mask = padded_batch(random_ids, new_length)
        with torch.no_grad():
            exported = program.module()(input_ids=ids, attention_mask=mask).logits
        assert_close_on_real_rows(exported, expected_logits(model, ids, mask, [new_length]), mask, f"{new_length}")


def test_a_tensor_parallel_ranks_heads_get_their_own_scaled_slopes():
    slopes = get_alibi_slopes(12)
    query, key, value = torch.randn(3, 2, 12, 20, 8)
    plan = plan_alibi_attention("sdpa", slopes, 2, 20, 20, train_seq_len=TRAIN)
    torch.testing.assert_close(plan.slopes.double(), interpolated_slopes(slopes, 20, train_seq_len=TRAIN))
    full, _ = alibi_attention(query, key, value, plan, 8**-0.5)  # (B, q, H, D)
    rank = plan.for_heads(slice(4, 8))
    torch.testing.assert_close(rank.slopes, plan.slopes[4:8], atol=0, rtol=0)
    part, _ = alibi_attention(query[:, 4:8], key[:, 4:8], value[:, 4:8], rank, 8**-0.5)
    torch.testing.assert_close(part, full[:, :, 4:8], atol=2e-6, rtol=1e-5)


def test_static_factor_and_length_rule_leave_short_inputs_and_the_buffer_as_documented(make_model, random_ids):
    static = make_model(alibi_scaling={"type": "linear", "factor": 4.0})
    torch.testing.assert_close(static.transformer.alibi_slopes, get_alibi_slopes(12) / 4, atol=0, rtol=0)
    model, plain = scaled_model(make_model), make_model()
    torch.testing.assert_close(model.transformer.alibi_slopes, get_alibi_slopes(12), atol=0, rtol=0)
    ids = random_ids(1, TRAIN)  # K = train_seq_len: scale 1, the plain model's logits exactly
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize(
    "scaling, named",
    [
        ({"type": "linear", "train_seq_len": 0}, r"alibi_scaling\.train_seq_len.*0"),
        ({"type": "linear", "train_seq_len": -4}, r"alibi_scaling\.train_seq_len.*-4"),
        ({"type": "linear", "train_seq_len": 2.5}, r"alibi_scaling\.train_seq_len.*2\.5"),
        ({"type": "linear", "factor": 0.0}, r"alibi_scaling\.factor.*0\.0"),
        ({"type": "linear", "factor": -2.0}, r"alibi_scaling\.factor.*-2\.0"),
        ({"type": "linear", "factor": float("inf")}, r"alibi_scaling\.factor.*inf"),
        ({"type": "dynamic", "factor": 2.0}, r"alibi_scaling\.type.*'dynamic'"),
        ({"factor": 2.0}, r"alibi_scaling\.type.*None"),
        ({"type": "linear", "factor": 2.0, "train_seq_len": 8}, r"alibi_scaling takes.*train_seq_len"),
        ({"type": "linear"}, r"alibi_scaling takes.*'type': 'linear'"),
        ({"type": "linear", "factor": 2.0, "original_max_position_embeddings": 8}, r"alibi_scaling.*original_max"),
        ("linear", r"alibi_scaling must be None or a dict.*'linear'"),
    ],
)
def test_bad_alibi_scaling_is_refused_naming_the_field_and_value(make_config, scaling, named):
    with pytest.raises(ValueError, match=named):
        make_config(alibi_scaling=scaling)


def test_the_former_static_switch_still_loads_and_maps_to_alibi_scaling(make_config, tmp_path):
    saved = make_config().to_dict()
    del saved["alibi_scaling"]
    (tmp_path / "config.json").write_text(json.dumps(saved | {"alibi_scaling_factor": 2.0}))
    config = AlibiGPT2Config.from_pretrained(tmp_path)
    assert config.alibi_scaling == {"type": "linear", "factor": 2.0} and config.alibi_scaling_factor == 2.0
    assert "alibi_scaling_factor" not in config.to_dict()  # saved under the new name only
    (tmp_path / "config.json").write_text(json.dumps(saved | {"alibi_scaling_factor": 1.0}))
    assert AlibiGPT2Config.from_pretrained(tmp_path).alibi_scaling is None  # what every older config carries
    with pytest.raises(ValueError, match="alibi_scaling_factor.*alibi_scaling.*both"):
        make_config(alibi_scaling_factor=2.0, alibi_scaling=SCALING)
    config = make_config(alibi_scaling=SCALING)
    assert config.alibi_scaling_factor == 1.0  # the alias reads the static divisor: none with the length rule
    loaded = AlibiGPT2Config.from_dict(config.to_dict())
    assert loaded.alibi_scaling == SCALING and isinstance(loaded.alibi_scaling["train_seq_len"], int)


@pytest.mark.slow
def test_a_compiled_flex_model_scales_as_the_reference_on_cpu(make_model, random_ids):
    """FlexAttention's fused kernel (inductor's CPU template) reads the forward's scaled slopes in its score_mod."""
    model = scaled_model(make_model, "flex_attention")
    ids, mask = padded_batch(random_ids)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model)(ids, attention_mask=mask).logits
    assert_close_on_real_rows(compiled, expected_logits(model, ids, mask, [13]), mask, "compiled flex")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_attention_2_scales_prefill_and_cached_decoding_as_eager_in_bf16(make_model, random_ids):
    """The kernel's `alibi_slopes` are the plan's scaled ones: dense (no padding) and varlen (left padding)."""
    pytest.importorskip("flash_attn")
    ids, mask = padded_batch(random_ids, 24)
    for batch_mask in (torch.ones_like(mask), mask):
        logits = {}
        for backend in ("eager", "flash_attention_2"):
            model = scaled_model(make_model, "eager").to("cuda", torch.bfloat16)
            model.set_attn_implementation(backend)
            logits[backend] = cached_run(model, ids.cuda(), batch_mask.cuda(), prefill=20).float()
        real = batch_mask.bool().cuda()
        scale = logits["eager"][real].abs().max().item()
        torch.testing.assert_close(
            logits["flash_attention_2"][real], logits["eager"][real], atol=3e-2 * max(scale, 1.0), rtol=0
        )
