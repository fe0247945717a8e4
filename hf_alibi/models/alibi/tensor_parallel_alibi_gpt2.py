"""Tensor parallelism for ALiBi GPT-2 on transformers' own engine (`from_pretrained(..., tp_plan="auto")` or
`distributed_config=DistributedConfig(tp_size=N)`): the plan's styles for GPT-2's `Conv1D` layout, and the heads
each rank holds.

transformers' styles shard `nn.Linear`, whose weight is (out, in); GPT-2's `Conv1D` stores (in, out), so their
placements would cut the wrong dimension (and they look for `in_features` / `out_features`, which `Conv1D` lacks).
`c_attn` also packs q, k and v along its outputs: a plain column split would hand rank 0 all of q and part of k. The
styles below, registered by name in transformers' table of parallel styles (`ALL_PARALLEL_STYLES`, which plans are
validated against and applied from), are the `Conv1D` counterparts of Llama's `colwise` / `rowwise`:

- `conv1d_colwise` (`mlp.c_fc`): weight `Shard(1)`, bias `Shard(0)`: each rank computes a contiguous slice of the
  outputs from the replicated input.
- `conv1d_qkv_colwise` (`attn.c_attn`): the same split within each of the three packed blocks (`_StridedShard` with
  split factor 3, the placement transformers' own `packed_colwise` uses for fused gate|up): rank r gets
  `[q_r | k_r | v_r]`, the queries, keys and values of heads `r H/N .. (r+1) H/N - 1`.
- `conv1d_rowwise` (`attn.c_proj`, `mlp.c_proj`): weight `Shard(0)`, bias replicated: each rank multiplies its slice of
  the inputs; the partial sums are all-reduced and the bias added once.
- `alibi_heads` (`attn`): tells the attention module which global heads it holds (`module.heads`), so that each rank
  uses *those* heads' slopes, in the paper's interleaved order (a rank that recomputed slopes for its local head count,
  or took the first heads', would be silently wrong: Megatron-DeepSpeed issue 227, FlashInfer issue 1606).

The embedding and the LM head take Llama's styles (`embedding_rowwise`, `colwise_gather_output`): both shard the tied
(V, C) matrix on the vocabulary, so the tie survives. Every style runs its module on local tensors; the backward is
exact because DTensor all-reduces the partial input gradients of the column splits.

Written against the parallel-style API of transformers 5.24 and 5.25 (`transformers_compat.py`, tensor-parallel
section). On older releases (this file ships with every checkpoint, and loads on 4.57 and every 5.x) it registers
nothing, the model runs on one device, and `check_sharding_request` refuses `from_pretrained(..., tp_plan=...)` and
its kin in one line naming the release they need.
"""

import contextlib

from torch import nn

from .transformers_compat import (
    ALL_PARALLEL_STYLES,
    TENSOR_PARALLEL_SUPPORTED,
    TensorParallelLayer,
    require_tensor_parallel,
)

if TENSOR_PARALLEL_SUPPORTED:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    # private torch, and what transformers' own `packed_colwise` shards with (5.24, 5.25; torch 2.13)
    from torch.distributed.tensor.placement_types import _StridedShard

# Style names of the plan (`AlibiGPT2Config.base_model_tp_plan`), registered below.
CONV1D_COLWISE = "conv1d_colwise"
CONV1D_QKV_COLWISE = "conv1d_qkv_colwise"
CONV1D_ROWWISE = "conv1d_rowwise"
ALIBI_HEADS = "alibi_heads"
# `from_pretrained`'s arguments that ask transformers to shard a model, on 4.57 to 5.25 alike
SHARDING_ARGUMENTS = ("tp_plan", "tp_size", "device_mesh", "distributed_config")


def check_sharding_request(load_kwargs: dict) -> None:
    """Refuse in one line `from_pretrained` arguments asking for tensor parallelism or FSDP2 where the plan's styles
    are not registered (transformers before `TENSOR_PARALLEL_TRANSFORMERS`). Left alone, those releases set up the
    process group and build the model, then reject the plan's unknown style names ("Unsupported tensor parallel style
    conv1d_colwise", "Unsupported parallel styles: {...}") without saying that a newer transformers knows them."""
    asked = [name for name in SHARDING_ARGUMENTS if load_kwargs.get(name) is not None]
    if load_kwargs.get("tp_size") == 1:  # one rank: nothing is sharded
        asked.remove("tp_size")
    if asked:
        require_tensor_parallel(f"Sharding ALiBi GPT-2 ({', '.join(f'{name}=' for name in asked)})")


