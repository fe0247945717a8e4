"""The `baichuan-eager` contestant: a faithful eager re-implementation of Baichuan2-13B's remote code forward.

Their `modeling_baichuan.py` cannot ship here and no longer runs on transformers 5, so this module re-implements what
their forward computes, the way they compute it, so that timing and memory are theirs:

- in eval mode one `(H, P, P)` mask buffer, `triu(-inf, 1) + slope * j`, built for P = `model_max_length` and rebuilt
  for the longer length whenever an input is longer (no cap), sliced `[:, :L, :L]`; in training the same tensor built
  for each new length and kept;
- with a 2-D `attention_mask`, their packing-aware expansion `tril(m_i * m_j > 0) * (m_i == m_j)` to `(B, 1, L, L)`,
  inverted to the dtype's minimum and added to the ALiBi mask: one `(B, H, L, L)` tensor per forward, added in every
  layer;
- scores `q @ k^T / sqrt(head_dim)` + that mask, `torch.max` with the dtype's minimum, eager softmax, `@ v`; q, k, v
  the three row blocks of `W_pack`; RMSNorm with its variance in fp32; `down(silu(gate(x)) * up(x))`; pre-norm
  blocks; their NormHead (the head's rows normalised once, on the first forward in eval mode, every forward in
  training). Their module names, so its state dict is a Baichuan2 checkpoint's.

Their code uses xformers' memory-efficient attention in training when xformers is installed; it is not here (nor on
the CPUs this runs on), so training runs their eager path. One allowance their code does not have: `logits_to_keep`
(the benchmark's forward keeps the last position for every contestant). No KV cache: forward and train suites only.
`tests/benchmarks/test_baichuan_contestants.py` holds it to the float64 forward of their architecture.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_outputs import CausalLMOutput

from hf_alibi import get_alibi_slopes

MODEL_MAX_LENGTH = 4096  # Baichuan2-13B's: where their mask buffer starts


def intermediate_size(hidden_size: int) -> int:
    """Baichuan-13B's MLP width at `hidden_size`: 13696 at 5120 (its ratio, 107/40)."""
    return hidden_size * 107 // 40


def _alibi_mask(slopes: torch.Tensor, length: int) -> torch.Tensor:
    """Their `_gen_alibi_mask`: `triu(-inf, 1) + slope * j`, (H, L, L), fp32."""
    future = torch.triu(torch.full((length, length), float("-inf")), 1)
    return future[None] + slopes[:, None, None] * torch.arange(length)[None, None, :]


class _RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.epsilon = nn.Parameter(torch.ones(hidden_size)), eps

    def forward(self, hidden):
        variance = hidden.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.epsilon)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            hidden = hidden.to(self.weight.dtype)
        return self.weight * hidden


class _Attention(nn.Module):
    def __init__(self, hidden_size: int, n_head: int):
        super().__init__()
        self.n_head, self.hidden_size = n_head, hidden_size
        self.W_pack = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden, mask):
        batch, length, _ = hidden.shape
        proj = self.W_pack(hidden).unflatten(-1, (3, self.hidden_size)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        q, k, v = (proj[i].view(batch, length, self.n_head, -1).transpose(1, 2) for i in range(3))  # (B, H, L, D)
        scores = q @ k.transpose(2, 3) / math.sqrt(q.shape[-1]) + mask  # (B, H, L, L)
        scores = torch.max(scores, torch.tensor(torch.finfo(scores.dtype).min))
        out = torch.softmax(scores, dim=-1) @ v  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, self.hidden_size))


class _MLP(nn.Module):
    def __init__(self, hidden_size: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, inner, bias=False)

    def forward(self, hidden):
        return self.down_proj(F.silu(self.gate_proj(hidden)) * self.up_proj(hidden))


