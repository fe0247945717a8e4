"""ALiBi attention on every backend: eager (the reference), SDPA, FlexAttention and FlashAttention-2.

The model calls `prepare_alibi_attention` once per forward; it builds whatever the backend needs (never sized by a
maximum length, never per layer), and every layer then calls `alibi_attention` with it. Query row `r` sits at absolute
position `query_offset + r`, where `query_offset` is the number of cached tokens (a 0-d tensor for static caches, so
compiled decoding neither syncs nor recompiles). A key `j` is visible to query `i` when `j <= i`, it is not padding,
and, in packed rows, it belongs to the same document. ALiBi depends on `i - j` alone, so left padding needs no
position shift and a packed document sees exactly the distances it would see alone: masking is all it takes.
"""

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .alibi import alibi_causal_bias
from .attention_sdpa_split import sdpa_alibi_split

SUPPORTED_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2")

# Rows per query chunk of SDPA's bias-bank path (`AlibiAttentionInputs.query_chunk`; the config's
# `alibi_sdpa_query_chunk`): each chunk's float mask is a view into one (H, chunk, kv) bias bank, so the bias never
# costs H * L * L memory and keys right of a chunk are never computed.
SDPA_QUERY_CHUNK = 256


@dataclass
class AlibiAttentionInputs:
    """What the layers of one forward share: the backend's prebuilt bias and the masking facts."""

    implementation: str
    slopes: torch.Tensor  # (H,) fp32
    query_length: int
    key_length: int
    query_offset: int | torch.Tensor  # absolute position of the first query = cached tokens
    key_padding: torch.Tensor | None = None  # (B, kv) bool, True = real token; None = no padding
    documents: torch.Tensor | None = None  # (B, kv) int document index of each token of packed rows; None = one each
    bias: torch.Tensor | None = None  # eager and sdpa: (B|1, H, q, kv); chunked sdpa: bank (B|1, H, chunk, kv)
    chunked: bool = False  # sdpa, queries ending at the last key: the split, or a bank sliced per query chunk
    padding_in_bias: bool = False  # chunked sdpa: the bank already hides padded keys (one chunk)
    block_mask: object | None = None  # flex_attention only
    # SDPA's path for multi-row, unpacked, dropout-free CPU calls outside compilation: the split (no bias tensor,
    # `attention_sdpa_split`) or the bias bank that every other SDPA call takes; and the bank's rows per chunk.
    sdpa_split: bool = True
    query_chunk: int = SDPA_QUERY_CHUNK
    bias_casts: dict = field(default_factory=dict)  # dtype -> `bias` cast to it; `bias` itself stays fp32

    def bias_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The prebuilt bias in the layers' compute dtype (autocast decides it), cast once per forward and dtype."""
        if self.bias.dtype == dtype:
            return self.bias
        if dtype not in self.bias_casts:  # clamp first: fp32's minimum would become -inf in fp16 (NaN on empty rows)
            self.bias_casts[dtype] = self.bias.clamp(min=torch.finfo(dtype).min).to(dtype)
        return self.bias_casts[dtype]