def _shard(module: nn.Module, name: str, mesh, placement) -> None:
    """Replace the (meta) parameter `name` of `module` by a DTensor placeholder with `placement` on `mesh`."""
    meta = module._parameters.get(name)
    if meta is None:  # `bias=False` (MPT): nothing to shard
        return
    module._parameters[name] = nn.Parameter(
        distribute_tensor(meta, mesh, [placement], src_data_rank=None), requires_grad=meta.requires_grad
    )


# Every hook below takes the keywords 5.25 passes (`config=`, `mesh_manager=`; `config=` to
# `transform_output_post_forward`) and 5.24 does not: the Conv1D layout and the heads need neither.


class Conv1DColwiseParallel(TensorParallelLayer):
    """Column split of a `Conv1D` (weight (in, out)); `packed` blocks (q|k|v: 3) are each split the same way."""

    def __init__(self, packed: int = 1):
        self.packed = packed

    def should_use_local_tensors(self, module) -> bool:
        return True

    def shard_param(self, module, param, mesh, *, config=None, mesh_manager=None):
        dim = -1  # the output features: the last dim of the (in, out) weight, the only one of the bias
        placement = Shard(dim) if self.packed == 1 else _StridedShard(dim=dim, split_factor=self.packed)
        _shard(module, param, mesh, placement)

    def transform_inputs_pre_forward(self, module, args, kwargs, mesh):
        # Replicated input times column-split weight: each rank's input gradient is a partial sum, which DTensor
        # all-reduces in the backward (the forward is a no-op view).
        hidden = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (hidden.to_local(grad_placements=[Partial()]), *args[1:]), kwargs


class Conv1DRowwiseParallel(TensorParallelLayer):
    """Row split of a `Conv1D`: weight `Shard(0)` (its inputs), bias replicated and added after the all-reduce."""

    def should_use_local_tensors(self, module) -> bool:
        return True

    def shard_param(self, module, param, mesh, *, config=None, mesh_manager=None):
        _shard(module, param, mesh, Replicate() if param == "bias" else Shard(0))

    @contextlib.contextmanager
    def context_around_forward(self, module, mesh):
        bias = module._parameters.get("bias")
        module._parameters["bias"] = None  # each rank's product is a partial sum: the bias must join once, after it
        try:
            with super().context_around_forward(module, mesh):  # local shards of the parameters
                yield
        finally:
            module._parameters["bias"] = bias

    def transform_output_post_forward(self, module, output, mesh, config=None):
        output = DTensor.from_local(output, mesh, [Partial()], run_check=False)
        output = output.redistribute(placements=[Replicate()]).to_local()  # (B, q, C), all-reduced, differentiable
        bias = module._parameters.get("bias")
        if bias is not None:
            output = output + (bias.to_local() if isinstance(bias, DTensor) else bias)
        return output


class AlibiHeadsParallel(TensorParallelLayer):
    """Sets `module.heads`, the global heads an attention module holds on this rank; its forward is left as it is."""

    def install_forward(self, module, mesh, *, config=None, mesh_manager=None):
        heads, size, rank = module.num_heads, mesh.size(), mesh.get_local_rank()
        if heads % size:
            raise ValueError(
                f"n_head={heads} is not divisible by tp_size={size}: tensor parallelism splits whole heads, give "
                f"every rank the same number (tp_size one of {[n for n in range(1, heads + 1) if heads % n == 0]})"
            )
        per_rank = heads // size
        module.heads = slice(rank * per_rank, (rank + 1) * per_rank)  # the c_attn split gives these heads' q, k, v
        return module


if TENSOR_PARALLEL_SUPPORTED:
    ALL_PARALLEL_STYLES.register(CONV1D_COLWISE, Conv1DColwiseParallel())
    ALL_PARALLEL_STYLES.register(CONV1D_QKV_COLWISE, Conv1DColwiseParallel(packed=3))
    ALL_PARALLEL_STYLES.register(CONV1D_ROWWISE, Conv1DRowwiseParallel())
    ALL_PARALLEL_STYLES.register(ALIBI_HEADS, AlibiHeadsParallel())
