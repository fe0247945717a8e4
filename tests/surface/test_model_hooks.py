"""transformers' hooks the shipped model stands on beyond its public API, one test each: if upstream renames or
changes one, the model would not fail but silently lose a behaviour (backend switching, fp32 slopes, weights kept on
loading, the static-cache mask). Each names the hook and checks that it exists as used and does what the model needs."""

import inspect

import pytest
import torch
import transformers
from transformers import (
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    StaticCache,
)
from transformers import initialization as init
from transformers.utils.deprecation import deprecate_kwarg

from conftest import CONTINUOUS_BATCHING, NO_CONTINUOUS_BATCHING
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, AlibiGPT2Model, get_alibi_slopes
from hf_alibi.models.alibi import modeling_alibi_gpt2
from hf_alibi.models.alibi.transformers_compat import (
    CACHE_FIELD,
    POSITIONAL_CACHE,
    cache_key_length,
    output_cache,
    transformers_at_least,
    update_cache,
)
from surface_helpers import parameters


@pytest.mark.skipif(CACHE_FIELD != "cache", reason="before 5.24 past_key_values is the current name")
def test_deprecate_kwarg_renames_past_key_values_to_cache_and_warns():
    """5.24+: `transformers.utils.deprecation.deprecate_kwarg(old_name, version, new_name=...)` on both forwards."""
    assert parameters(deprecate_kwarg)[:3] == ["old_name", "version", "new_name"], (
        f"transformers.utils.deprecation.deprecate_kwarg changed its signature: {parameters(deprecate_kwarg)}"
    )
    model = AlibiGPT2Model(AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)).eval()
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
        with pytest.warns(FutureWarning, match="past_key_values"):
            out = model(torch.tensor([[6]]), past_key_values=cache)
    assert output_cache(out) is cache and cache.get_seq_length() == 4, "deprecate_kwarg did not pass it as cache"


def test_set_attn_implementation_asks_the_classmethod_switchable_attention_answers():
    """`PreTrainedModel._can_set_attn_implementation` guesses from the model file's source (4.57-5.13 only that;
    5.14+ after a cached answer), and the guess refuses our file: `SwitchableAttention` answers instead."""
    guess = PreTrainedModel.__dict__.get("_can_set_attn_implementation")
    assert isinstance(guess, classmethod), "PreTrainedModel._can_set_attn_implementation is no longer a classmethod"

    class Guessed(AlibiGPT2LMHeadModel):
        _can_set_attn_implementation = guess
        _can_set_attn_implementation_cached_value = None  # 5.14+: no cached answer, so it guesses

    Guessed.__module__ = modeling_alibi_gpt2.__name__  # the guess reads our file
    assert Guessed._can_set_attn_implementation() is False, "the source guess now accepts our file: drop the mixin?"
    model = AlibiGPT2LMHeadModel(AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8))
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager", "set_attn_implementation no longer sets _attn_implementation"


def test_apply_override_keeps_slopes_exact_fp32_through_every_cast(tmp_path):
    """`torch.nn.Module._apply(fn, recurse)` is what `.to`, `.half`, `.bfloat16` and transformers' casts go through."""
    assert parameters(torch.nn.Module._apply) == ["self", "fn", "recurse"], (
        f"torch.nn.Module._apply changed its signature {parameters(torch.nn.Module._apply)}: our override in "
        "AlibiGPT2Model._apply must follow"
    )
    config = AlibiGPT2Config(vocab_size=16, n_embd=12, n_layer=1, n_head=12, n_positions=8)
    exact = get_alibi_slopes(12)
    casts = {
        "to(bfloat16)": lambda m: m.to(torch.bfloat16),
        "to(dtype=float16)": lambda m: m.to(dtype=torch.float16),
        "half()": lambda m: m.half(),
        "bfloat16()": lambda m: m.bfloat16(),
    }
    for name, cast in casts.items():
        model = cast(AlibiGPT2LMHeadModel(config))
        slopes = model.transformer.alibi_slopes
        assert slopes.dtype == torch.float32 and torch.equal(slopes, exact), f"_apply override lost the slopes: {name}"
    AlibiGPT2LMHeadModel(config).save_pretrained(tmp_path)
    loaded = AlibiGPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    slopes = loaded.transformer.alibi_slopes
    assert slopes.dtype == torch.float32 and torch.equal(slopes, exact), "from_pretrained(dtype=bfloat16) slopes"


