"""The pieces of tensor parallelism that need no second process: `alibi_attention(heads=)` computes exactly those heads
of the full call on every backend, the `alibi_heads` style hands each rank its global heads (and refuses uneven
splits). The transformers / torch surface the styles stand on: the tensor-parallel section of
tests/test_transformers_surface.py."""

from types import SimpleNamespace

import pytest
import torch

from hf_alibi import get_alibi_slopes
from hf_alibi.models.alibi.attention_alibi import alibi_attention, plan_alibi_attention
from hf_alibi.models.alibi.tensor_parallel_alibi_gpt2 import ALIBI_HEADS

HEADS, DIM = 12, 8
# (backend, SDPA path): the split, the bias bank in several chunks, eager's prebuilt bias, FlexAttention's score_mod
PATHS = {
    "eager": ("eager", {}),
    "sdpa_split": ("sdpa", {}),
    "sdpa_bank": ("sdpa", dict(sdpa_split=False, query_chunk=8)),
    "flex_attention": ("flex_attention", {}),
}
# Rank 2 of 4 (slopes 2^-7, 2^-8, 2^-0.5: across the interleave) and rank 1 of 2.
HEAD_SLICES = [slice(6, 9), slice(6, 12)]


@pytest.mark.parametrize("heads", HEAD_SLICES, ids=lambda s: f"{s.start}-{s.stop}")
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_a_rank_s_heads_compute_exactly_those_heads_of_the_full_call(path, heads, padded):
    backend, options = PATHS[path]
    query, key, value = (torch.randn(2, HEADS, 21, DIM) for _ in range(3))  # (B, H, L, D)
    mask = torch.ones(2, 21, dtype=torch.long)
    if padded:
        mask[1, :7] = 0
    inputs = plan_alibi_attention(backend, get_alibi_slopes(HEADS), 2, 21, 21, attention_mask=mask, **options)
    with torch.no_grad():
        full, _ = alibi_attention(query, key, value, inputs, DIM**-0.5)  # (B, L, H, D)
        part, _ = alibi_attention(query[:, heads], key[:, heads], value[:, heads], inputs, DIM**-0.5, heads=heads)
    real = mask.bool()  # (B, L): fully padded rows are garbage on every backend
    error = (part - full[:, :, heads])[real].abs().max().item()
    assert error < 1e-6, f"{path}: heads {heads} differ from the full call's by {error:.2e}"


def test_eager_weights_of_a_rank_s_heads_are_those_heads_of_the_full_call():
    query, key, value = (torch.randn(1, HEADS, 9, DIM) for _ in range(3))
    inputs = plan_alibi_attention("eager", get_alibi_slopes(HEADS), 1, 9, 9)
    _, full = alibi_attention(query, key, value, inputs, DIM**-0.5, output_attentions=True)
    part_qkv = (t[:, 3:6] for t in (query, key, value))
    _, part = alibi_attention(*part_qkv, inputs, DIM**-0.5, output_attentions=True, heads=slice(3, 6))
    torch.testing.assert_close(part, full[:, 3:6], atol=1e-7, rtol=0)


@pytest.mark.parametrize("heads", [slice(0, 2), slice(10, 14), [0, 1, 2]], ids=["too_few", "past_the_end", "list"])
def test_heads_that_do_not_fit_the_query_raise_naming_them(heads):
    query = torch.randn(1, 3, 4, DIM)
    inputs = plan_alibi_attention("sdpa", get_alibi_slopes(HEADS), 1, 4, 4)
    with pytest.raises(ValueError, match=r"heads=.*12 global heads.*\(3\)"):
        alibi_attention(query, query, query, inputs, DIM**-0.5, heads=heads)


def fake_mesh(size: int, rank: int):
    """What `AlibiHeadsParallel` reads of the TP mesh: its size and this rank's place in it."""
    return SimpleNamespace(size=lambda: size, get_local_rank=lambda: rank)


@pytest.mark.parametrize("n_head,size", [(12, 4), (12, 2), (8, 2), (16, 4)])
def test_the_heads_style_gives_each_rank_its_contiguous_global_heads(n_head, size):
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    style = ALL_PARALLEL_STYLES[ALIBI_HEADS]
    held = []
    for rank in range(size):
        module = SimpleNamespace(num_heads=n_head, heads=None)
        style.install_forward(module, fake_mesh(size, rank))
        held.extend(range(n_head)[module.heads])
    assert held == list(range(n_head))  # every head once, in order: rank r holds heads r H/N .. (r+1) H/N - 1


def test_the_heads_style_refuses_a_tp_size_that_does_not_divide_n_head():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    with pytest.raises(ValueError, match=r"n_head=12 is not divisible by tp_size=5.*\[1, 2, 3, 4, 6, 12\]"):
        ALL_PARALLEL_STYLES[ALIBI_HEADS].install_forward(SimpleNamespace(num_heads=12), fake_mesh(5, 0))
