"""Compiled continuous batching (transformers' `ContinuousBatchingConfig(default_compile_level=1)`: the batch's forward
under `torch.compile(fullgraph=False, dynamic=True)`) gives every request its `generate()` tokens, and a failure
inside the model's forward reaches the caller of `generate_batch` as a failed request with its error, never as an
empty answer that looks like a finished one."""

import pytest
import torch

from conftest import CONTINUOUS_BATCHING, NO_CONTINUOUS_BATCHING

if not CONTINUOUS_BATCHING:
    pytest.skip(NO_CONTINUOUS_BATCHING, allow_module_level=True)
from test_continuous_batching import alone, greedy_config, prompts
from transformers import ContinuousBatchingConfig, GPT2Config, GPT2LMHeadModel
from transformers.generation import CompileConfig
from transformers.generation.continuous_batching import RequestStatus

NEW_TOKENS = 5
# The repro: two requests, a small cache, no CUDA graphs, no async batching (both CUDA-only anyway)
CACHE = dict(num_blocks=16, page_size=32, use_cuda_graph=False, use_async_batching=False)


def run_batch(model, inputs, **compile_settings) -> dict:
    cb = ContinuousBatchingConfig(**CACHE, **compile_settings)
    return model.generate_batch(
        inputs=inputs, generation_config=greedy_config(NEW_TOKENS), continuous_batching_config=cb, progress_bar=False
    )


def two_heads(make_model, backend):
    return make_model(backend, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_compiled_continuous_batching_gives_each_request_its_generate_tokens(make_model, backend):
    """transformers' default compile level: the planner and the paged attention run outside the graph (as
    transformers' own `PagedAttentionCache.update` does), the projections and MLPs inside it."""
    model = two_heads(make_model, backend)
    inputs = prompts((35, 10))
    expected = [alone(model, prompt, NEW_TOKENS) for prompt in inputs]
    outputs = run_batch(model, inputs, default_compile_level=1)
    for i, want in enumerate(expected):
        result = outputs[f"req_{i}"]
        assert result.error is None, result.error
        assert result.generated_tokens == want, f"request {i}: {result.generated_tokens} != generate()'s {want}"


def test_fullgraph_continuous_batching_fails_as_gpt2_does_and_says_so(make_model):
    """`fullgraph=True` cannot hold under continuous batching for any transformers model: the paged cache's `update`
    is `torch.compiler.disable`d, a graph break. GPT-2 fails there; ours fails the same way, visibly."""
    gpt2 = GPT2LMHeadModel._from_config(GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2)).eval()
    inputs = prompts((35, 10))
    fullgraph = dict(varlen_compile_config=CompileConfig(fullgraph=True, dynamic=True))
    for model in (gpt2, two_heads(make_model, "sdpa")):
        for result in run_batch(model, inputs, **fullgraph).values():
            assert result.status == RequestStatus.FAILED and "torch.compiler.disable" in result.error, result.error


def test_a_failure_inside_the_forward_reaches_the_caller_as_a_failed_request(make_model):
    """transformers' continuous batching catches a forward's exception, logs it and marks the requests: the public
    signal is each output's `status` and `error` (what `transformers serve` turns into an error response and our
    documented `generate_batch` use checks), never tokens that silently stop."""
    model = two_heads(make_model, "sdpa")

    def broken(module, args):
        raise ValueError("attention failed inside the model's forward")

    model.transformer.h[1].attn.register_forward_pre_hook(broken)
    outputs = run_batch(model, prompts((35, 10)))
    assert len(outputs) == 2
    for result in outputs.values():
        assert result.status == RequestStatus.FAILED, result.status
        assert "attention failed inside the model's forward" in result.error
        assert torch.tensor(result.generated_tokens).numel() == 0
