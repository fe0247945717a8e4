"""The parts of transformers (and torch) that hf_alibi relies on beyond their documented public API, one test each.

If upstream renames or changes one of these, the model would not fail: it would silently lose a behaviour (backend
switching, fp32 slopes, weights kept on loading, the static-cache mask). Each test names the hook in its name and in
its failure message, and checks both that the hook exists as used and that using it has the intended effect.
Also: pyproject's warning filters, under which a deprecation warning pointing into hf_alibi fails the test.
"""

import inspect
import warnings
from importlib.util import find_spec

import pytest
import torch
from transformers import (
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
    GenerationMixin,
    PretrainedConfig,
    PreTrainedModel,
    StaticCache,
)
from transformers import initialization as init
from transformers.utils.deprecation import deprecate_kwarg

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, AlibiGPT2Model, get_alibi_slopes
from hf_alibi import _transformers_compat as serving_compat
from hf_alibi.models.alibi import modeling_alibi_gpt2, transformers_compat
from hf_alibi.models.alibi import tensor_parallel_alibi_gpt2 as tp_styles


def parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def call_from(module_name: str, function, **kwargs):
    """Call `function(**kwargs)` from a frame whose module is `module_name`: what `warnings` attributes a warning
    issued with `stacklevel=2` to."""
    namespace = {"__name__": module_name}
    exec(compile("def call(function, **kwargs):\n    return function(**kwargs)\n", module_name, "exec"), namespace)
    return namespace["call"](function, **kwargs)


@deprecate_kwarg("old_name", "99.0.0", new_name="new_name")
def renamed_argument(new_name=None):
    return new_name


def test_transformers_deprecation_warning_from_our_code_fails_the_test_and_from_third_party_code_does_not():
    with pytest.raises(FutureWarning, match="old_name"):  # pyproject: error::FutureWarning:hf_alibi...
        call_from("hf_alibi.models.alibi.modeling_alibi_gpt2", renamed_argument, old_name=1)
    with pytest.raises(FutureWarning, match="old_name"):  # the remote-code copy saved beside a checkpoint
        call_from("transformers_modules.out.modeling_alibi_gpt2", renamed_argument, old_name=1)
    with warnings.catch_warnings(record=True) as caught:  # keeps pytest's filters; only records what they show
        assert call_from("datasets.builder", renamed_argument, old_name=1) == 1
        warnings.warn_explicit("old thing", DeprecationWarning, "third_party.py", 1, module="torch.serialization")
    assert [w.category for w in caught] in ([FutureWarning], [])  # shown or deduplicated, never raised
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit(
            "old thing",
            DeprecationWarning,
            "hf_alibi/models/alibi/alibi.py",
            1,
            module="hf_alibi.models.alibi.alibi",
        )


def test_deprecate_kwarg_renames_past_key_values_to_cache_and_warns():
    """`transformers.utils.deprecation.deprecate_kwarg(old_name, version, new_name=...)` on both forwards."""
    assert parameters(deprecate_kwarg)[:3] == ["old_name", "version", "new_name"], (
        f"transformers.utils.deprecation.deprecate_kwarg changed its signature: {parameters(deprecate_kwarg)}"
    )
    model = AlibiGPT2Model(AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)).eval()
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        with pytest.warns(FutureWarning, match="past_key_values"):
            out = model(torch.tensor([[6]]), past_key_values=cache)
    assert out.cache is cache and cache.get_seq_length() == 4, "deprecate_kwarg did not pass past_key_values as cache"