def _masked_min(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def _is_static(length) -> bool:
    """True for a plain int; False for a symbolic length (torch.export / dynamic-shape compile)."""
    return isinstance(length, int) and not isinstance(length, torch.SymInt)


def _key_padding(attention_mask: torch.Tensor | None, key_length: int) -> torch.Tensor | None:
    """The 2-D 0/1 mask as (B, kv) bool, or None when nothing is padded (checked only outside compilation)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (batch, keys) of 0/1, got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[-1] < key_length:  # a static cache longer than the mask: causality hides the rest
        attention_mask = F.pad(attention_mask, (0, key_length - attention_mask.shape[-1]), value=1)
    elif attention_mask.shape[-1] > key_length:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[-1]} positions but there are only {key_length} keys"
        )
    # An all-ones mask costs nothing to drop in eager mode; a compiled graph keeps it (no data-dependent branch).
    if not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None
    return attention_mask.bool()


def visible_keys(inputs: AlibiAttentionInputs, rows: slice = slice(None), keys: slice = slice(None)):
    """Padding and document visibility for query `rows` and `keys` as bool (B, 1, q', kv'), or None (all visible).

    Causality is not included: the bias carries it.
    """
    keep = None
    if inputs.key_padding is not None:
        keep = inputs.key_padding[:, None, None, keys]  # (B, 1, 1, kv')
    if inputs.documents is not None:
        documents = inputs.documents
        same = documents[:, None, rows, None] == documents[:, None, None, keys]  # (B, 1, q', kv')
        keep = same if keep is None else keep & same
    return keep


def prepare_alibi_attention(
    implementation: str,
    slopes: torch.Tensor,
    attention_mask: torch.Tensor | None,
    query_length: int,
    key_length: int,
    query_offset: int | torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
    sdpa_split: bool = True,
    query_chunk: int = SDPA_QUERY_CHUNK,
) -> AlibiAttentionInputs:
    """Build, once per forward, what `implementation` needs for ALiBi over `query_length` of `key_length` keys.

    `attention_mask` is the usual 2-D `(B, kv)` mask of 1 (real) and 0 (padding), or None. `query_offset` is the
    number of cached tokens (default `key_length - query_length`). `documents` (B, kv) numbers the documents of
    packed rows (no cache: `query_length == key_length`); a query only sees keys of its own document. For
    `"sdpa"`: `sdpa_split=False` sends the calls the split would serve to the bias bank instead, whose chunks have
    `query_chunk` rows (the config's `alibi_sdpa_split` and `alibi_sdpa_query_chunk`).
    """
    if implementation not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attn_implementation={implementation!r} is not supported by ALiBi GPT-2; choose one of "
            f"{SUPPORTED_ATTENTION}"
        )
    if query_offset is None:
        query_offset = key_length - query_length
    if documents is not None and documents.shape[-1] != key_length:
        raise ValueError(
            f"packed documents cover {documents.shape[-1]} tokens but there are {key_length} keys: packed rows "
            "(restarting position_ids or cu_seq_lens) cannot be combined with a cache"
        )
    key_padding = _key_padding(attention_mask, key_length)
    # A static cache hands every layer its whole buffer and counts its tokens in a 0-d tensor. Outside compilation a
    # prefill (or any multi-row step) reads that count once, so its keys are the filled ones only: the rest are
    # unwritten and causally hidden, and a bias over them would cost (q, max_cache_len) per head. One-row steps keep
    # the tensor: their bias is per key anyway, and reading the count would sync a device on every decoding step.
    if isinstance(query_offset, torch.Tensor) and query_length > 1 and not torch.compiler.is_compiling():
        query_offset = int(query_offset)
    filled = query_offset + query_length if isinstance(query_offset, int) else key_length
    if _is_static(filled) and _is_static(key_length) and filled < key_length:
        key_length = filled  # `alibi_attention` reads keys [0, filled) of the buffer
        key_padding = None if key_padding is None else key_padding[:, :filled]
    inputs = AlibiAttentionInputs(
        implementation, slopes.float(), query_length, key_length, query_offset, key_padding, documents,
        sdpa_split=sdpa_split, query_chunk=query_chunk,
    )  # fmt: skip
    # The split and the bank need plain ints and queries that end at the last key: no cache, dynamic caches, and
    # static caches outside compilation once cut to their filled part (above).
    bottom_right = (
        isinstance(query_offset, int)
        and _is_static(query_length)
        and _is_static(key_length)
        and query_offset + query_length == key_length
    )
    if implementation == "eager" or (implementation == "sdpa" and not bottom_right):
        # One (B|1, H, q, kv) bias: the reference, and SDPA's one-mask path for a static cache's compiled steps and
        # symbolic lengths (torch.export); a compiled decoding step has q = 1, so its bias is per key.
        bias = alibi_causal_bias(inputs.slopes, query_length, key_length, query_offset)[None]  # (1, H, q, kv)
        keep = visible_keys(inputs)  # (B, 1, q|1, kv) or None
        if keep is not None:
            bias = bias.masked_fill(~keep, _masked_min(torch.float32))  # (B, H, q, kv)
        inputs.bias = bias
    elif implementation == "sdpa":
        inputs.chunked = True  # the split needs no bias; the bank is built on first use (`_sdpa_bank`)
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
    heads: slice | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ALiBi attention for `query` (B, H, q, D) over `key`/`value` (B, H, kv, D). Returns ((B, q, H, D), weights).

    Weights (post-softmax, (B, H, q, kv)) are returned only by the eager path or when `output_attentions` asks for
    them, in which case the eager path runs for this call. `heads` is the slice of global head indices that `query`
    holds (a tensor-parallel rank's heads; None: all of them): their slopes and bias rows are the ones used.
    """
    if heads is not None:
        alibi = _for_heads(alibi, heads, query.shape[1])
    buffer = key.shape[2]
    if _is_static(alibi.key_length) and buffer > alibi.key_length:  # a static cache's buffer: its filled part only
        key, value = key[:, :, : alibi.key_length], value[:, :, : alibi.key_length]  # (B, H, kv, D) views
    if output_attentions or alibi.implementation == "eager":
        bias = alibi.bias if alibi.implementation == "eager" else None
        output, weights = eager_alibi_attention(query, key, value, alibi, scaling, dropout, bias)
        if output_attentions and weights.shape[-1] < buffer:  # asked for: they cover the buffer, 0 on unwritten slots
            weights = F.pad(weights, (0, buffer - weights.shape[-1]))  # (B, H, q, buffer)
        return output, weights
    if alibi.implementation == "sdpa":
        return sdpa_alibi_attention(query, key, value, alibi, scaling, dropout), None
    if alibi.implementation == "flex_attention":
        return flex_alibi_attention(query, key, value, alibi, scaling), None
    return flash_alibi_attention(query, key, value, alibi, scaling, dropout), None


def _for_heads(alibi: AlibiAttentionInputs, heads: slice, local_heads: int) -> AlibiAttentionInputs:
    """The inputs of the global heads `heads` only: their slopes, and their rows of a prebuilt bias (dim 1)."""
    if not isinstance(heads, slice) or len(range(alibi.slopes.shape[0])[heads]) != local_heads:
        raise ValueError(
            f"heads={heads!r} must be a slice of the {alibi.slopes.shape[0]} global heads with as many heads as the "
            f"query holds ({local_heads})"
        )
    bias = None if alibi.bias is None else alibi.bias[:, heads]  # (B|1, H', q|chunk, kv), a view
    return replace(alibi, slopes=alibi.slopes[heads], bias=bias, bias_casts={})


def eager_alibi_attention(query, key, value, alibi, scaling, dropout=0.0, bias=None):
    """The reference: scores in fp32, plus the fp32 relative bias, softmax in fp32."""
    if bias is None:
        bias = prepare_alibi_attention(
            "eager", alibi.slopes, alibi.key_padding, alibi.query_length, alibi.key_length, alibi.query_offset,
            alibi.documents,
        ).bias  # fmt: skip
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scaling  # (B, H, q, kv)
    weights = torch.softmax(scores + bias, dim=-1).to(value.dtype)  # (B, H, q, kv)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    output = torch.matmul(weights, value)  # (B, H, q, D)
    return output.transpose(1, 2), weights  # (B, q, H, D)


def _sdpa_bank(alibi: AlibiAttentionInputs, dtype: torch.dtype) -> torch.Tensor:
    """The bias of the last `chunk` queries against all keys, built once per forward; chunks' masks slice it."""
    if alibi.bias is None:
        chunk = min(alibi.query_length, alibi.query_chunk)
        bank = alibi_causal_bias(alibi.slopes, chunk, alibi.key_length)[None]  # (1, H, chunk, kv) fp32
        if chunk == alibi.query_length:  # one chunk (decoding, short inputs): fold padding and documents in once
            keep = visible_keys(alibi)
            if keep is not None:
                bank = bank.masked_fill(~keep, _masked_min(torch.float32))  # (B, H, q, kv)
            alibi.padding_in_bias = True
        alibi.bias = bank
    return alibi.bias_as(dtype)


def _use_split(alibi: AlibiAttentionInputs, query: torch.Tensor, dropout: float) -> bool:
    return (
        alibi.sdpa_split
        and alibi.documents is None
        and alibi.query_length > 1  # decoding: one row, whose once-per-forward bank row is already a per-key bias
        and dropout == 0.0  # the CPU flash kernel has no dropout
        and query.device.type == "cpu"
        and not torch.compiler.is_compiling()  # compiled and exported graphs keep to public ops
    )


def sdpa_alibi_attention(query, key, value, alibi, scaling, dropout=0.0):
    """SDPA for ALiBi: the split (no bias tensor), one float mask, or query chunks whose masks view a bias bank.

    Chunked: rows [s, e) sit at absolute positions offset + s .. offset + e - 1 and see keys [0, offset + e). With
    E = offset + e and n = e - s, the bank row a' = a + chunk - n and column c = j + kv - E hold exactly
    -m * ((offset + s + a) - j), so the chunk's mask is bank[:, :, chunk - n:, kv - E:].
    """
    if not alibi.chunked:
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=alibi.bias_as(query.dtype), dropout_p=dropout, scale=scaling
        )  # (B, H, q, D)
        return output.transpose(1, 2)  # (B, q, H, D)
    if _use_split(alibi, query, dropout):
        output = sdpa_alibi_split(query, key, value, alibi.slopes, alibi.query_offset, alibi.key_padding, scaling)
        return output.transpose(1, 2)  # (B, q, H, D)
    bank = _sdpa_bank(alibi, query.dtype)  # (B|1, H, chunk, kv)
    chunk, kv = bank.shape[2], alibi.key_length
    q_len, offset = alibi.query_length, alibi.query_offset
    outputs = []
    for start in range(0, q_len, chunk):
        end = min(start + chunk, q_len)
        n, visible = end - start, offset + end
        mask = bank[:, :, chunk - n :, kv - visible :]  # (B|1, H, n, visible), a view
        if not alibi.padding_in_bias:
            keep = visible_keys(alibi, slice(start, end), slice(0, visible))  # (B, 1, n|1, visible) or None
            if keep is not None:
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
    """Causal, padding- and document-aware: blocks that are all padding or another document are skipped."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset, key_padding, documents = alibi.query_offset, alibi.key_padding, alibi.documents

    def mask_mod(b, h, q_idx, kv_idx):
        keep = kv_idx <= q_idx + offset
        if key_padding is not None:
            keep = keep & key_padding[b, kv_idx]
        if documents is not None:
            keep = keep & (documents[b, q_idx] == documents[b, kv_idx])
        return keep

    per_row = key_padding if key_padding is not None else documents
    batch = None if per_row is None else per_row.shape[0]
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
    slopes, offset = alibi.slopes.to(query.device), alibi.query_offset

    def alibi_score(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)

    output = flex_attention(query, key, value, score_mod=alibi_score, block_mask=alibi.block_mask, scale=scaling)
    return output.transpose(1, 2)  # (B, q, H, D)


def _varlen_boundaries(segments: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative lengths (int32, with a leading 0) and the longest run of the kept tokens of `segments` (B, L)."""
    row_ids = segments + torch.arange(segments.shape[0], device=segments.device)[:, None] * (segments.shape[1] + 1)
    counts = torch.unique_consecutive(row_ids[keep], return_counts=True)[1]  # one count per (row, segment)
    return F.pad(counts.cumsum(0, dtype=torch.int32), (1, 0)), int(counts.max())


def flash_alibi_attention(query, key, value, alibi, scaling, dropout=0.0):
    """FlashAttention-2 with its own `alibi_slopes` (the stock transformers integration drops them).

    flash-attn's causal mask is bottom-right aligned and its bias is -m * |i + kv - q - j|, i.e. ALiBi's. Padded
    batches and packed rows go through the varlen kernel on the real tokens only, one segment per document.
    """
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as error:
        raise ImportError("attn_implementation='flash_attention_2' needs the flash-attn package") from error
    if not query.is_cuda:
        raise ValueError("attn_implementation='flash_attention_2' needs CUDA tensors; use 'sdpa' on CPU")
    key_padding, q_len = alibi.key_padding, alibi.query_length
    visible = int(alibi.query_offset) + q_len  # a static cache returns its whole buffer: keep the filled part
    if visible != key.shape[2]:
        key, value = key[:, :, :visible], value[:, :, :visible]
        key_padding = None if key_padding is None else key_padding[:, :visible]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, L, H, D)
    slopes = alibi.slopes.to(device=query.device, dtype=torch.float32)
    if key_padding is None and alibi.documents is None:
        return flash_attn_func(q, k, v, dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes)
    batch = q.shape[0]
    key_keep = key_padding if key_padding is not None else q.new_ones(batch, visible, dtype=torch.bool)  # (B, kv)
    query_keep = key_keep[:, visible - q_len :]  # (B, q)
    segments = alibi.documents if alibi.documents is not None else torch.zeros_like(key_keep, dtype=torch.long)
    cu_k, max_k = _varlen_boundaries(segments, key_keep)
    cu_q, max_q = _varlen_boundaries(segments[:, visible - q_len :], query_keep)
    out = flash_attn_varlen_func(
        q[query_keep], k[key_keep], v[key_keep], cu_q, cu_k, max_q, max_k,
        dropout, softmax_scale=scaling, causal=True, alibi_slopes=slopes,
    )  # (real queries, H, D)  # fmt: skip
    output = q.new_zeros(batch, q_len, *q.shape[2:])  # (B, q, H, D); padded queries stay zero
    output[query_keep] = out
    return output


