"""The float64 ALiBi attention that every backend test compares against, written out in plain PyTorch, once; and
the whole model around it (`reference_logits`: GPT-2 blocks with the switches Jais and BTLM need), from a state dict.

softmax(q . k * scale - m_h * (i - j)) @ v over keys j <= i that are not padding, query row r at absolute position
offset + r (offset = cached tokens; by default the queries are the last keys: bottom-right alignment).
"""

import torch


def reference_attention(query, key, value, slopes, *, scale, offset=None, key_padding=None, first_key=None):
    """(B, H, q, D) x (B, H, kv, D) -> output (B, H, q, D), weights (B, H, q, kv), has_keys (B|1, 1|H, q, 1); float64.

    `key_padding`: (B, kv) bool, True = a real key. `first_key`: (H, q), the first key each head's row may see. Rows with no visible key have no defined output (their weights
    are 0): compare only where `has_keys`. Keys from offset + q on (a static cache's unwritten tail) are never seen.
    `slopes`: (H,), or (H, q) for slopes that differ by query row (`interpolated_slopes` of each row's own forward).
    """
    query, key, value = query.double(), key.double(), value.double()
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = kv_len - q_len if offset is None else offset
    i = torch.arange(offset, offset + q_len)[:, None]  # (q, 1) absolute query positions
    j = torch.arange(kv_len)[None, :]  # (1, kv)
    slopes = slopes.double()[:, None, None] if slopes.dim() == 1 else slopes.double()[:, :, None]  # (H, 1|q, 1)
    scores = query @ key.transpose(-1, -2) * scale - slopes * (i - j)  # (B, H, q, kv)
    allowed = (j <= i)[None, None]  # (1, 1, q, kv)
    if key_padding is not None:
        allowed = allowed & key_padding[:, None, None, :]  # (B, 1, q, kv)
    if first_key is not None:
        allowed = allowed & (j >= first_key[:, :, None])[None]  # (B|1, H, q, kv)
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)  # (B, H, q, kv)
    return weights @ value, weights, allowed.any(-1, keepdim=True)


# The MLP activations of the reference model, written out (not transformers' ACT2FN, which the model uses)
ACTIVATIONS = {
    "gelu_new": lambda x: 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))),
    "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / 2**0.5)),
    "silu": lambda x: x * torch.sigmoid(x),
}


def _layer_norm(x, weights, name, eps, norm="layer_norm"):
    if norm == "rms_norm":  # Baichuan's and Llama's: no mean subtracted, no bias
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weights[name + ".weight"]
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    out = (x - mean) / torch.sqrt(var + eps) * weights[name + ".weight"]
    return out + weights[name + ".bias"] if name + ".bias" in weights else out


def _conv1d(x, weights, name):
    out = x @ weights[name + ".weight"]  # GPT-2's Conv1D: weight (in, out)
    return out + weights[name + ".bias"] if name + ".bias" in weights else out


def reference_logits(
    weights,
    input_ids,
    *,
    n_layer,
    n_head,
    slopes,
    attn_scale,
    activation="gelu_new",
    gated=False,
    embedding_scale=1.0,
    logit_scale=1.0,
    eps=1e-5,
    attention_mask=None,
    norm="layer_norm",
):
    """Float64 logits `(B, L, V)` of a pre-LayerNorm GPT-2 with ALiBi, from a state dict in GPT-2's names and layout
    (`transformer.h.N.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_fc2, mlp.c_proj}`, `transformer.wte`,
    `transformer.ln_f`, `lm_head` or the tied `wte`): ALiBi GPT-2's names and Jais's/BTLM's alike. `norm`: every norm a
    LayerNorm (`"layer_norm"`) or an RMSNorm (`"rms_norm"`, `x / sqrt(mean(x^2) + eps) * weight`).

    embeddings * embedding_scale -> blocks (x + attn(ln_1 x), then x + mlp(ln_2 x)) -> ln_f -> head * logit_scale.
    Attention: softmax(q . k * attn_scale - slopes_h * (i - j)) over earlier real keys; `slopes` (H,), or (H, L) when
    each row has its own (`cached_row_slopes`: the rows of cached decoding). MLP: c_proj(act(c_fc x)), or
    gated: c_proj(c_fc x * act(c_fc2 x)). Biases are used where the state dict has them. Padded query rows (where
    `attention_mask` is 0) are not defined.
    """
    weights = {name: tensor.double() for name, tensor in weights.items()}
    act = ACTIVATIONS[activation]
    hidden = weights["transformer.wte.weight"][input_ids] * embedding_scale  # (B, L, C)
    batch, length, width = hidden.shape
    padding = None if attention_mask is None else attention_mask.bool()
    for i in range(n_layer):
        block = f"transformer.h.{i}."
        qkv = _conv1d(
            _layer_norm(hidden, weights, block + "ln_1", eps, norm), weights, block + "attn.c_attn"
        )  # (B, L, 3C)
        query, key, value = (t.view(batch, length, n_head, -1).transpose(1, 2) for t in qkv.split(width, -1))
        out = reference_attention(query, key, value, slopes, scale=attn_scale, key_padding=padding)[0]  # (B, H, L, D)
        hidden = hidden + _conv1d(out.transpose(1, 2).reshape(batch, length, width), weights, block + "attn.c_proj")
        x = _layer_norm(hidden, weights, block + "ln_2", eps, norm)
        up = _conv1d(x, weights, block + "mlp.c_fc")  # (B, L, n_inner)
        inner = up * act(_conv1d(x, weights, block + "mlp.c_fc2")) if gated else act(up)
        hidden = hidden + _conv1d(inner, weights, block + "mlp.c_proj")
    hidden = _layer_norm(hidden, weights, "transformer.ln_f", eps, norm)
    head = weights.get("lm_head.weight", weights["transformer.wte.weight"])  # (V, C)
    return hidden @ head.T * logit_scale  # (B, L, V)


def interpolated_slopes(slopes, key_length: int, *, factor: float = 1.0, train_seq_len: int | None = None):
    """Float64 slopes of Jais's and BTLM's `alibi_scaling` for a forward that attends `key_length` keys (cached + new,
    padding included): `m / factor` for `{"type": "linear", "factor": factor}`; `m / max(1, key_length / n)` for
    `{"type": "linear", "train_seq_len": n}` (slope interpolation, Al-Khateeb et al. 2023)."""
    slopes = slopes.double() / factor
    if train_seq_len is None or key_length <= train_seq_len:
        return slopes
    return slopes * train_seq_len / key_length


def cached_row_slopes(slopes, forward_lengths: list[int], **scaling):
    """(H, L) float64: the slopes each row of a cached run used, `forward_lengths` the new tokens of each forward in
    order (a prefill of P then decoding steps of 1: [P, 1, 1, ...]). A row's forward attends K = every token up to
    that forward's last, and its slopes are `interpolated_slopes` at that K. A causal row depends only on earlier
    rows, each computed in its own forward and cached, so this is what cached decoding computes in every layer."""
    columns, seen = [], 0
    for length in forward_lengths:
        seen += length
        columns += [interpolated_slopes(slopes, seen, **scaling)] * length
    return torch.stack(columns, dim=1)  # (H, L)
