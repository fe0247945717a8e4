"""The `jais-eager` contestant: a faithful eager re-implementation of the Jais / BTLM remote code's forward.

Their `modeling_jais.py` / `modeling_btlm.py` cannot ship here and no longer import on transformers 5, so this module
re-implements what their forward computes, the way they compute it, so that timing and memory are theirs:

- one `tril(ones(n_positions, n_positions))` bool buffer per attention layer, sliced `[kv - q : kv, :kv]`: inputs
  longer than `n_positions` raise, their cap (2048 for jais-13b, 8192 for BTLM-3B-8K);
- scores `q @ k^T / head_dim` (`scale_qk_dot_by_d`), `torch.where(causal, scores, finfo.min)`, the padding mask added
  as `(1 - mask) * finfo.min`, then the ALiBi bias `-m |i - j|` as one `(H, q, kv)` tensor built per forward and added
  in every layer, eager softmax, `@ v`; the slopes divided by their `alibi_scaling`'s scale (`slopes / -scale`: a
  static factor, or `K / train_seq_len` for a forward over K > train_seq_len keys);
- SwiGLU MLP `c_proj(c_fc(x) * silu(c_fc2(x)))` (width `4 * n_embd` here), pre-LN GPT-2 blocks, embeddings times
  `embeddings_scale`, logits times `width_scale`, a tied head; GPT-2's module names (`transformer.h.N.attn.c_attn`,
  ..., `transformer.relative_pe.slopes`), so its state dict is a Jais checkpoint's.

One allowance their code does not have: `logits_to_keep` (the benchmark's forward keeps the last position for every
contestant). No KV cache: it runs the forward and train suites. `tests/benchmarks/test_contestants.py` holds it to the
float64 reference of their code.
"""

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput
from transformers.pytorch_utils import Conv1D

from hf_alibi import get_alibi_slopes

# jais-13b's settings: its n_positions (the cap), embeddings_scale, width_scale
N_POSITIONS, EMBEDDINGS_SCALE, WIDTH_SCALE = 2048, 14.6, 0.111


