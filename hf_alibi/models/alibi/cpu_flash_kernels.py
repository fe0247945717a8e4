"""PyTorch's private CPU flash-attention ops, as the split and the segmented decoding rows use them: one call's
output and log-sum-exp (`_flash`), its backward at a given output and log-sum-exp (`_flash_backward`), and the probe
that checks once that they still mean that (`split_kernels_work`; any failure selects the public paths); and the
split's calls on them (`attend_diagonals`, `attend`), merged exactly by their log-sum-exps, with the autograd function
whose backward differentiates each call at the merged output and log-sum-exp (`_SplitAttention`; the split's
`SplitPlan` says which calls: `attention_sdpa_split.py` imports this module, never the other way round, so the
`plan` arguments below are read by their attributes alone).
"""

import functools

import torch

from .attention_sdpa_split_floor import backward_lse

# Fewest query rows per part when a one-head call's backward is cut into parts for the threads (`_flash_backward`):
# the kernel's backward tiles 64 rows at a time
_BACKWARD_PART_ROWS = 64


@functools.cache
def split_kernels_work() -> bool:
    """Whether the private CPU flash ops exist and still mean what the split relies on (checked once, on CPU).

    The forward must return the natural-log log-sum-exp of the masked scores, and the backward must accept a given
    output and log-sum-exp: both are compared with a float64 formula on a tiny problem.
    """
    try:  # grad on and autocast off, whatever the first caller's context (inference mode, bf16 autocast)
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
            return _probe_split_kernels()
    except Exception:  # any failure of a private op (missing, renamed, new signature) selects the public path
        return False


def _probe_split_kernels() -> bool:
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    generator = torch.Generator().manual_seed(0)  # device="cpu" everywhere: a default-device context may be meta
    query, key, value, grad = torch.randn(4, 1, 2, 5, 8, generator=generator, device="cpu")  # (B, H, L, D) each
    mask = torch.randn(1, 2, 1, 5, generator=generator, device="cpu")  # (1, H, 1, kv), broadcast over rows
    for causal in (False, True):  # the prefix call, and the diagonal call (its causal flag and mask together)
        exact = [t.double().requires_grad_() for t in (query, key, value)]
        scores = exact[0] @ exact[1].transpose(-1, -2) * 0.5 + mask.double()  # (B, H, q, kv)
        if causal:
            scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool, device="cpu").triu(1), -torch.inf)
        expected = torch.softmax(scores, -1) @ exact[2]  # (B, H, q, D)
        expected.backward(grad.double())
        output, lse = forward(query, key, value, is_causal=causal, attn_mask=mask, scale=0.5)
        grads = backward(grad, query, key, value, output, lse, 0.0, causal, attn_mask=mask, scale=0.5)
        pairs = [(output, expected), (lse, torch.logsumexp(scores, -1))] + list(zip(grads, (t.grad for t in exact)))
        if not all(torch.allclose(got.double(), want, atol=1e-5) for got, want in pairs):
            return False
    return True