def test_can_set_attn_implementation_cached_value_is_the_flag_transformers_reads():
    """`PreTrainedModel._can_set_attn_implementation` guesses from the model file's source unless this is set."""
    assert hasattr(PreTrainedModel, "_can_set_attn_implementation"), (
        "transformers' PreTrainedModel._can_set_attn_implementation is gone: check what replaced "
        "_can_set_attn_implementation_cached_value"
    )

    class Unflagged(AlibiGPT2LMHeadModel):
        _can_set_attn_implementation_cached_value = None

    Unflagged.__module__ = modeling_alibi_gpt2.__name__  # the guess reads our file: it would refuse
    assert Unflagged._can_set_attn_implementation() is False, "the source guess now accepts our file: drop the flag?"
    assert AlibiGPT2LMHeadModel._can_set_attn_implementation() is True, (
        "transformers no longer reads _can_set_attn_implementation_cached_value"
    )
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
        assert hasattr(PreTrainedModel, name), f"transformers' PreTrainedModel no longer defines {name}"
    assert hasattr(PretrainedConfig, "__post_init__"), "PretrainedConfig.__post_init__ (AlibiGPT2Config's hook) is gone"
    with pytest.raises(ValueError, match="n_head"):  # our __post_init__ ran: it validates
        AlibiGPT2Config(n_head=0)
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    model = AlibiGPT2LMHeadModel._from_config(config, attn_implementation="flex_attention")
    assert model.config._attn_implementation == "flex_attention", "config._attn_implementation is not the backend"
    assert model.lm_head.weight is model.transformer.wte.weight, "_tied_weights_keys no longer ties lm_head to wte"
    assert model.loss_function.__name__ == "ForCausalLMLoss", "loss_type 'ForCausalLM' no longer picks the causal loss"


def test_cache_get_seq_length_and_get_mask_sizes_mean_what_the_model_reads():
    """`get_seq_length()`: cached tokens (a 0-d tensor for a static cache); `get_mask_sizes(q, layer)[0]`: keys."""
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    keys = torch.zeros(1, 2, 5, 4)
    static, dynamic = StaticCache(config=config, max_cache_len=12), DynamicCache(config=config)
    assert parameters(static.get_mask_sizes)[:2] == ["query_length", "layer_idx"], "Cache.get_mask_sizes signature"
    for cache in (static, dynamic):
        cache.update(keys, keys, 0)
    assert isinstance(static.get_seq_length(), torch.Tensor) and int(static.get_seq_length()) == 5, (
        "StaticCache.get_seq_length() is no longer a 0-d tensor of cached tokens (compiled decoding relies on it)"
    )
    assert dynamic.get_seq_length() == 5
    assert static.get_mask_sizes(1, 0)[0] == 12, "StaticCache.get_mask_sizes(q, 0)[0] is no longer its buffer length"
    assert dynamic.get_mask_sizes(1, 0)[0] == 6, "DynamicCache.get_mask_sizes(q, 0)[0] is no longer cached + q"


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
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=16, max_batch_tokens=64),
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
    """`transformers.utils.output_capturing.capture_outputs` (with `_can_record_outputs`) and
    `transformers.utils.can_return_tuple`: every block's input and the final normed state, each layer's attention
    weights (eager, planned once), and a tuple for `return_dict=False`."""
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs  # noqa: F401

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
    assert {"cache", "attention_mask", "position_ids", "logits_to_keep"} <= set(names), names
    assert model.is_remote_code() and model._supports_logits_to_keep(), "generate() no longer finds logits_to_keep"


# ---------------------------------------------------------------------------------------------------------------------
# Tensor parallel: what `tensor_parallel_alibi_gpt2.py` stands on, through `transformers_compat.py`'s tensor-parallel
# names (transformers 5.24 and 5.25; older releases register no styles and are skipped here)
# ---------------------------------------------------------------------------------------------------------------------
needs_parallel_styles = pytest.mark.skipif(
    not transformers_compat.TENSOR_PARALLEL_SUPPORTED, reason="transformers older than the parallel-style API"
)
OUR_STYLES = (tp_styles.Conv1DColwiseParallel, tp_styles.Conv1DRowwiseParallel, tp_styles.AlibiHeadsParallel)
# The leading parameters of each `TensorParallelLayer` hook, as our styles override or call it
HOOK_PARAMETERS = {
    "shard_param": ["self", "module", "param", "mesh"],
    "install_forward": ["self", "module", "mesh"],
    "transform_inputs_pre_forward": ["self", "module", "args", "kwargs", "mesh"],
    "transform_output_post_forward": ["self", "module", "output", "mesh"],
    "context_around_forward": ["self", "module", "mesh"],
    "should_use_local_tensors": ["self", "module"],
}