def test_transformers_initialization_functions_skip_tensors_already_loaded():
    """`transformers.initialization` (`normal_`, `zeros_`, `ones_`, `copy_`) in `_init_weights`: they must leave
    tensors that loading flagged `_is_hf_initialized` alone, or `from_pretrained` would overwrite loaded weights."""
    for name, expected in {
        "normal_": ["tensor", "mean", "std"],
        "zeros_": ["tensor"],
        "ones_": ["tensor"],
        "copy_": ["tensor", "other"],
    }.items():
        assert hasattr(init, name), f"transformers.initialization.{name} is gone"
        assert parameters(getattr(init, name))[: len(expected)] == expected, f"transformers.initialization.{name}"
    fresh, loaded = torch.zeros(3), torch.zeros(3)
    loaded._is_hf_initialized = True
    for tensor in (fresh, loaded):
        init.copy_(tensor, torch.ones(3))
        init.normal_(tensor, mean=5.0, std=0.0)
    assert torch.equal(fresh, torch.full((3,), 5.0)), "transformers.initialization no longer initialises"
    assert torch.equal(loaded, torch.zeros(3)), "transformers.initialization overwrites tensors flagged as loaded"


def test_class_flags_we_set_are_attributes_transformers_defines():
    """A renamed flag would leave ours set on nothing: the backend gates, compile and tying would fall back."""
    since = {"_compatible_flash_implementations": "5.3"}  # the rest: every supported release
    for name in (
        "_supports_sdpa",
        "_supports_flex_attn",
        "_supports_flash_attn",
        "_compatible_flash_implementations",
        "_can_compile_fullgraph",
        "_no_split_modules",
        "_tied_weights_keys",
        "config_class",
        "base_model_prefix",
        "supports_gradient_checkpointing",
    ):
        if transformers_at_least(since.get(name, "5.0")):
            assert hasattr(PreTrainedModel, name), f"transformers' PreTrainedModel no longer defines {name}"
    if transformers_at_least("5.4"):  # before: ConfigBase's own
        assert hasattr(PretrainedConfig, "__post_init__"), "PretrainedConfig.__post_init__ (our configs' hook) is gone"
    with pytest.raises(ValueError, match="n_head"):  # our __post_init__ ran: it validates
        AlibiGPT2Config(n_head=0)
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    model = AlibiGPT2LMHeadModel._from_config(config, attn_implementation="flex_attention")
    assert model.config._attn_implementation == "flex_attention", "config._attn_implementation is not the backend"
    assert model.lm_head.weight is model.transformer.wte.weight, "_tied_weights_keys no longer ties lm_head to wte"
    assert model.loss_function.__name__ == "ForCausalLMLoss", "loss_type 'ForCausalLM' no longer picks the causal loss"


def test_cache_get_seq_length_and_key_length_mean_what_the_model_reads():
    """`get_seq_length()`: cached tokens (a 0-d tensor for a static cache); `cache_key_length` (`get_mask_sizes`, by
    query length from 5.4, by cache positions before): the keys a layer reads; `update_cache` writes at the offset."""
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    keys = torch.ones(1, 2, 5, 4)  # not zeros: a 4.57-5.3 static cache counts its nonzero slots
    static, dynamic = StaticCache(config=config, max_cache_len=12), DynamicCache(config=config)
    expected = ["cache_position" if POSITIONAL_CACHE else "query_length", "layer_idx"]
    assert parameters(static.get_mask_sizes)[:2] == expected, "Cache.get_mask_sizes signature"
    for cache in (static, dynamic):
        update_cache(cache, keys, keys, 0, 0)
        update_cache(cache, keys[:, :, :1], keys[:, :, :1], 0, 5)
    assert isinstance(static.get_seq_length(), torch.Tensor) and int(static.get_seq_length()) == 6, (
        "StaticCache.get_seq_length() is no longer a 0-d tensor of cached tokens (compiled decoding relies on it)"
    )
    assert dynamic.get_seq_length() == 6
    assert cache_key_length(static, 1, 6) == 12, "a static cache's key length is no longer its buffer length"
    assert cache_key_length(dynamic, 1, 6) == 7, "a dynamic cache's key length is no longer cached + q"


def test_generate_calls_our_create_masks_for_generate_with_a_static_cache(monkeypatch):
    """`GenerationMixin` asks the model's `create_masks_for_generate` for compileable caches; ours keeps the mask 2-D
    and pads it to the cache's length (one shape for every decoding step)."""
    assert "create_masks_for_generate" in inspect.getsource(GenerationMixin), (
        "transformers' generate no longer calls create_masks_for_generate: the static-cache mask is not padded"
    )
    seen, original = [], AlibiGPT2LMHeadModel.create_masks_for_generate

    def spy(self, *args, **kwargs):
        seen.append(original(self, *args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(AlibiGPT2LMHeadModel, "create_masks_for_generate", spy)
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8, pad_token_id=0)
    model = AlibiGPT2LMHeadModel(config).eval()
    ids = torch.tensor([[0, 3, 4], [5, 6, 7]])
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=(ids != 0).long(),
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
        )
    assert seen, "generate did not call AlibiGPT2LMHeadModel.create_masks_for_generate"
    assert all(mask.dim() == 2 and mask.shape == seen[0].shape for mask in seen), [tuple(m.shape) for m in seen]


