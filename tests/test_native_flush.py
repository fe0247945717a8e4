"""`flushing_denormals` (hf_alibi/native_flush.py, the opt-in switch outside the model): inside the block every thread
of torch's CPU pool flushes denormal floats to zero, the caller's mode comes back afterwards on all of them, and the
attention it wraps computes the same values as the model's own (pure) path, which changes no thread's mode."""

import contextlib

import pytest
import torch

from hf_alibi import native_flush
from hf_alibi.models.alibi.attention_sdpa_split import sdpa_alibi_split


def denormal_products() -> torch.Tensor:
    """1e-30 * 1e-10 = 1e-40 (a denormal) over enough elements that torch splits the multiply over its threads."""
    return torch.full((1 << 20,), 1e-30) * 1e-10  # (N,): each thread writes its share


@pytest.fixture
def two_threads():
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_every_worker_thread_flushes_inside_the_block_and_none_after(two_threads):
    if native_flush._openmp_team() is None:
        pytest.skip("torch's pool is not an OpenMP runtime this process reaches: the calling thread alone flushes")
    assert bool((denormal_products() != 0).all()), "denormals flushed before the block"
    with native_flush.flushing_denormals():
        inside = denormal_products()
    after = denormal_products()
    assert int((inside != 0).sum()) == 0, f"{int((inside != 0).sum())} of {inside.numel()} products kept a denormal"
    assert bool((after != 0).all()), f"{int((after == 0).sum())} products still flushed after the block"


def test_a_caller_that_flushed_keeps_flushing_after_the_block(two_threads):
    torch.set_flush_denormal(True)
    try:
        with native_flush.flushing_denormals():
            pass
        assert native_flush._CallingThread.environment()
    finally:
        torch.set_flush_denormal(False)
        if native_flush._openmp_team() is not None:
            with native_flush.flushing_denormals():  # the team back to the caller's (now unflushed) mode
                pass
    assert not native_flush._CallingThread.environment()


@pytest.mark.parametrize("switch", ["pure", "native flush"])
def test_split_attention_equals_float64_with_and_without_the_switch_and_leaves_the_mode_alone(two_threads, switch):
    """Far keys (slope 1/4 over 3k keys) put probabilities in the denormal range. The model's own path computes them
    (no thread's mode changes: the caller's unflushed mode holds after the call); the opt-in switch flushes them, which
    changes nothing fp32 resolves. Both: outputs and gradients match a float64 run of the same split."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 4, 3072, 32, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256])
    with native_flush.flushing_denormals() if switch == "native flush" else contextlib.nullcontext():
        output = sdpa_alibi_split(query, key, value, slopes, query_offset=0)
        grad = torch.randn_like(output)
        grads = torch.autograd.grad(output, (query, key, value), grad)
    assert not native_flush._CallingThread.environment(), "the caller's thread flushes denormals after the call"
    assert bool((denormal_products() != 0).all()), "a worker thread flushes denormals after the call"
    exact = [t.detach().double().requires_grad_() for t in (query, key, value)]
    expected = sdpa_alibi_split(*exact, slopes, query_offset=0)
    expected_grads = torch.autograd.grad(expected, exact, grad.double())
    for name, got, want in zip(("output", "dq", "dk", "dv"), (output, *grads), (expected, *expected_grads)):
        error = (got.double() - want).abs().max().item()
        assert error < 1e-4, f"{name}: largest difference {error:.3g}"