def fake_mesh(size: int = 1, rank: int = 0):
    """What the hooks read of a TP mesh without a process group: its size and this rank's place in it."""
    from types import SimpleNamespace

    return SimpleNamespace(size=lambda: size, get_local_rank=lambda: rank, ndim=1)


@needs_parallel_styles
def test_all_parallel_styles_is_transformers_table_and_finds_every_style_our_plans_name():
    """`transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES`: plans name styles that are looked up here."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    assert transformers_compat.ALL_PARALLEL_STYLES is ALL_PARALLEL_STYLES
    named = {*AlibiGPT2Config._TP_PLAN.values(), *AlibiGPT2LMHeadModel._tp_plan.values()}
    assert named - set(ALL_PARALLEL_STYLES) == set(), (
        f"styles missing from the table: {named - set(ALL_PARALLEL_STYLES)}"
    )
    assert ALL_PARALLEL_STYLES[tp_styles.CONV1D_QKV_COLWISE].packed == 3
    assert isinstance(ALL_PARALLEL_STYLES[tp_styles.ALIBI_HEADS], tp_styles.AlibiHeadsParallel)


@needs_parallel_styles
def test_tensor_parallel_layer_hooks_pass_nothing_our_styles_do_not_take():
    """`TensorParallelLayer`'s hooks: the parameters we use lead, and every parameter the base declares (5.25 added
    `config=`, `mesh_manager=`) is one our overrides take too."""
    base = transformers_compat.TensorParallelLayer
    for name, leading in HOOK_PARAMETERS.items():
        declared = list(inspect.signature(getattr(base, name)).parameters)
        assert declared[: len(leading)] == leading, f"TensorParallelLayer.{name} changed: {declared}"
        for style in OUR_STYLES:
            taken = inspect.signature(getattr(style, name)).parameters
            untaken = [p for p in declared if p not in taken]
            assert not untaken, f"TensorParallelLayer.{name} declares {untaken}, which {style.__name__} does not take"


@needs_parallel_styles
def test_apply_tensor_parallelism_shards_each_parameter_rule_and_hooks_each_module_rule(monkeypatch):
    """`transformers.distributed.tensor_parallel.apply_tensor_parallelism`: `shard_param(module, name, mesh, ...)`
    for a parameter's rule, `install_forward(module, mesh, ...)` for a module's, with arguments our hooks bind."""
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism

    calls = []

    class Recorder(transformers_compat.TensorParallelLayer):
        def shard_param(self, *args, **kwargs):
            calls.append(("shard_param", args, kwargs))

        def install_forward(self, *args, **kwargs):
            calls.append(("install_forward", args, kwargs))

    monkeypatch.setitem(ALL_PARALLEL_STYLES, "surface_recorder", Recorder())
    model = AlibiGPT2LMHeadModel(AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8))
    c_fc, mesh = model.transformer.h[0].mlp.c_fc, fake_mesh()
    plan = {"transformer.h.0.mlp.c_fc.weight": "surface_recorder", "transformer.h.0.mlp.c_fc": "surface_recorder"}
    apply_tensor_parallelism(model, mesh, plan)
    assert [(hook, args) for hook, args, _ in calls] == [
        ("shard_param", (c_fc, "weight", mesh)),
        ("install_forward", (c_fc, mesh)),
    ]
    for hook, args, kwargs in calls:
        inspect.signature(getattr(tp_styles.Conv1DColwiseParallel, hook)).bind(None, *args, **kwargs)


@needs_parallel_styles
def test_install_forward_runs_the_pre_around_and_post_hooks_around_the_modules_own_forward():
    """`TensorParallelLayer.install_forward` (the Conv1D styles keep it): inputs transformed, the forward run inside
    `context_around_forward`, its output transformed."""
    import contextlib

    events = []

    class Recorder(transformers_compat.TensorParallelLayer):
        def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
            events.append("pre")
            return (args[0] + 1,), kwargs

        @contextlib.contextmanager
        def context_around_forward(self, module, mesh):
            events.append("enter")
            yield
            events.append("exit")

        def transform_output_post_forward(self, module, output, mesh, config=None):
            events.append("post")
            return output * 10

    class Identity(torch.nn.Module):
        def forward(self, hidden):
            events.append("forward")
            return hidden

    module = Identity()
    Recorder().install_forward(module, fake_mesh())
    assert module(torch.tensor(1.0)).item() == 20.0
    assert events == ["pre", "enter", "forward", "exit", "post"]


@pytest.fixture
def one_rank_mesh():
    """A gloo process group of one rank and its device mesh, torn down after the test."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@needs_parallel_styles
