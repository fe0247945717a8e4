"""An independent float64 reference of the ALiBi encoder, written from the layout (jina-embeddings-v2 / MosaicBERT)
with plain torch ops: `h = LN(word[x] + type[t])`; per layer `s = q.k / sqrt(d) - m_h |i - j|` (padded keys and other
documents' keys at -inf), `h = LN(dense(softmax(s) v) + h)`, `g = h W^T`, `h = LN(wo(act(g[:I]) * g[I:]) + h)`.

It shares no code with `hf_alibi`: the slopes are the paper's rule written out again here, the scores are built
row block by row block (so lengths past 8192 need no L x L tensor) and every op runs in float64.
"""

import math

import torch
import torch.nn.functional as F

REFERENCE_ROWS = 1024  # query rows per block of the reference's scores: (H, 1024, L) float64 at a time


def paper_slopes(heads: int) -> torch.Tensor:
    """The paper's slopes, float64: 2^(-8h/n) for a power of two n; else the closest smaller power of two's slopes
    followed by every other slope of twice as many heads (6 heads: 2^-2, 2^-4, 2^-6, 2^-8, 2^-1, 2^-3)."""

    def geometric(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    closest = 2 ** int(math.floor(math.log2(heads)))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


def reference_attention(query, key, value, slopes, visible=None, scale=None, rows=None):
    """softmax(q k^T * scale - m |i - j| + mask) v in float64: query/key/value (B, H, L, D), `visible` (B, L, L) bool
    (query row, key) or None; `rows` (n,) the query rows to compute (None: all). Returns (B, H, n, D) float64 and
    the (B, H, n, L) probabilities (None past 4096 rows)."""
    query, key, value = query.double(), key.double(), value.double()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    rows = torch.arange(query.shape[2]) if rows is None else rows
    keys = torch.arange(key.shape[2], dtype=torch.float64)
    outputs, weights = [], []
    for block in rows.split(REFERENCE_ROWS):
        distance = (block.double()[:, None] - keys[None, :]).abs()  # (n, L)
        scores = query[:, :, block] @ key.transpose(-1, -2) * scale - slopes.double()[:, None, None] * distance
        if visible is not None:
            scores = scores.masked_fill(~visible[:, None, block], -torch.inf)  # (B, H, n, L)
        probabilities = torch.softmax(scores, dim=-1)
        outputs.append(probabilities @ value)
        weights.append(probabilities)
    return torch.cat(outputs, dim=2), (torch.cat(weights, dim=2) if len(rows) <= 4096 else None)


def visibility(attention_mask=None, documents=None, batch=1, length=1) -> torch.Tensor | None:
    """(B, L, L) bool: key j visible to row i when j is real and in i's document; None when everything is."""
    if attention_mask is None and documents is None:
        return None
    keep = torch.ones(batch, length, length, dtype=torch.bool)
    if attention_mask is not None:
        keep &= attention_mask.bool()[:, None, :]
    if documents is not None:
        keep &= documents[:, :, None] == documents[:, None, :]
    return keep


def _layer_norm(x, state, name, eps):
    return F.layer_norm(x, x.shape[-1:], state[f"{name}.weight"], state[f"{name}.bias"], eps)


def _glu_activation(config):
    name = {"geglu": "gelu", "reglu": "relu"}.get(config.feed_forward_type, config.hidden_act)
    return {
        "gelu": lambda x: 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0))),  # the exact GELU Jina's GLU uses
        "relu": torch.relu,
        "silu": lambda x: x / (1.0 + torch.exp(-x)),
    }[name]


def reference_encoder(model, input_ids, attention_mask=None, token_type_ids=None, documents=None, rows=None):
    """The encoder's last hidden states (B, L, C) in float64, from `model`'s state dict and config alone.
    `documents` (B, L): packed rows' document index (each document sees only itself). `rows` (n,): a one-layer
    model's outputs at those positions only, (B, n, C) (long inputs: the reference's cost is per row)."""
    config = model.config
    if rows is not None and config.num_hidden_layers != 1:
        raise ValueError("rows= needs a one-layer model: deeper layers' keys need every row")
    state = {k.removeprefix("bert."): v.detach().double() for k, v in model.state_dict().items()}
    eps, heads = config.layer_norm_eps, config.num_attention_heads
    batch, length = input_ids.shape
    types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    hidden = (
        state["embeddings.word_embeddings.weight"][input_ids] + state["embeddings.token_type_embeddings.weight"][types]
    )
    hidden = _layer_norm(hidden, state, "embeddings.LayerNorm", eps)
    visible, slopes, act = (
        visibility(attention_mask, documents, batch, length),
        paper_slopes(heads),
        _glu_activation(config),
    )
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        q, k, v = (
            F.linear(hidden, state[f"{p}attention.self.{n}.weight"], state[f"{p}attention.self.{n}.bias"])
            for n in ("query", "key", "value")
        )
        if config.qk_layer_norm:
            q = _layer_norm(q, state, f"{p}attention.self.layer_norm_q", eps)
            k = _layer_norm(k, state, f"{p}attention.self.layer_norm_k", eps)
        q, k, v = (t.view(batch, length, heads, -1).transpose(1, 2) for t in (q, k, v))
        if rows is not None:
            hidden = hidden[:, rows]  # (B, n, C): the residual of the rows computed
        attended = reference_attention(q, k, v, slopes, visible, rows=rows)[0].transpose(1, 2).flatten(2)
        dense = F.linear(attended, state[f"{p}attention.output.dense.weight"], state[f"{p}attention.output.dense.bias"])
        out = _layer_norm(dense + hidden, state, f"{p}attention.output.LayerNorm", eps)
        hidden = _after_attention(config, state, p, hidden, out, act)
    return hidden


def _after_attention(config, state, p, x, out, act):
    """The rest of the layer whose input is `x` after `out = LN(dense(a) + x)`: Jina's GLU and its residual
    LayerNorm, or base-code's (`layer_layout="jina_code"`) `a = layer_norm_1(x + out)`,
    `layer_norm_2(a + down_layer(u[:I] * act(u[I:])))` with `u = up_gated_layer(a)`."""
    eps, inner = config.layer_norm_eps, config.intermediate_size
    if config.layer_layout == "jina_code":
        a = _layer_norm(x + out, state, f"{p}layer_norm_1", eps)
        up = a @ state[f"{p}mlp.up_gated_layer.weight"].T  # (B, L, 2I)
        mixed = up[..., :inner] * act(up[..., inner:])
        down = F.linear(mixed, state[f"{p}mlp.down_layer.weight"], state[f"{p}mlp.down_layer.bias"])
        return _layer_norm(a + down, state, f"{p}layer_norm_2", eps)
    gated = out @ state[f"{p}mlp.gated_layers.weight"].T  # (B, L, 2I)
    mixed = act(gated[..., :inner]) * gated[..., inner:]
    down = F.linear(mixed, state[f"{p}mlp.wo.weight"], state[f"{p}mlp.wo.bias"])
    return _layer_norm(down + out, state, f"{p}mlp.layernorm", eps)
