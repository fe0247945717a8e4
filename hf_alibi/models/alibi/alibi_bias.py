"""The ALiBi math: per-head slopes and the additive attention bias, as small pure functions.

Press et al., 2022, "Train Short, Test Long": attention logit(i, j) = q_i . k_j / sqrt(d) - m_h * (i - j), j <= i;
bidirectional (encoders: jina-embeddings-v2, MosaicBERT) `- m_h * |i - j|` over every key.
"""

import math

import torch

from .configuration_alibi_gpt2 import static_scaling_factor


def _power_of_two_slopes(n: int, max_bias: float) -> list[float]:
    # m_h = 2 ** (-max_bias * h / n), h = 1..n: start = ratio = 2 ** (-max_bias / n)
    start = 2.0 ** (-max_bias / n)
    return [start**h for h in range(1, n + 1)]


def get_alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """Per-head ALiBi slopes, fp32, shape `(num_heads,)`, by the paper's rule.

    For a power of two `n` the slopes are `2 ** (-max_bias * h / n)`. Otherwise (the paper's code, also HF BLOOM,
    MPT, x-transformers): the slopes of the closest smaller power of two `c`, followed by every other slope of
    `2c` heads. 12 heads give 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5. The order is not monotone and
    checkpoints depend on it.
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
    if not math.isfinite(max_bias) or max_bias <= 0:
        raise ValueError(f"max_bias must be a positive finite number, got {max_bias!r}")
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _power_of_two_slopes(closest, max_bias)
    if closest < num_heads:
        slopes += _power_of_two_slopes(2 * closest, max_bias)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def slopes_from_config(config) -> torch.Tensor:
    """The slopes a config asks for, fp32 `(H,)`: its explicit `alibi_slopes`, else the paper's rule at
    `alibi_max_bias`; divided by a static `alibi_scaling.factor` (in fp32, as Jais divides). The length-dependent
    form is applied per forward (`length_scaled_slopes`)."""
    if config.alibi_slopes is not None:
        slopes = torch.tensor(config.alibi_slopes, dtype=torch.float32)
    else:
        slopes = get_alibi_slopes(config.n_head, config.alibi_max_bias)
    factor = static_scaling_factor(getattr(config, "alibi_scaling", None))  # older configs lack the field
    return slopes if factor == 1.0 else slopes / factor  # (H,)


def length_scaled_slopes(slopes: torch.Tensor, key_length, train_seq_len: int | None) -> torch.Tensor:
    """`slopes / max(1, K / train_seq_len)` for a forward attending `key_length` = K keys (Jais's and BTLM's
    `alibi_scaling = {"type": "linear", "train_seq_len": n}`); `slopes` itself when `train_seq_len` is None.

    K is a plain int, or a 0-d tensor (a static cache's filled length inside a compiled step: the scale is then a
    tensor op, no host sync) or a symbolic length. Like their `slopes / scale` with a Python float, the scale is
    rounded to fp32 once (`K / n` divided in fp32 is that same correctly rounded value)."""
    if train_seq_len is None:
        return slopes
    if isinstance(key_length, torch.SymInt):  # torch.export's dynamic length: a symbolic scale, no specialisation
        return slopes / torch.sym_max(key_length / train_seq_len, 1.0)  # (H,)
    if isinstance(key_length, int):
        scale = max(1.0, key_length / train_seq_len)
        return slopes if scale == 1.0 else slopes / scale  # (H,)
    return slopes / (key_length.float() / train_seq_len).clamp(min=1.0)  # (H,) or (R, H) for (R, 1) counts


def relative_distances(query_length: int, key_length: int, device=None, query_offset=None) -> torch.Tensor:
    """`i - j` for `query_length` queries starting at absolute position `query_offset`, against `key_length` keys.

    `query_offset` (the number of cached tokens) defaults to `key_length - query_length` (bottom-right alignment, as
    with a dynamic KV cache); a static cache passes it explicitly, possibly as a 0-d tensor (no host sync, no
    recompilation). Returns int64 `(query_length, key_length)`; entries are negative above the causal diagonal.
    """
    if query_offset is None:
        query_offset = key_length - query_length
    query_pos = torch.arange(query_length, device=device) + query_offset  # (q,)
    key_pos = torch.arange(key_length, device=device)  # (kv,)
    return query_pos[:, None] - key_pos[None, :]  # (q, kv)


def alibi_causal_bias(slopes: torch.Tensor, query_length: int, key_length: int, query_offset=None) -> torch.Tensor:
    """The additive causal ALiBi bias, fp32, `(H, q, kv)`: `-m_h * (i - j)` for `j <= i`, the fp32 minimum above.

    Built in the relative form `i - j` (never the `+m * j` shortcut, which is equal after softmax but loses
    precision at long lengths). The fp32 minimum rather than `-inf` keeps fully masked rows free of NaN.
    `query_offset` as in `relative_distances`.
    """
    distance = relative_distances(query_length, key_length, slopes.device, query_offset)  # (q, kv)
    bias = -slopes.float()[:, None, None] * distance.float()  # (H, q, kv)
    return bias.masked_fill(distance < 0, torch.finfo(torch.float32).min)  # (H, q, kv)


def alibi_bidirectional_bias(slopes: torch.Tensor, query_length: int, key_length: int, query_offset=0) -> torch.Tensor:
    """The additive symmetric ALiBi bias of an encoder, fp32, `(H, q, kv)`: `-m_h * |i - j|` for every key, query `i`
    at absolute position `query_offset + i` (`relative_distances`; 0 for a whole row)."""
    distance = relative_distances(query_length, key_length, slopes.device, query_offset).abs()  # (q, kv)
    return -slopes.float()[:, None, None] * distance.float()  # (H, q, kv)


def alibi_block_bias(slopes: torch.Tensor, n: int, causal: bool = True) -> torch.Tensor:
    """An (n x n) block's own bias in the slopes' dtype, (1, H, n, n): causal, -m * (a - b) for b <= a and the dtype's
    minimum above (a causal Toeplitz block); bidirectional (`causal` False), -m * |a - b| everywhere. The split's
    diagonal blocks (`attention_sdpa_split.SplitPlan`) use it; fp64 slopes give an fp64 block."""
    positions = torch.arange(n, device=slopes.device, dtype=slopes.dtype)  # (n,)
    distance = positions[:, None] - positions[None, :]  # (n, n)
    if not causal:
        return (-slopes[:, None, None] * distance.abs())[None]  # (1, H, n, n)
    bias = -slopes[:, None, None] * distance  # (H, n, n), the one H * n * n allocation: filled in place
    return bias.masked_fill_(distance < 0, torch.finfo(slopes.dtype).min)[None]  # (1, H, n, n)