def test_context_around_forward_gives_the_forward_local_tensors_of_dtensor_parameters(one_rank_mesh):
    """`TensorParallelLayer.context_around_forward` with `should_use_local_tensors`: what our Conv1D styles run
    GPT-2's `Conv1D` on (`torch.addmm` of plain tensors), the DTensors put back after."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from transformers.pytorch_utils import Conv1D

    conv = Conv1D(4, 3)  # weight (in 3, out 4)
    conv.weight = torch.nn.Parameter(distribute_tensor(conv.weight.detach(), one_rank_mesh, [Shard(1)]))
    sharded = conv.weight
    with tp_styles.Conv1DColwiseParallel().context_around_forward(conv, one_rank_mesh):
        assert not isinstance(conv.weight, DTensor) and conv.weight.shape == (3, 4)
        conv(torch.ones(2, 3))  # (B, in) -> (B, out) on local tensors
    assert conv.weight is sharded


@needs_parallel_styles
def test_strided_shard_and_the_loader_give_each_rank_its_slice_of_every_packed_block():
    """torch's `_StridedShard` (private; transformers' packed_colwise uses it too) and
    `transformers.distributed.sharding_utils.DtensorShardOperation._compute_strided_slice`, which loads it: rank 1 of
    2 gets [q_1 | k_1 | v_1] of a packed q|k|v of 3 x 4. 5.24's loader tells it from `Shard` by `is_shard()`, 5.25's
    by its type."""
    from torch.distributed.tensor.placement_types import _StridedShard
    from transformers.distributed.sharding_utils import DtensorShardOperation

    placement = _StridedShard(dim=-1, split_factor=3)
    assert (placement.dim, placement.split_factor) == (-1, 3) and not placement.is_shard()
    loader = DtensorShardOperation.__new__(DtensorShardOperation)  # its slicing needs no mesh
    assert loader._compute_strided_slice([(0, 12)], rank=1, world_size=2, split_factor=3) == [(2, 4), (6, 8), (10, 12)]


# Serving (`hf-alibi serve`): the names of `hf_alibi._transformers_compat`'s serving section, one test each, on the
# installed release (5.24 or 5.25+). transformers' serving modules import fastapi: the `serve` extra.
serving = pytest.mark.skipif(
    not serving_compat.transformers_at_least(serving_compat.SERVING_MINIMUM) or find_spec("fastapi") is None,
    reason="hf-alibi serve needs transformers>=5.24 and the serve extra",
)
model_process = pytest.mark.skipif(
    not serving_compat.serving_model_in_own_process(), reason="5.25+: the model runs in a process of its own"
)


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory):
    from serving.tiny_checkpoint import save_tiny_checkpoint  # tests/serving: a tiny ALiBi GPT-2 and its tokenizer

    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("surface") / "alibi-tiny"))


class FakeManager:
    """What `build_server` asks of a model manager, recorded."""

    is_dead = False  # 5.25+'s /health

    def __init__(self):
        self.shut_down = False

    def shutdown(self):
        self.shut_down = True


class FakeHandler:
    def __init__(self, name: str):
        self.name = name

    async def handle_request(self, body, request_id=None):
        from fastapi.responses import JSONResponse

        return JSONResponse({"handler": self.name, "body": body})


@serving
def test_serving_handler_classes_take_the_manager_and_state_and_answer_handle_request():
    state = serving_compat.serving_generation_state(False, None)
    manager = FakeManager()
    for name, handler_class in serving_compat.serving_handler_classes().items():
        handler = handler_class(model_manager=manager, generation_state=state)
        assert handler.model_manager is manager and handler.generation_state is state, name
        assert inspect.iscoroutinefunction(handler_class.handle_request), f"{name}.handle_request is not async"
        assert parameters(handler_class.handle_request) == ["self", "body", "request_id"], name


@serving
def test_serving_build_server_routes_to_the_handlers_given_and_its_lifespan_shuts_the_manager_down():
    """`serving.CheckedHandler` sits where transformers' handlers go; `_stop_on_shutdown` wraps the lifespan."""
    from fastapi.testclient import TestClient

    manager, state = FakeManager(), serving_compat.serving_generation_state(False, None)
    names = ("chat_handler", "completion_handler", "response_handler", "transcription_handler", "systemone_handler")
    app = serving_compat.serving_build_server(manager, state, **{name: FakeHandler(name) for name in names})
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        for path, name in [("/v1/chat/completions", "chat_handler"), ("/v1/completions", "completion_handler")]:
            assert client.post(path, json={"x": 1}).json() == {"handler": name, "body": {"x": 1}}, path
        assert not manager.shut_down
    assert manager.shut_down, "build_server's lifespan no longer ends in model_manager.shutdown()"


