"""PyTorch's private CPU flash-attention ops, as the split and the segmented decoding rows use them: one call's
output and log-sum-exp (`_flash`), its backward at a given output and log-sum-exp (`_flash_backward`), and the probe
that checks once that they still mean that (`split_kernels_work`; any failure selects the public paths).
"""

import functools

import torch

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