class _Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_positions: int):
        super().__init__()
        self.n_head = n_head
        tril = torch.tril(torch.ones(n_positions, n_positions, dtype=torch.bool))
        self.register_buffer("bias", tril.view(1, 1, n_positions, n_positions), persistent=False)
        self.c_attn, self.c_proj = Conv1D(3 * n_embd, n_embd), Conv1D(n_embd, n_embd)

    def forward(self, hidden, mask, position_bias):
        batch, length, width = hidden.shape
        q, k, v = (t.view(batch, length, self.n_head, -1).transpose(1, 2) for t in self.c_attn(hidden).split(width, 2))
        scores = q @ k.transpose(-1, -2) / torch.full([], v.size(-1) ** 1.0, dtype=q.dtype, device=q.device)
        causal = self.bias[:, :, k.size(-2) - q.size(-2) : k.size(-2), : k.size(-2)]  # (1, 1, q, kv)
        lowest = torch.full([], torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
        scores = torch.where(causal, scores, lowest)  # (B, H, q, kv)
        if mask is not None:
            scores = scores + mask  # (B, 1, 1, kv)
        scores += position_bias.type_as(scores).unsqueeze(0)  # (1, H, q, kv)
        out = torch.softmax(scores, dim=-1).type(v.dtype) @ v  # (B, H, q, D)
        return self.c_proj(out.transpose(1, 2).reshape(batch, length, width))


class _MLP(nn.Module):
    def __init__(self, n_embd: int, n_inner: int):
        super().__init__()
        self.c_fc, self.c_fc2, self.c_proj = Conv1D(n_inner, n_embd), Conv1D(n_inner, n_embd), Conv1D(n_embd, n_inner)

    def forward(self, hidden):
        return self.c_proj(self.c_fc(hidden) * nn.functional.silu(self.c_fc2(hidden)))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, n_inner: int, n_positions: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = _Attention(n_embd, n_head, n_positions), _MLP(n_embd, n_inner)

    def forward(self, hidden, mask, position_bias):
        hidden = hidden + self.attn(self.ln_1(hidden), mask, position_bias)
        return hidden + self.mlp(self.ln_2(hidden))


class _Slopes(nn.Module):
    def __init__(self, n_head: int, alibi_scaling: dict | None = None):
        super().__init__()
        # the paper's slopes, interleaved past a power of two, as their `_get_alibi_slopes` computes them (the same
        # rule as `get_alibi_slopes`; tests/conversion/jais_checkpoints.py writes it out independently, as an oracle)
        self.slopes = nn.Parameter(get_alibi_slopes(n_head)[:, None], requires_grad=False)  # (H, 1)
        self.alibi_scaling = alibi_scaling

    def forward(self, length: int):
        positions = torch.arange(length, device=self.slopes.device)
        context, memory = positions[:, None], positions[None, :]
        distance = (memory - context).abs().unsqueeze(0).expand(self.slopes.shape[0], -1, -1)  # (H, q, kv)
        # their `alibi_scaling`: a static factor, else slopes / (K / train_seq_len) past it, K = distance's keys
        if self.alibi_scaling is None:
            scale = 1.0
        elif self.alibi_scaling.get("factor") is not None:
            scale = self.alibi_scaling["factor"]
        elif distance.shape[-1] > self.alibi_scaling["train_seq_len"]:
            scale = distance.shape[-1] / self.alibi_scaling["train_seq_len"]
        else:
            scale = 1.0
        return (self.slopes / -scale).unsqueeze(1) * distance  # (H, q, kv)


class _Transformer(nn.Module):
    def __init__(self, vocab_size, n_embd, n_layer, n_head, n_inner, n_positions, alibi_scaling=None):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.h = nn.ModuleList([_Block(n_embd, n_head, n_inner, n_positions) for _ in range(n_layer)])
        self.ln_f, self.relative_pe = nn.LayerNorm(n_embd), _Slopes(n_head, alibi_scaling)


class JaisEager(nn.Module):
    """Their forward (see the module docstring); `config` is the Jais config dict this model is a checkpoint of.
    `alibi_scaling` (the Jais-family's and BTLM's, read as their position-embedding layer reads it) adds the Jais-family
    code's muP keys to the config, equal to jais-13b's (whose code ignores `alibi_scaling`)."""

    def __init__(
        self,
        vocab_size: int,
        n_embd: int,
        n_layer: int,
        n_head: int,
        n_positions: int = N_POSITIONS,
        alibi_scaling: dict | None = None,
    ):
        super().__init__()
        n_inner = 4 * n_embd
        self.transformer = _Transformer(vocab_size, n_embd, n_layer, n_head, n_inner, n_positions, alibi_scaling)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.config = {
            "model_type": "jais",
            "vocab_size": vocab_size,
            "n_embd": n_embd,
            "n_layer": n_layer,
            "n_head": n_head,
            "n_inner": n_inner,
            "n_positions": n_positions,
            "activation_function": "swiglu",
            "position_embedding_type": "alibi",
            "embeddings_scale": EMBEDDINGS_SCALE,
            "width_scale": WIDTH_SCALE,
            "scale_qk_dot_by_d": True,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        }
        if alibi_scaling is not None:
            self.config |= {
                "mup_embeddings_scale": EMBEDDINGS_SCALE,
                "mup_output_alpha": WIDTH_SCALE,
                "mup_width_scale": 1.0,
                "mup_scale_qk_dot_by_d": True,
                "alibi_scaling": alibi_scaling,
            }

    def forward(self, input_ids, attention_mask=None, labels=None, logits_to_keep: int = 0, **_unused):
        hidden = self.transformer.wte(input_ids)  # (B, L, C)
        hidden = hidden * torch.tensor(EMBEDDINGS_SCALE, dtype=hidden.dtype, device=hidden.device)
        mask = None
        if attention_mask is not None:
            mask = (1.0 - attention_mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
        position_bias = self.transformer.relative_pe(input_ids.shape[1])  # (H, L, L)
        for block in self.transformer.h:
            hidden = block(hidden, mask, position_bias)
        hidden = self.transformer.ln_f(hidden)
        logits = self.lm_head(hidden[:, -logits_to_keep:])  # (B, q', V)
        logits = logits * torch.tensor(WIDTH_SCALE, dtype=logits.dtype, device=logits.device)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)