@serving
def test_serving_transcription_handler_is_built_on_the_manager():
    manager, state = FakeManager(), serving_compat.serving_generation_state(False, None)
    handler = serving_compat.serving_transcription_handler(manager, state)
    assert handler.model_manager is manager and parameters(type(handler).handle_request) == ["self", "request"]


@serving
def test_serving_generation_state_holds_our_paged_cache_config_and_puts_no_cap_on_an_alibi_prompt():
    """5.25+: the model's process sizes the cache from `cb_config` and refuses prompts past `context_length`, the
    config's `max_position_embeddings`, which an ALiBi config does not have; 5.24: `get_manager` builds continuous
    batching on `cb_config`."""
    from transformers import GPT2Config

    cb_config = ContinuousBatchingConfig(num_blocks=4, page_size=16, max_batch_tokens=32)
    state = serving_compat.serving_generation_state(True, cb_config)
    if serving_compat.serving_model_in_own_process():
        assert state.cb_config is cb_config
        assert state.context_length(AlibiGPT2Config(n_positions=64)) is None, "an ALiBi prompt is capped"
        assert state.context_length(GPT2Config(n_positions=64)) == 64, "context_length no longer reads the config"
    else:
        assert state.get_manager("m", use_cb=True)._cb_config is cb_config


@serving
def test_serving_model_id_parts_splits_the_revision_and_keeps_a_folder_whole(tmp_path):
    folder = tmp_path / "checkpoint@1000"
    folder.mkdir()
    assert serving_compat.serving_model_id_parts("org/model@dev") == ("org/model", "dev")
    assert serving_compat.serving_model_id_parts("org/model") == ("org/model", None)
    assert serving_compat.serving_model_id_parts(str(folder)) == (str(folder), None)


@serving
def test_serving_loading_hook_is_what_transformers_calls_and_loads_through_the_auto_classes(served_folder):
    """5.25+: the model's process calls a pickled `partial(loader.load_model_and_processor, model_id)`; 5.24:
    `ModelManager.load_model_and_processor` calls `_load_model`. `hf_alibi.serving_loader` overrides each."""
    import pickle
    from functools import partial

    from hf_alibi import serving_loader

    settings = dict(device="cpu", dtype="auto", attn_implementation="eager", continuous_batching=False)
    if serving_compat.serving_model_in_own_process():
        base = serving_compat.serving_model_loader_class()
        assert parameters(base.load_model_and_processor) == ["self", "model_id", "on_progress"]
        loader = serving_loader.AutoModelLoader(model_kwargs={"alibi_skip_eps": 0.0}, **settings)
        load = pickle.loads(pickle.dumps(partial(loader.load_model_and_processor, served_folder)))
        model, tokenizer = load(on_progress=None)
    else:
        base = serving_compat.serving_model_manager_class()
        expected = ["self", "model_id_and_revision", "tqdm_class", "progress_callback", "gguf_file"]
        assert parameters(base._load_model) == expected, parameters(base._load_model)
        manager = serving_loader.AutoLoadingModelManager(model_kwargs={"alibi_skip_eps": 0.0}, **settings)
        model, tokenizer = manager.load_model_and_processor(manager.process_model_name(served_folder))
    assert isinstance(model, AlibiGPT2LMHeadModel) and tokenizer.chat_template is not None
    assert model.config.alibi_skip_eps == 0.0 and model.config._attn_implementation == "eager"