def packed_documents(position_ids: torch.Tensor, batch: int) -> torch.Tensor | None:
    """Document index of each token of rows whose `position_ids` restart (packed rows), as (B, L) int64, or None.

    transformers' rule for packed sequences: a new document starts wherever a position is not its predecessor + 1.
    Plain positions (0, 1, 2, ...) give None in eager mode; a compiled graph keeps the (all-zero) indices rather
    than branch on data.
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be (batch, length) or (length,), got shape {tuple(position_ids.shape)}")
    position_ids = position_ids.expand(batch, -1)  # (B, L); positions are sometimes given for one row only
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)  # (B, L)
    documents = (step != 1).cumsum(-1)  # (B, L)
    if not torch.compiler.is_compiling() and not bool(documents[:, -1].any()):
        return None
    return documents


def documents_from_cu_seq_lens(cu_seq_lens: torch.Tensor, length: int) -> torch.Tensor:
    """Document index (1, L) of a flattened row from flash-attention's cumulative lengths `[0, l1, l1 + l2, ...]`."""
    if cu_seq_lens.dim() != 1 or (not torch.compiler.is_compiling() and int(cu_seq_lens[-1]) != length):
        raise ValueError(
            f"cu_seq_lens must be 1-D cumulative lengths ending at the row length {length}, got {cu_seq_lens.tolist()}"
        )
    positions = torch.arange(length, device=cu_seq_lens.device)  # (L,)
    return torch.searchsorted(cu_seq_lens[1:].to(positions.dtype), positions, right=True)[None]  # (1, L)