class _Layer(nn.Module):
    def __init__(self, hidden_size: int, n_head: int, inner: int):
        super().__init__()
        self.self_attn, self.mlp = _Attention(hidden_size, n_head), _MLP(hidden_size, inner)
        self.input_layernorm, self.post_attention_layernorm = _RMSNorm(hidden_size), _RMSNorm(hidden_size)

    def forward(self, hidden, mask):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class _Model(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, n_layer: int, n_head: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size, padding_idx=0)
        inner = intermediate_size(hidden_size)
        self.layers = nn.ModuleList([_Layer(hidden_size, n_head, inner) for _ in range(n_layer)])
        self.norm = _RMSNorm(hidden_size)
        # their `_get_interleave`, computed in Python floats: the paper's rule, `get_alibi_slopes` bit for bit
        self.register_buffer("slopes", get_alibi_slopes(n_head), persistent=False)
        self.max_cache_pos, self.future_mask, self.alibi_mask = MODEL_MAX_LENGTH, None, None

    def get_alibi_mask(self, tensor, length: int) -> torch.Tensor:
        if self.training:
            if self.alibi_mask is None or self.alibi_mask.shape[-1] != length:
                self.alibi_mask = _alibi_mask(self.slopes.float().cpu(), length).to(tensor)
            return self.alibi_mask
        if self.future_mask is None or length > self.max_cache_pos:
            self.max_cache_pos = max(self.max_cache_pos, length)
            self.future_mask = _alibi_mask(self.slopes.float().cpu(), self.max_cache_pos).to(tensor)
        return self.future_mask[:, :length, :length]  # (H, L, L)

    def forward(self, input_ids, attention_mask=None):
        hidden = self.embed_tokens(input_ids)  # (B, L, C)
        alibi = self.get_alibi_mask(hidden, input_ids.shape[1])  # (H, L, L)
        if attention_mask is None:
            mask = alibi
        else:  # their packing-aware 2-D mask expansion
            expanded = attention_mask.to(alibi.dtype)
            expanded = torch.tril(torch.gt(expanded[:, :, None] * expanded[:, None, :], 0)) * torch.eq(
                expanded[:, :, None] - expanded[:, None, :], 0
            )
            inverted = 1.0 - expanded.unsqueeze(1).to(alibi.dtype)  # (B, 1, L, L)
            mask = inverted.masked_fill(inverted.to(torch.bool), torch.finfo(alibi.dtype).min) + alibi[None]
        for layer in self.layers:
            hidden = layer(hidden, mask)
        return self.norm(hidden)


class _NormHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__()
        self.weight, self.first_flag = nn.Parameter(torch.empty(vocab_size, hidden_size)), True
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, hidden):
        if self.training:
            weight = F.normalize(self.weight)
        elif self.first_flag:
            self.first_flag = False
            self.weight = nn.Parameter(F.normalize(self.weight))
            weight = self.weight
        else:
            weight = self.weight
        return F.linear(hidden, weight)


class BaichuanEager(nn.Module):
    """Baichuan2-13B's forward (see the module docstring); `config` is the Baichuan2 config dict this model is a
    checkpoint of."""

    def __init__(self, vocab_size: int, hidden_size: int, n_layer: int, n_head: int):
        super().__init__()
        self.model = _Model(vocab_size, hidden_size, n_layer, n_head)
        self.lm_head = _NormHead(hidden_size, vocab_size)
        self.config = {
            "model_type": "baichuan",
            "architectures": ["BaichuanForCausalLM"],
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size(hidden_size),
            "num_hidden_layers": n_layer,
            "num_attention_heads": n_head,
            "hidden_act": "silu",
            "model_max_length": MODEL_MAX_LENGTH,
            "rms_norm_eps": 1e-6,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "tie_word_embeddings": False,
            "z_loss_weight": 0,
        }

    def forward(self, input_ids, attention_mask=None, labels=None, logits_to_keep: int = 0, **_unused):
        hidden = self.model(input_ids, attention_mask)  # (B, L, C)
        logits = self.lm_head(hidden[:, -logits_to_keep:])  # (B, q', V)
        loss = None
        if labels is not None:  # their loss: cross entropy plus z_loss_weight (0) times the squared max logit
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)