@pytest.mark.parametrize("family", ["bloom", "mpt", "falcon"])
def test_model_files_alibi_tensor_builders_still_give_each_familys_slopes(family):
    """`hf_alibi.conversion` reads each source's own slopes from a function inside transformers' model file
    (`modeling_bloom.build_alibi_tensor`, `modeling_mpt.build_mpt_alibi_tensor`, `modeling_falcon.build_alibi_tensor`):
    not public API, so a change of its layout or meaning must fail here, not in a converted checkpoint."""
    from hf_alibi.conversion import bloom, falcon, mpt

    exact = get_alibi_slopes(12)
    if family == "falcon":  # m_h rounded to bf16, then divided by sqrt(head_dim)
        got, want, atol = falcon.falcon_slopes(12, 16), exact / 4, 1e-2 * float(exact.max())
    else:
        got, want, atol = (bloom.bloom_slopes if family == "bloom" else mpt.mpt_slopes)(12), exact, 1e-7
    assert got.shape == (12,), f"{family}'s alibi tensor builder changed its layout: {tuple(got.shape)}"
    difference = (got - want).abs().max().item()
    assert difference <= atol, f"{family}'s alibi tensor builder no longer gives its slopes (largest diff {difference})"


def test_special_token_ids_are_none_where_a_config_has_none_and_its_own_where_it_has_them():
    """`hf_alibi.conversion` copies each source config's special token ids: 5.0's `MptConfig` has no such attributes
    unless given (4.57 and 5.1+ default them to None), GPT-2's config has its own defaults on every release."""
    from transformers import GPT2Config, MptConfig

    from hf_alibi._transformers_compat import special_token_ids

    assert special_token_ids(MptConfig()) == {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    given = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert special_token_ids(MptConfig(**given)) == given
    assert special_token_ids(MptConfig.from_dict(MptConfig(**given).to_dict())) == given
    assert special_token_ids(GPT2Config()) == {"bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None}


def test_config_from_dict_keeps_a_gpt_neox_rotary_share_when_rebuilt_and_when_loaded(tmp_path):
    """The rotary baseline and its arms: 5.0-5.4 rebuild a GPT-NeoX config at the legacy `rotary_pct` (0.25 by
    default) whatever its `rope_parameters` say; `config_from_dict` keeps the share through every way of rebuilding."""
    from transformers import GPT2Config, GPTNeoXConfig

    from hf_alibi._transformers_compat import config_from_dict

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    config = config_from_dict(GPTNeoXConfig, dict(hidden_size=64, num_attention_heads=4, rope_parameters=rope))
    config.save_pretrained(tmp_path)
    loaded = GPTNeoXConfig.from_pretrained(tmp_path)
    for rebuilt in (config, loaded, config_from_dict(GPTNeoXConfig, {**loaded.to_dict(), "vocab_size": 99})):
        assert rebuilt.rope_parameters["partial_rotary_factor"] == 0.5, rebuilt.rope_parameters
    assert config_from_dict(GPT2Config, {"n_embd": 64}).n_embd == 64  # any other config: from_dict


def test_auto_tokenizer_raises_the_error_that_failed_it_not_one_about_protobuf(tmp_path):
    """`conversion.load_tokenizer` reads a ValueError as "no tokenizer here": 5.0-5.5 without protobuf raise an
    ImportError naming protobuf in its place."""
    from hf_alibi._transformers_compat import auto_tokenizer

    AlibiGPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16).save_pretrained(tmp_path)  # no vocabulary
    with pytest.raises(ValueError, match="tokenizer"):
        auto_tokenizer(tmp_path)


def test_named_tokenizer_inputs_are_the_named_class_inputs_unless_listed():
    """An imported encoder's tokenizer_config.json lists its inputs: 5.0-5.2 would give an `alibi_bert` folder's
    tokenizer the generic class's (no token_type_ids)."""
    from hf_alibi._transformers_compat import named_tokenizer_inputs

    bert = ["input_ids", "token_type_ids", "attention_mask"]
    assert named_tokenizer_inputs({"tokenizer_class": "BertTokenizer"}) == bert
    assert named_tokenizer_inputs({"tokenizer_class": "BertTokenizerFast"}) == bert
    assert named_tokenizer_inputs({"tokenizer_class": "GPT2Tokenizer"}) == ["input_ids", "attention_mask"]
    assert named_tokenizer_inputs({"tokenizer_class": "BertTokenizer", "model_input_names": ["input_ids"]}) is None
    assert named_tokenizer_inputs({"tokenizer_class": "NoSuchTokenizer"}) is None
    assert named_tokenizer_inputs({}) is None


@pytest.mark.skipif(not CONTINUOUS_BATCHING, reason=NO_CONTINUOUS_BATCHING)
def test_paged_attention_cache_update_takes_the_batch_kwargs_and_returns_each_requests_keys_in_order(make_model):
    """Continuous batching (`attention_paged.py`): the model is called with a `PagedAttentionCache` from
    `transformers.generation.continuous_batching` and the kwargs `PAGED_KWARGS` names; `cache.update(key, value,
    layer_idx, kwargs)` returns every request's keys, each request's positions 0..k_r - 1 in order, split by
    `cu_seq_lens_k["full_attention"]`. Recorded from a real `generate_batch` call."""
    from transformers.generation.continuous_batching import PagedAttentionCache

    from hf_alibi.models.alibi.attention_paged import PAGED_KWARGS

    assert parameters(PagedAttentionCache.update)[:5] == ["self", "key_states", "value_states", "layer_idx", "kwargs"]
    model = make_model()
    seen, forward = [], model.transformer.forward

    def recording(*args, **kwargs):
        seen.append({name: kwargs.get(name) for name in ("cache", "position_ids", *PAGED_KWARGS)})
        return forward(*args, **kwargs)

    model.transformer.forward = recording
    model.generate_batch(
        inputs=[[5, 6, 7], [8, 9, 10, 11, 12]],
        progress_bar=False,
        generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=-1),
        continuous_batching_config=transformers.ContinuousBatchingConfig(
            page_size=16, num_blocks=16, max_batch_tokens=64
        ),
    )
    first = seen[0]
    assert isinstance(first["cache"], PagedAttentionCache), "generate_batch no longer passes its paged cache as cache="
    assert set(first["cu_seq_lens_k"]) == {"full_attention"}, first["cu_seq_lens_k"]
    assert first["read_index"] is not None and first["write_index"] is not None
    decoding = seen[-1]  # both requests decode: one token each, their keys read back from the pages
    cu_q, cu_k = decoding["cu_seq_lens_q"].tolist(), decoding["cu_seq_lens_k"]["full_attention"].tolist()
    assert [b - a for a, b in zip(cu_q, cu_q[1:])] == [1, 1], cu_q
    assert sorted(b - a for a, b in zip(cu_k, cu_k[1:])) == [4, 6], cu_k  # prompt + first token
    assert sorted(decoding["position_ids"][0].tolist()) == [3, 5]  # each request's own last position


