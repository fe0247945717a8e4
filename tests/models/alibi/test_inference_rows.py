"""Inference over long inputs runs each block's q|k|v and output projections, norm and MLP a block of rows at a time
(`INFERENCE_ROWS`): q, k and v into three buffers, c_proj back into the attention's output, the MLP added into the
residual in place. The same numbers as one call over every row, in every hidden state, with padding, `clip_qkv`, a
cache and autograd. When no hook or wrapper observes a block's norm and attention module (`runs_unobserved`), the norm
runs on c_attn's rows and the attention's output becomes the block's; with one, hooks see what one call gives them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from hf_alibi.models.alibi import modeling_alibi_gpt2


def _ids_and_mask(model, length=37):
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    return ids, mask


@pytest.mark.parametrize(
    "backend, overrides",
    [
        ("sdpa", {}),
        ("sdpa", {"gated_mlp": True}),
        ("sdpa", {"clip_qkv": 0.05}),
        ("sdpa", {"alibi_skip_eps": 1e-7}),  # certified skipping: the split's calls read the shared buffers
        ("eager", {}),
    ],
    ids=["gelu_mlp", "gated_mlp", "clip_qkv", "skipping", "eager"],
)
def test_rows_at_a_time_give_every_hidden_state_and_logit_of_one_call(make_model, monkeypatch, backend, overrides):
    model = make_model(backend, **overrides)
    ids, mask = _ids_and_mask(model)
    with torch.enable_grad():  # autograd on: the whole input at once
        whole = model(ids, attention_mask=mask, output_hidden_states=True)
    monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 8)  # 37 rows: 5 parts, the last one short
    with torch.no_grad():
        parts = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)  # layers share q, k, v
    for index, (got, want) in enumerate(zip(parts.hidden_states, whole.hidden_states)):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6, msg=f"hidden state {index}")
    torch.testing.assert_close(parts.logits, whole.logits.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "backend, overrides",
    [
        ("sdpa", {}),
        ("sdpa", {"gated_mlp": True, "norm_type": "rms_norm"}),
        ("sdpa", {"clip_qkv": 0.05}),
        ("sdpa", {"alibi_skip_eps": 1e-7}),
        ("eager", {}),
    ],
    ids=["gelu_mlp", "gated_mlp_rms_norm", "clip_qkv", "skipping", "eager"],
)
def test_unobserved_layers_in_rows_give_the_logits_of_one_call(make_model, monkeypatch, backend, overrides):
    # No output_hidden_states here: asking for it installs transformers' recording hooks on every block and attention
    # module for good, and an observed layer keeps the norm's whole output (the test above)
    model = make_model(backend, **overrides)
    ids, mask = _ids_and_mask(model)
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, use_cache=False).logits  # 37 rows: one call per layer
        monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 8)
        assert all(modeling_alibi_gpt2.runs_unobserved(block.attn) for block in model.transformer.h)
        parts = model(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)


def test_a_hook_on_the_attention_module_sees_the_norms_output_and_keeps_its_own_output(make_model, monkeypatch):
    monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 8)
    model = make_model()
    block = model.transformer.h[1]
    ids, mask = _ids_and_mask(model)
    with torch.no_grad():
        unobserved = model(ids, attention_mask=mask, use_cache=False).logits
    seen = {}

    def record(module, args, output):
        seen.update(input=args[0], output=output[0], output_then=output[0].clone())

    hooks = [
        block.register_forward_pre_hook(lambda module, args: seen.update(block_input=args[0])),
        block.attn.register_forward_hook(record),
    ]
    try:
        with torch.no_grad():
            observed = model(ids, attention_mask=mask, use_cache=False).logits
            normed = block.ln_1(seen["block_input"])
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(seen["input"], normed, rtol=0, atol=0, msg="the attention module's input: ln_1's output")
    torch.testing.assert_close(seen["output"], seen["output_then"], rtol=0, atol=0, msg="not written after the hook")
    torch.testing.assert_close(observed, unobserved, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "observe",
    [
        lambda module: module.register_forward_hook(lambda *args: None),
        lambda module: module.register_forward_pre_hook(lambda *args: None),
        lambda module: torch.nn.modules.module.register_module_forward_hook(lambda *args: None),
        lambda module: setattr(module, "forward", module.forward),  # accelerate's add_hook_to_module does this
    ],
    ids=["forward_hook", "pre_hook", "global_hook", "wrapped_forward"],
)
def test_runs_unobserved_sees_hooks_global_hooks_and_wrapped_forwards(observe):
    module = torch.nn.Linear(2, 2)
    assert modeling_alibi_gpt2.runs_unobserved(module)
    handle = observe(module)
    try:
        assert not modeling_alibi_gpt2.runs_unobserved(module)
    finally:
        if handle is not None:
            handle.remove()
        vars(module).pop("forward", None)
    assert modeling_alibi_gpt2.runs_unobserved(module)


def test_a_prefill_in_rows_fills_the_cache_that_decoding_reads(make_model, monkeypatch):
    model = make_model()
    ids, mask = _ids_and_mask(model, length=40)
    prompt, prompt_mask = ids[:, :37], mask[:, :37]

    def prefill_then_decode():
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            first = model(prompt, attention_mask=prompt_mask, cache=cache)
            logits = [first.logits[:, -1]]
            for step in range(37, 40):  # three more tokens, one at a time, over the cache
                out = model(ids[:, step : step + 1], attention_mask=mask[:, : step + 1], cache=cache)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1), cache

    want, want_cache = prefill_then_decode()  # 37 rows <= INFERENCE_ROWS: one call
    monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 8)
    got, got_cache = prefill_then_decode()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for layer, (got_layer, want_layer) in enumerate(zip(got_cache.layers, want_cache.layers)):
        torch.testing.assert_close(got_layer.keys, want_layer.keys, rtol=0, atol=0, msg=f"layer {layer} keys")
        torch.testing.assert_close(got_layer.values, want_layer.values, rtol=0, atol=0, msg=f"layer {layer} values")


def test_projections_in_rows_are_buffers_laid_out_for_the_kernels_equal_to_one_call(make_model, monkeypatch):
    model = make_model()
    attention = model.transformer.h[0].attn
    hidden = torch.randn(2, 21, model.config.n_embd)
    with torch.no_grad():
        whole = attention.projections(hidden)  # 21 rows: views of one c_attn call
        monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 4)
        parts = attention.projections(hidden)
    for name, got, want in zip("qkv", parts, whole):
        assert got.shape == (2, model.config.n_head, 21, model.config.n_embd // model.config.n_head), name
        layout = got if name != "q" else got.transpose(1, 2)  # q: (B, L, H, D) in memory, as the output will be
        assert layout.is_contiguous(), f"{name}: one contiguous buffer"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)  # (BLAS may block 4 and 42 rows apart)


def test_rows_at_a_time_leave_the_blocks_input_untouched(make_model, monkeypatch):
    monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 4)
    model = make_model()
    block = model.transformer.h[0]
    ids = torch.randint(0, model.config.vocab_size, (1, 11))
    captured = {}
    handle = block.register_forward_hook(lambda module, args, output: captured.update(args=args, output=output))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    hidden_in = captured["args"][0]
    assert hidden_in.data_ptr() != captured["output"][0].data_ptr(), "the block writes into its own tensor"
    with torch.no_grad():
        expected = model.transformer.wte(ids)  # the first block's input is the embedding, unchanged by the block
    torch.testing.assert_close(hidden_in, expected)


def test_layers_share_one_set_of_projection_buffers_unless_a_cache_keeps_the_keys(make_model, monkeypatch):
    monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 8)
    model = make_model()
    ids, mask = _ids_and_mask(model)
    taken = []
    take = modeling_alibi_gpt2.ProjectionBuffers.take

    def spy(self, like, shape):
        buffers = take(self, like, shape)
        taken.append(tuple(buffer.data_ptr() for buffer in buffers))
        return buffers

    monkeypatch.setattr(modeling_alibi_gpt2.ProjectionBuffers, "take", spy)
    with torch.no_grad():
        shared = model(ids, attention_mask=mask, use_cache=False).logits
    assert len(taken) == model.config.n_layer >= 2 and len(set(taken)) == 1, "every layer writes the same three"
    taken.clear()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        cached = model(ids, attention_mask=mask, cache=cache).logits
    assert taken == [], "a cache keeps each layer's keys and values: new buffers per layer"
    assert len({layer.keys.data_ptr() for layer in cache.layers}) == model.config.n_layer
    torch.testing.assert_close(shared, cached, rtol=0, atol=0)


def test_output_projection_in_rows_overwrites_the_heads_output_with_one_calls_numbers(make_model, monkeypatch):
    model = make_model()
    attention = model.transformer.h[0].attn
    heads = torch.randn(2, 21, model.config.n_embd)  # (B, q, H D): what the attention routes return, reshaped
    with torch.no_grad():
        whole = attention.output_projection(heads.clone())  # 21 rows: one c_proj call
        monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 4)
        scratch = heads.clone()
        parts = attention.output_projection(scratch)
        assert parts.data_ptr() == scratch.data_ptr(), "the heads' output becomes the module's output"
        torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # c_proj's bf16 rows: a new tensor of autocast's dtype
            scratch = heads.clone()
            cast = attention.output_projection(scratch)
            monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 2048)
            cast_whole = attention.output_projection(heads.clone())
    assert cast.dtype == cast_whole.dtype == torch.bfloat16
    torch.testing.assert_close(scratch, heads, rtol=0, atol=0, msg="the fp32 heads' output is left as it was")
    torch.testing.assert_close(cast, cast_whole, rtol=0, atol=0)


class _NewStorages(TorchDispatchMode):
    """Records the size of every new storage an op returns (not one of its inputs', not a view)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [*args, *(kwargs or {}).values()]
        held = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in held:
                self.sizes.append(tensor.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "hooked_attention"])