def _flash(query, key, value, mask, scaling, causal=False):
    """(B, H, n, D) output and (B, H, n) fp32 log-sum-exp of one masked attention call on the CPU flash kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, is_causal=causal, attn_mask=mask, scale=scaling
    )


def _flash_backward(grad, query, key, value, output, lse, mask, scaling, causal=False):
    """(dq, dk, dv) of one call on the CPU flash kernel's backward, given the output and log-sum-exp it is taken at.

    The backward kernel spreads its work over batch x heads only (each task walks all its rows, since its key
    gradients add up over them), so a call of one head (certified skipping's ranged calls) ran on one thread: 1.27 ms
    for 256 rows x 1024 keys with 2 threads, 1.33 ms with one. A non-causal call with fewer batch x heads than
    threads has its rows cut into that many parts, stacked on the batch dimension over the same keys (a stride-0
    view), and the parts' key gradients summed: rows are independent given o and l, so it is the same gradient.
    """
    batch, heads, n, _ = query.shape
    parts = max(1, torch.get_num_threads() // (batch * heads)) if batch == 1 and not causal else 1
    while parts > 1 and (n % parts or n // parts < _BACKWARD_PART_ROWS):
        parts -= 1
    if parts == 1:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, output, lse, 0.0, causal, attn_mask=mask, scale=scaling
        )

    def split(tensor):  # (1, h, n, ...) -> (parts, h, n / parts, ...), a view
        return tensor[0].unflatten(1, (parts, n // parts)).transpose(0, 1)

    keys = [tensor.expand(parts, *tensor.shape[1:]) for tensor in (key, value)]  # (parts, h, kv, D): the same keys
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        split(grad), split(query), *keys, split(output), split(lse), 0.0, False, attn_mask=mask, scale=scaling
    )  # (parts, h, n / parts, D), (parts, h, kv, D) x 2
    return dq.transpose(0, 1).flatten(1, 2)[None], dk.sum(0, keepdim=True), dv.sum(0, keepdim=True)


def _like_kernel_output(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (B, H, L, D) tensor laid out as (B, L, H, D), as the kernel's own outputs are: the model's
    `transpose(1, 2).reshape(B, L, H * D)` is then a view, not a copy (what GPT-2's single SDPA call gets)."""
    batch, heads, length, dim = tensor.shape
    return torch.empty(batch, length, heads, dim, dtype=dtype, device=tensor.device).transpose(1, 2)


def _blocks(tensor, start, n, stride, count, dim=2):
    """`count` blocks of `n` positions along `dim`, the first at `start`, every `stride`: a view whose dim 0 walks
    the blocks (`tensor`'s dim 0 must then have size 1), (count, ..., n, ...); with count 1 a plain slice."""
    if count == 1:
        return tensor.narrow(dim, start, n)
    sizes, strides = list(tensor.shape), list(tensor.stride())
    sizes[0], strides[0], sizes[dim] = count, stride * strides[dim], n
    return tensor.as_strided(sizes, strides, tensor.storage_offset() + start * strides[dim])


def attend_diagonals(plan, query, key, value, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `plan`'s diagonal groups (no autograd): the running output (B, H, q, D) and log-sum-exp (B, H, q) that
    they start, in the plan's dtype. Every row has exactly one diagonal call.

    When one strided call covers every row and head (batch 1, q a multiple of the block rows), its own results are
    the running ones: for inputs laid out as the model's, the kernel writes its output as (count, n, H, D) and its
    log-sum-exp as (count, n, H) in memory, which is exactly (1, q, H, D) and (1, q, H). They are viewed: no second
    q x H x D buffer, no copy.
    """
    diagonals = [group for group in plan.groups if group.diagonal]
    batch, heads, q_len, dim = query.shape
    if plan.tiled_diagonals:
        n = diagonals[0].end  # rows per block: the group's calls tile rows [0, q) in `count` blocks
        mask, _, rows, keys = plan.views(diagonals[0])
        out, lse = _flash(rows(query), keys(key), keys(value), mask, scaling, plan.causal)  # (count, H, n, .)
        if (
            out.dtype == plan.dtype
            and out.stride() == (n * heads * dim, dim, heads * dim, 1)
            and (lse.stride() == (n * heads, 1, heads))
        ):
            return (
                out.as_strided((1, heads, q_len, dim), (q_len * heads * dim, dim, heads * dim, 1)),
                lse.as_strided((1, heads, q_len), (q_len * heads, 1, heads)),
            )
        output = _like_kernel_output(query, plan.dtype)  # another layout (or dtype): copied in, not recomputed
        running = torch.empty(query.shape[:3], dtype=plan.dtype, device=query.device)  # (B, H, q)
        rows(output).copy_(out)
        rows(running).copy_(lse)
        return output, running
    output = _like_kernel_output(query, plan.dtype)  # (B, H, q, D)
    lse = torch.empty(query.shape[:3], dtype=plan.dtype, device=query.device)  # (B, H, q)
    attend(plan, diagonals, query, key, value, scaling, output, lse)
    return output, lse


def attend(plan, groups, query, key, value, scaling, output, lse) -> None:
    """Run `groups` of `plan` (no autograd) into the running `output` (B, H, q, D) and `lse` (B, H, q), in place.

    A diagonal group writes its rows' running results (every row has exactly one diagonal call, and diagonal groups
    run first); every other call merges into them: o += share * (o_call - o), l = logaddexp(l, l_call).
    """
    for group in groups:
        diagonal = group.diagonal
        mask, shift, rows, keys = plan.views(group)
        causal = diagonal and plan.causal
        out, lse_call = _flash(rows(query), keys(key), keys(value), mask, scaling, causal)  # (., H, n, D)
        lse_call = lse_call if shift is None else lse_call - shift  # (B|count, H, n), true logits' frame
        running_out, running_lse = rows(output), rows(lse)
        if diagonal:  # the rows' first call: its result is the running one
            running_out.copy_(out)
            running_lse.copy_(lse_call)
            continue
        share = torch.sigmoid(lse_call - running_lse)[..., None]  # (., H, n, 1): this call's part of the mass
        running_out.lerp_(out.to(output.dtype), share)  # o += share * (o_call - o), in place
        running_lse.copy_(torch.logaddexp(running_lse, lse_call))


class _SplitAttention(torch.autograd.Function):
    """The split on the CPU flash kernels, forward and backward; see the module docstring for the math.

    `diagonals`, when given, are the running (output, log-sum-exp) of the plan's first `started` groups (its diagonal
    groups, then its near calls if any), already computed (certified skipping computes them first to certify the
    rest): the forward then runs the other groups only. The backward is the same either way: every call of the plan,
    differentiated with the final output and log-sum-exp.
    """

    @staticmethod
    def forward(ctx, query, key, value, plan, scaling, diagonals=None):
        ctx.plan, ctx.scaling = plan, scaling
        if plan.one_call and diagonals is None:  # one diagonal call (short rows, nothing cached): the kernel's answer
            mask, _, rows, keys = plan.views(plan.groups[0])
            output, lse = _flash(rows(query), keys(key), keys(value), mask, scaling, plan.causal)  # (B, H, q, D)
            ctx.save_for_backward(query, key, value, output, lse)
            return output
        # Running (output, log-sum-exp) of each row over the calls so far, in fp32 (fp64 for fp64 inputs); the
        # diagonal groups come first and cover every row once, so they write these, and the others merge into them
        if diagonals is None:  # the diagonal groups (the plan's first): one strided call's own output, if it can be
            diagonals = attend_diagonals(plan, query, key, value, scaling)  # (B, H, q, D), (B, H, q)
            started = sum(group.diagonal for group in plan.groups)
        else:  # the plan's `started` groups' results (its diagonals and near calls), already computed: merged into
            started = plan.started
        (output, lse), groups = diagonals, plan.groups[started:]
        attend(plan, groups, query, key, value, scaling, output, lse)
        output = output.to(query.dtype)
        ctx.save_for_backward(query, key, value, output, lse)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse = ctx.saved_tensors
        plan, query_offset, q_len = ctx.plan, ctx.plan.query_offset, query.shape[2]
        grad_output = grad_output.to(query.dtype)
        if plan.one_call and key.shape[2] == q_len:  # the forward's one call, differentiated as it is
            mask, _, _, _ = plan.views(plan.groups[0])
            dq, dk, dv = _flash_backward(grad_output, query, key, value, output, lse, mask, ctx.scaling, plan.causal)
            return dq, dk, dv, None, None, None
        # Summed in fp32 (fp64 for fp64 inputs). The diagonal groups come first and cover every query row and every
        # key in [query_offset, query_offset + q) exactly once, so they write their gradients (no zero fill, no add);
        # only cached keys [0, query_offset) and a static cache's unread tail are zeroed; the other calls add into them.
        grads = [_like_kernel_output(t, lse.dtype) for t in (query, key, value)]  # (B, H, L, D)
        for grad in grads[1:]:
            grad[:, :, :query_offset].zero_()
            grad[:, :, query_offset + q_len :].zero_()
        for group in plan.groups:
            diagonal = group.diagonal
            mask, shift, rows, keys = plan.views(group)
            lse_call = rows(lse) if shift is None else rows(lse) + shift  # (B|count, H, n), the call's frame
            if shift is not None and plan.floors is not None:  # rows whose weights here are negligible: exactly 0
                lse_call = backward_lse(lse_call, rows(query), keys(key), mask, ctx.scaling, plan.visible)
            dq, dk, dv = _flash_backward(
                rows(grad_output),
                rows(query),
                keys(key),
                keys(value),
                rows(output),
                lse_call,
                mask,
                ctx.scaling,
                causal=diagonal and plan.causal,
            )
            rows(grads[0]).copy_(dq) if diagonal else rows(grads[0]).add_(dq)
            for grad, part in ((grads[1], dk), (grads[2], dv)):
                keys(grad).copy_(part) if diagonal else plan.add_keys(group, grad, part)
        grad_query, grad_key, grad_value = (g.to(t.dtype) for g, t in zip(grads, (query, key, value)))
        return grad_query, grad_key, grad_value, None, None, None
