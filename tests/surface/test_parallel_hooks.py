"""The tensor-parallel hooks `tensor_parallel_alibi_gpt2.py` stands on (transformers 5.24 and 5.25), one test each."""

import inspect

import pytest
import torch

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi.models.alibi import tensor_parallel_alibi_gpt2 as tp_styles
from hf_alibi.models.alibi import transformers_compat

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
