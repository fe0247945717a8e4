"""ALiBi attention on every backend: eager (the reference), SDPA, FlexAttention and FlashAttention-2.

The model calls `prepare_alibi_attention` once per forward; it builds whatever the backend needs (never sized by a
maximum length, never per layer), and every layer then calls `alibi_attention` with it. Queries are the last
`q` of `kv` positions (bottom-right alignment: with a KV cache the query offset is the number of cached tokens).
Padding is a key mask only: ALiBi depends on `i - j` alone, so left padding needs no position shift.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .alibi import alibi_causal_bias

SUPPORTED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2")

# SDPA processes queries in chunks of this many rows: each chunk's float mask is a view into one (H, chunk, kv)
# bias bank, so the bias never costs H * L * L memory and keys right of a chunk (fully masked) are never computed.
SDPA_QUERY_CHUNK = 256


@dataclass
class AlibiAttentionInputs:
    """What the layers of one forward share: the backend's prebuilt bias and the masking facts."""

    implementation: str
    slopes: torch.Tensor  # (H,) fp32
    query_length: int
    key_length: int
    key_padding: torch.Tensor | None  # (B, kv) bool, True = real token; None = no padding
    bias: torch.Tensor | None = None  # eager: (B|1, H, q, kv); sdpa: bank (B|1, H, chunk, kv); others: None
    padding_in_bias: bool = False  # sdpa: the bank already hides padded keys (one chunk, built once per forward)
    block_mask: object | None = None  # flex_attention only

    @property
    def offset(self) -> int:
        return self.key_length - self.query_length  # cached tokens before the first query

    def bias_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The prebuilt bias in the layers' compute dtype (autocast decides it), cast once per forward."""
        if self.bias.dtype != dtype:  # clamp first: fp32's minimum would become -inf in fp16 (NaN on empty rows)
            self.bias = self.bias.clamp(min=torch.finfo(dtype).min).to(dtype)
        return self.bias


def _masked_min(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def prepare_alibi_attention(
    implementation: str,
    slopes: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_length: int,
    key_length: int,
) -> AlibiAttentionInputs:
    """Build, once per forward, what `implementation` needs for ALiBi over `query_length` of `key_length` keys.

    `attention_mask` is the usual 2-D `(B, kv)` mask of 1 (real) and 0 (padding), or None.
    """
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported by ALiBi GPT-2; choose one of "
            f"{SUPPORTED_ATTENTION}"
        )
    key_padding = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask must be 2-D (batch, keys) of 0/1, got shape {tuple(attention_mask.shape)}"
            )
        if attention_mask.shape[-1] < key_length:  # e.g. a static cache longer than the mask: causal hides the rest
            attention_mask = F.pad(attention_mask, (0, key_length - attention_mask.shape[-1]), value=1)
        elif attention_mask.shape[-1] > key_length:
            raise ValueError(
                f"attention_mask covers {attention_mask.shape[-1]} positions but there are only {key_length} keys"
            )
        if not bool(attention_mask.all()):
            key_padding = attention_mask.bool()
    inputs = AlibiAttentionInputs(implementation, slopes.float(), query_length, key_length, key_padding)

    if implementation == "eager":
        bias = alibi_causal_bias(inputs.slopes, query_length, key_length)[None]  # (1, H, q, kv) fp32
        if key_padding is not None:
            bias = bias.masked_fill(~key_padding[:, None, None, :], _masked_min(torch.float32))  # (B, H, q, kv)
        inputs.bias = bias
    elif implementation == "sdpa":
        chunk = min(query_length, SDPA_QUERY_CHUNK)
        # The bias of the last `chunk` queries against all keys; every other chunk's mask is a slice of it.
        bank = alibi_causal_bias(inputs.slopes, chunk, key_length)[None]  # (1, H, chunk, kv) fp32
        if key_padding is not None and chunk == query_length:  # one chunk (decoding, short inputs): mask pads once
            bank = bank.masked_fill(~key_padding[:, None, None, :], _masked_min(torch.float32))  # (B, H, q, kv)
            inputs.padding_in_bias = True
        inputs.bias = bank
    elif implementation == "flex_attention":
        inputs.block_mask = _flex_block_mask(inputs, slopes.device)
    return inputs