@serving
def test_serving_processor_is_the_served_models_tokenizer(served_folder):
    """5.25+: the engine of a model, which the server's process creates without starting the model's process."""
    from hf_alibi import serving_loader

    state = serving_compat.serving_generation_state(False, None)
    settings = dict(device="cpu", dtype="auto", attn_implementation=None, continuous_batching=False)
    if serving_compat.serving_model_in_own_process():
        manager = serving_compat.serving_model_manager_class()(
            serving_loader.AutoModelLoader(model_kwargs={}, **settings), state
        )
    else:
        manager = serving_loader.AutoLoadingModelManager(model_kwargs={}, **settings)
    tokenizer = serving_compat.serving_processor(manager, served_folder)
    assert tokenizer.chat_template is not None and tokenizer("hello")["input_ids"]
    assert serving_compat.serving_model_processes(manager) == [], "no model's process was started"


@serving
@model_process
def test_serving_model_processes_are_the_engines_until_shutdown_terminates_and_forgets_them(served_folder):
    """`_stop_on_shutdown` reads them before `manager.shutdown()`, then waits for them to exit."""
    import multiprocessing
    import time

    from hf_alibi import serving_loader

    settings = dict(device="cpu", dtype="auto", attn_implementation=None, continuous_batching=False)
    loader = serving_loader.AutoModelLoader(model_kwargs={}, **settings)
    state = serving_compat.serving_generation_state(False, None)
    manager = serving_compat.serving_model_manager_class()(loader, state)
    engine = manager.get_engine(served_folder)
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=time.sleep, args=(60,), daemon=True)  # stands for the model's process
    process.start()
    engine.managed_process, engine.requests_queue = process, context.Queue()
    assert serving_compat.serving_model_processes(manager) == [process]
    manager.shutdown()
    assert serving_compat.serving_model_processes(manager) == [], "shutdown no longer forgets the process"
    process.join(10)
    assert process.exitcode is not None, "shutdown no longer terminates the model's process"


@serving
@model_process
def test_serving_loading_error_is_the_builtin_error_the_model_process_reports_as_text():
    """`EngineClient.run_engine` sends a failed load as `RuntimeError("ImportError: ...")` through its pipe."""
    import logging

    sent = []

    class Writer:
        send, close = sent.append, staticmethod(lambda: None)

    def failing_load(on_progress=None):
        raise ImportError("the package for FlashAttention2 is not installed")

    from transformers.cli.serving.model_manager import EngineClient

    state, level = serving_compat.serving_generation_state(False, None), logging.getLogger("transformers.cli").level
    EngineClient.run_engine(failing_load, state, None, [], Writer(), False, level)
    assert len(sent) == 1 and isinstance(sent[0], RuntimeError), sent
    error = serving_compat.serving_loading_error(sent[0])
    assert type(error) is ImportError and str(error) == "the package for FlashAttention2 is not installed", error
    other = RuntimeError("SafetensorError: header too large")  # a library's own type stays as it came
    assert serving_compat.serving_loading_error(other) is other


@serving
def test_serving_stop_generation_stops_what_the_manager_shutdown_leaves_running():
    """5.24: continuous batching's manager, which `GenerationState.shutdown` stops and drops; 5.25+: nothing (the
    model's process, generation and all, stops with `manager.shutdown()`)."""
    state = serving_compat.serving_generation_state(True, None)
    if serving_compat.serving_model_in_own_process():
        assert not hasattr(state, "shutdown"), "5.25's GenerationState has a shutdown again: call it"
    else:
        state.get_manager("m", use_cb=True)
        serving_compat.serving_stop_generation(state)
        assert state._cb_manager is None, "GenerationState.shutdown no longer drops continuous batching's manager"
    serving_compat.serving_stop_generation(state)