def test_find_packed_sequence_indices_numbers_the_documents_where_positions_restart():
    """`transformers.masking_utils.find_packed_sequence_indices`: packed rows' documents (attention_plan's
    `packed_documents` calls it), None for plain positions outside tracing."""
    from transformers.masking_utils import find_packed_sequence_indices

    packed = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
    assert find_packed_sequence_indices(packed).tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert find_packed_sequence_indices(torch.arange(6)[None]) is None, "plain positions are no longer None"


def test_capture_outputs_and_can_return_tuple_record_what_the_model_no_longer_collects_itself():
    """`model_inputs` (5.2+: `utils.output_capturing.capture_outputs`; before: `check_model_inputs`, with
    `_can_record_outputs`) and `can_return_tuple`: every block's input and the final normed state, each layer's
    attention weights (eager, planned once), and a tuple for `return_dict=False`."""
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=2, n_head=2, n_positions=8, embd_pdrop=0.0)
    model = AlibiGPT2LMHeadModel(config).eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_attentions=True)
        as_tuple = model(ids, return_dict=False)
    states = out.hidden_states
    assert len(states) == 3 and len(out.attentions) == 2, (len(states), len(out.attentions))
    torch.testing.assert_close(states[0], model.transformer.wte(ids))  # the first block's input: the embeddings
    torch.testing.assert_close(states[-1], model.transformer(ids).last_hidden_state)  # after ln_f, as GPT-2's
    for weights in out.attentions:  # (B, H, q, kv): causal rows of a softmax
        torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 4))
        assert weights.triu(1).abs().max() == 0
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], out.logits)


def test_generate_reads_the_forward_signature_through_deprecate_kwarg_and_finds_what_it_passes():
    """`GenerationMixin` reads `inspect.signature(self.forward)` (every step, for a model registered with the Auto
    classes): through `deprecate_kwarg`'s wrapper it must see the real parameters, as for transformers' own models
    (no signature is patched on our forwards)."""
    model = AlibiGPT2LMHeadModel(AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8))
    assert "__signature__" not in vars(AlibiGPT2LMHeadModel.forward), "a signature is patched on the forward"
    names = parameters(model.forward)
    assert {"cache", "attention_mask", "position_ids", "logits_to_keep"} <= set(names), names  # `cache`: every release
    assert model._supports_logits_to_keep(), "generate() no longer finds logits_to_keep"
    if transformers_at_least("5.3"):  # where generate asks it first
        assert model.is_remote_code()