def alibi_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    alibi: AlibiAttentionInputs,
    scaling: float,
    dropout: float = 0.0,
    output_attentions: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ALiBi attention for `query` (B, H, q, D) over `key`/`value` (B, H, kv, D). Returns ((B, q, H, D), weights).

    Weights (post-softmax, (B, H, q, kv)) are returned only by the eager path or when `output_attentions` asks for
    them, in which case the eager path runs for this call.
    """
    if output_attentions or alibi.implementation == "eager":
        bias = alibi.bias if alibi.implementation == "eager" else None
        return eager_alibi_attention(query, key, value, alibi, scaling, dropout, bias)
    if alibi.implementation == "sdpa":
        return sdpa_alibi_attention(query, key, value, alibi, scaling, dropout), None
    if alibi.implementation == "flex_attention":
        return flex_alibi_attention(query, key, value, alibi, scaling), None
    return flash_alibi_attention(query, key, value, alibi, scaling, dropout), None


def eager_alibi_attention(query, key, value, alibi, scaling, dropout=0.0, bias=None):
    """The reference: scores in fp32, plus the fp32 relative bias, softmax in fp32."""
    if bias is None:
        bias = prepare_alibi_attention(
            "eager", alibi.slopes, alibi.key_padding, alibi.query_length, alibi.key_length
        ).bias
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling  # (B, H, q, kv)
    weights = torch.softmax(scores + bias, dim=-1).to(value.dtype)  # (B, H, q, kv)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    output = torch.matmul(weights, value)  # (B, H, q, D)
    return output.transpose(1, 2), weights  # (B, q, H, D)


def sdpa_alibi_attention(query, key, value, alibi, scaling, dropout=0.0):
    """SDPA over query chunks; each chunk's float mask is a view into the bias bank (plus padding when present).

    Chunk rows [s, e) sit at absolute positions offset + s .. offset + e - 1 and see keys [0, offset + e). With
    E = offset + e and n = e - s, the bank row a' = a + chunk - n and column c = j + kv - E hold exactly
    -m * ((offset + s + a) - j), so the chunk's mask is bank[:, :, chunk - n:, kv - E:].
    """
    bank = alibi.bias_as(query.dtype)  # (B|1, H, chunk, kv)
    chunk, kv = bank.shape[2], alibi.key_length
    q_len, offset = alibi.query_length, alibi.offset
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        n, visible = end - start, offset + end
        mask = bank[:, :, chunk - n :, kv - visible :]  # (B|1, H, n, visible), a view
        if alibi.key_padding is not None and not alibi.padding_in_bias:
            keep = alibi.key_padding[:, None, None, :visible]  # (B, 1, 1, visible)
            mask = mask.masked_fill(~keep, _masked_min(mask.dtype))  # (B, H, n, visible)
        out = F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, :visible],
            value[:, :, :visible],
            attn_mask=mask,
            dropout_p=dropout,
            scale=scaling,
        )  # (B, H, n, D)
        outputs.append(out)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # (B, H, q, D)
    return output.transpose(1, 2)  # (B, q, H, D)


def _flex_block_mask(alibi: AlibiAttentionInputs, device):
    from torch.nn.attention.flex_attention import create_block_mask

    offset, key_padding = alibi.offset, alibi.key_padding

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    def causal_and_real(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & key_padding[b, kv_idx]

    batch = None if key_padding is None else key_padding.shape[0]
    mask_mod = causal if key_padding is None else causal_and_real
    return create_block_mask(mask_mod, batch, None, alibi.query_length, alibi.key_length, device=device)


def flex_alibi_attention(query, key, value, alibi, scaling):
    """FlexAttention with the analytic ALiBi `score_mod`: no bias tensor at all, masked blocks skipped.

    On CPU this runs FlexAttention's unfused path unless the model is under `torch.compile`.
    """
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type == "cpu" and query.requires_grad:
        raise ValueError(
            "attn_implementation='flex_attention' has no backward pass on CPU in this torch version: train with "
            "'sdpa' on CPU, or run inference under torch.no_grad()"
        )
    slopes, offset = alibi.slopes.to(query.device), alibi.offset

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)

    output = flex_attention(query, key, value, score_mod=alibi_score, block_mask=alibi.block_mask, scale=scaling)
    return output.transpose(1, 2)  # (B, q, H, D)


def flash_alibi_attention(query, key, value, alibi, scaling, dropout=0.0):
    """FlashAttention-2 with its own `alibi_slopes` (the stock transformers integration drops them).

    flash-attn's causal mask is bottom-right aligned and its bias is -m * |i + kv - q - j|, i.e. ALiBi's.
    Padded batches go through the varlen kernel on the real tokens only.
    """
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError("attn_implementation='flash_attention_2' needs the flash-attn package") from error
    if not query.is_cuda:
        raise ValueError("attn_implementation='flash_attention_2' needs CUDA tensors; use 'sdpa' on CPU")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D)
    slopes = alibi.slopes.to(device=query.device, dtype=torch.float32)
    if alibi.key_padding is None:
        return flash_attn_func(q, k, v, dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes)
    batch, q_len = q.shape[:2]
    key_keep = alibi.key_padding  # (B, kv)
    query_keep = key_keep[:, alibi.offset :]  # (B, q)
    k_lens, q_lens = key_keep.sum(-1, dtype=torch.int32), query_keep.sum(-1, dtype=torch.int32)
    cu_k = F.pad(k_lens.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = F.pad(q_lens.cumsum(0, dtype=torch.int32), (1, 0))
    out = flash_attn_varlen_func(
        q[query_keep], k[key_keep], v[key_keep], cu_q, cu_k, int(q_lens.max()), int(k_lens.max()),
        dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes,
    )  # (real queries, H, D)
    output = q.new_zeros(batch, q_len, *q.shape[2:])  # (B, q, H, D); padded queries stay zero
    output[query_keep] = out
    return output
