"""`flushing_denormals` (denormals.py): inside the block every thread of torch's CPU pool flushes denormal floats to
zero, the caller's mode comes back afterwards on all of them, and the attention it wraps computes the same values."""

import pytest
import torch

from hf_alibi.models.alibi_gpt2 import denormals
from hf_alibi.models.alibi_gpt2.attention_sdpa_split import sdpa_alibi_split


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
    if denormals._openmp_team() is None:
        pytest.skip("torch's pool is not an OpenMP runtime this process reaches: the calling thread alone flushes")
    assert bool((denormal_products() != 0).all()), "denormals flushed before the block"
    with denormals.flushing_denormals():
        inside = denormal_products()
    after = denormal_products()
    assert int((inside != 0).sum()) == 0, f"{int((inside != 0).sum())} of {inside.numel()} products kept a denormal"
    assert bool((after != 0).all()), f"{int((after == 0).sum())} products still flushed after the block"


def test_a_caller_that_flushed_keeps_flushing_after_the_block(two_threads):
    torch.set_flush_denormal(True)
    try:
        with denormals.flushing_denormals():
            pass
        assert denormals._CallingThread.environment()
    finally:
        torch.set_flush_denormal(False)
        if denormals._openmp_team() is not None:
            with denormals.flushing_denormals():  # the team back to the caller's (now unflushed) mode
                pass
    assert not denormals._CallingThread.environment()


def test_flushed_split_attention_equals_the_unflushed_kernels_to_fp32_rounding(two_threads):
    """Far keys (slope 1/4 over 3k keys) put probabilities in the denormal range; flushing them changes nothing that
    fp32 resolves: outputs and gradients match a float64 run of the same split (which has no denormals)."""
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 4, 3072, 32, requires_grad=True) for _ in range(3))
    slopes = torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256])
    output = sdpa_alibi_split(query, key, value, slopes, offset=0)
    grad = torch.randn_like(output)
    grads = torch.autograd.grad(output, (query, key, value), grad)
    exact = [t.detach().double().requires_grad_() for t in (query, key, value)]
    expected = sdpa_alibi_split(*exact, slopes, offset=0)
    expected_grads = torch.autograd.grad(expected, exact, grad.double())
    for name, got, want in zip(("output", "dq", "dk", "dv"), (output, *grads), (expected, *expected_grads)):
        error = (got.double() - want).abs().max().item()
        assert error < 1e-4, f"{name}: largest difference {error:.3g}"
