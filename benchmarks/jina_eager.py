"""The `jina-eager` contestant: a faithful eager re-implementation of jina-embeddings-v2's remote-code forward.

Their `modeling_bert.py` (jinaai/jina-bert-implementation) cannot ship here and imports helpers transformers 5
removed, so this module re-implements what their eager forward computes, the way it computes it, so that time and
memory are theirs:

- the encoder holds one ALiBi tensor `-m_h |i - j|` of shape `(1, H, S, S)` (fp32), built when the model is built for
  `S = max_position_embeddings` (8192 in jina-embeddings-v2's configs) and rebuilt for `S = L` when an input is longer;
  every forward slices `[:, :, :L, :L]` and hands it to every layer;
- the padding mask is BERT's extended mask `(1 - mask)[:, None, None, :] * finfo.min`; scores are
  `q @ k^T / sqrt(d_head)`, plus the mask, then `softmax(scores + alibi)` (a second `(1, H, L, L)` sum), `@ v`;
- post-LayerNorm layers: `LN(dense(a) + h)`, then the GLU `LN(wo(gelu(g[..., :I]) * g[..., I:]) + h)` with
  `g = gated_layers(h)` (exact GELU, `feed_forward_type="geglu"`); embeddings `LN(word + token_type)`.

Parameter names are jina-embeddings-v2's, which are `AlibiBertModel`'s: `load_state_dict` copies one into the other
key for key. Inference only (no dropout, no pooler). `tests/benchmarks/test_encoder_contestants.py` holds it to
`AlibiBertModel` on the same weights.
"""

import math

import torch
from torch import nn

from hf_alibi import get_alibi_slopes


def alibi_tensor(num_heads: int, size: int) -> torch.Tensor:
    """Their `rebuild_alibi_tensor`: `-m_h |i - j|` for every pair, `(1, H, size, size)` fp32."""
    positions = torch.arange(size)
    distance = (positions[None, :] - positions[:, None]).abs()  # (S, S)
    return (-get_alibi_slopes(num_heads)[:, None, None] * distance).unsqueeze(0)  # (1, H, S, S)


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, hidden, mask, bias):
        batch, length, width = hidden.shape
        q, k, v = (
            layer(hidden).view(batch, length, self.heads, self.head_dim).permute(0, 2, 1, 3)
            for layer in (self.query, self.key, self.value)
        )  # 3 x (B, H, L, D)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, L, L)
        scores = scores + mask  # (B, 1, 1, L)
        probs = nn.functional.softmax(scores + bias, dim=-1)  # (1, H, L, L) bias: a second L x L sum
        return torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(batch, length, width)


class _Output(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=eps)

    def forward(self, attended, residual):
        return self.LayerNorm(self.dense(attended) + residual)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.self, self.output = _SelfAttention(hidden, heads), _Output(hidden, eps)

    def forward(self, hidden, mask, bias):
        return self.output(self.self(hidden, mask, bias), hidden)


class _GLUMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, eps: float):
        super().__init__()
        self.intermediate = intermediate
        self.gated_layers = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.wo, self.layernorm = nn.Linear(intermediate, hidden), nn.LayerNorm(hidden, eps=eps)

    def forward(self, hidden):
        gated = self.gated_layers(hidden)  # (B, L, 2I)
        glu = nn.functional.gelu(gated[:, :, : self.intermediate]) * gated[:, :, self.intermediate :]
        return self.layernorm(self.wo(glu) + hidden)


class _Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = _Attention(config.hidden_size, config.num_attention_heads, config.layer_norm_eps)
        self.mlp = _GLUMLP(config.hidden_size, config.intermediate_size, config.layer_norm_eps)

    def forward(self, hidden, mask, bias):
        return self.mlp(self.attention(hidden, mask, bias))


class _Encoder(nn.Module):
    def __init__(self, config, alibi_size: int):
        super().__init__()
        self.layer = nn.ModuleList([_Layer(config) for _ in range(config.num_hidden_layers)])
        self.heads = config.num_attention_heads
        self.register_buffer("alibi", alibi_tensor(self.heads, alibi_size), persistent=False)

    def forward(self, hidden, mask):
        length = hidden.shape[1]
        if self.alibi.shape[-1] < length:  # their rebuild when the input is longer than the tensor
            self.alibi = alibi_tensor(self.heads, length).to(hidden.device)
        bias = self.alibi[:, :, :length, :length]  # (1, H, L, L)
        for layer in self.layer:
            hidden = layer(hidden, mask, bias)
        return hidden


class _Embeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids):
        return self.LayerNorm(self.word_embeddings(input_ids) + self.token_type_embeddings(torch.zeros_like(input_ids)))


class JinaEager(nn.Module):
    """Their eager encoder (module docstring) for an `AlibiBertConfig` with `feed_forward_type="geglu"`; the forward
    returns the last hidden states `(B, L, C)`. `alibi_size`: the prebuilt tensor's size (their code's is
    `config.max_position_embeddings`; a smaller one changes memory only, never the output)."""

    def __init__(self, config, alibi_size: int | None = None):
        super().__init__()
        if config.feed_forward_type != "geglu" or config.qk_layer_norm:
            raise ValueError("JinaEager re-implements jina-embeddings-v2's geglu layers without q/k LayerNorm")
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config, config.max_position_embeddings if alibi_size is None else alibi_size)

    def forward(self, input_ids, attention_mask=None, **_unused):
        hidden = self.embeddings(input_ids)  # (B, L, C)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        mask = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        return self.encoder(hidden, mask)
