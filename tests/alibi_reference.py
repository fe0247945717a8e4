"""The float64 ALiBi attention that every backend test compares against, written out in plain PyTorch, once.

softmax(q . k * scale - m_h * (i - j)) @ v over keys j <= i that are not padding, query row r at absolute position
offset + r (offset = cached tokens; by default the queries are the last keys: bottom-right alignment).
"""

import torch


def reference_attention(query, key, value, slopes, *, scale, offset=None, key_padding=None, first_key=None):
    """(B, H, q, D) x (B, H, kv, D) -> output (B, H, q, D), weights (B, H, q, kv), has_keys (B|1, 1|H, q, 1); float64.

    `key_padding`: (B, kv) bool, True = a real key. `first_key`: (H, q), the first key each head's row may see. Rows with no visible key have no defined output (their weights
    are 0): compare only where `has_keys`. Keys from offset + q on (a static cache's unwritten tail) are never seen.
    """
    query, key, value = query.double(), key.double(), value.double()
    q_len, kv_len = query.shape[2], key.shape[2]
    offset = kv_len - q_len if offset is None else offset
    i = torch.arange(offset, offset + q_len)[:, None]  # (q, 1) absolute query positions
    j = torch.arange(kv_len)[None, :]  # (1, kv)
    scores = query @ key.transpose(-1, -2) * scale - slopes.double()[:, None, None] * (i - j)  # (B, H, q, kv)
    allowed = (j <= i)[None, None]  # (1, 1, q, kv)
    if key_padding is not None:
        allowed = allowed & key_padding[:, None, None, :]  # (B, 1, q, kv)
    if first_key is not None:
        allowed = allowed & (j >= first_key[:, :, None])[None]  # (B|1, H, q, kv)
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), dim=-1).nan_to_num(0.0)  # (B, H, q, kv)
    return weights @ value, weights, allowed.any(-1, keepdim=True)