@pytest.mark.parametrize("overrides", [{}, {"alibi_skip_eps": 1e-7}], ids=["dense_split", "certified_split"])
def test_an_inference_forward_in_rows_allocates_one_full_width_tensor_a_layer(
    make_model, monkeypatch, overrides, observed
):
    # Each new (L, C) tensor is memory the forward writes afresh: from 32 MiB on (the demo's width at 64k tokens) glibc
    # maps and page-faults every one, and below that the heap it trims does too. An unobserved layer allocates one, the
    # attention's output (c_proj, the residual and the MLP written into it); a layer whose attention module has a hook
    # also allocates what the hook sees, its norm's whole output, and its block's own output. q, k and v are shared.
    monkeypatch.setattr(modeling_alibi_gpt2, "INFERENCE_ROWS", 128)
    model = make_model(**overrides)
    hooks = [block.attn.register_forward_hook(lambda *args: None) for block in model.transformer.h if observed]
    ids = torch.randint(3, 256, (1, 1024))  # batch 1, whole 256-row blocks: the split's diagonals in one call
    spy = _NewStorages()
    with torch.no_grad(), spy:
        model(ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
    for hook in hooks:
        hook.remove()
    full_width = ids.shape[1] * model.config.n_embd * 4  # (L, C) fp32 bytes; q, k and v are each that too
    embedding, shared_qkv, final_norm = 1, 3, 1
    expected = embedding + shared_qkv + (3 if observed else 1) * model.config.n_layer + final_norm
    assert spy.sizes.count(full_width) == expected
