"""Falcon-RW (Falcon with `alibi=True`) -> ALiBi GPT-2, exactly.

Falcon-RW is ALiBi GPT-2 with the erf GELU (`activation_function="gelu"`), nn.Linear layers (transposed into Conv1D),
a fused qkv interleaved per head (`[h, 3, d]`, ours `[3, h, d]`) and its ALiBi bias divided by `sqrt(head_dim)`
(`(q.k + m * j) / sqrt(d)`): the import writes the slopes Falcon uses, divided by `sqrt(head_dim)`, as
`alibi_slopes`. Falcon rounds its slopes to bfloat16 (also for fp32 models); those rounded values are what is copied.
`bias=False` Falcons (no linear biases, LayerNorms with bias) import with zero linear biases.

transformers' Falcon also rounds the product `m * j` to bfloat16, so at longer lengths and with slopes that are
not powers of two it drifts from the linear bias it was designed to compute; the import computes that bias exactly.
"""

import math

import torch
from transformers import FalconForCausalLM
from transformers.models.falcon.modeling_falcon import build_alibi_tensor

from ..models.alibi_gpt2.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi_gpt2.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import build_alibi_model, interleaved_to_grouped, refuse, shared_fields

_NORMS = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"}
_LINEARS = {"self_attention.dense": "attn.c_proj", "mlp.dense_h_to_4h": "mlp.c_fc", "mlp.dense_4h_to_h": "mlp.c_proj"}
# Falcon-7B/40B/180B are rotary, multi-query or parallel-attention models: none of them is ALiBi GPT-2.
_REFUSED = {"alibi": True, "parallel_attn": False, "multi_query": False, "new_decoder_architecture": False}


def falcon_slopes(n_head: int, head_dim: int) -> torch.Tensor:
    """Falcon's effective slopes, fp32 `(H,)`: its (bf16-rounded) `m_h` divided by `sqrt(head_dim)`."""
    unit = build_alibi_tensor(torch.ones(1, 2), n_head, torch.float32)[:, 0, 1]  # (H,): m_h * 1, rounded to bf16
    return (unit.double() / math.sqrt(head_dim)).float()  # (H,)


def convert_falcon(model: FalconForCausalLM) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing what `model`'s SDPA path computes (fp32 rounding apart), at any length."""
    config = model.config
    refuse(config, _REFUSED, "Falcon")
    n_head, n_embd = config.num_attention_heads, config.hidden_size
    ffn = config.ffn_hidden_size or 4 * n_embd
    alibi_config = AlibiGPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,  # metadata only
        n_embd=n_embd,
        n_layer=config.num_hidden_layers,
        n_head=n_head,
        n_inner=ffn,
        activation_function=config.activation,
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=0.0,
        attn_pdrop=config.attention_dropout,
        **shared_fields(config),
        alibi_slopes=falcon_slopes(n_head, n_embd // n_head).tolist(),
    )
    source = model.state_dict()
    state = {
        "transformer.wte.weight": source["transformer.word_embeddings.weight"],
        "lm_head.weight": source["lm_head.weight"],
        "transformer.ln_f.weight": source["transformer.ln_f.weight"],
        "transformer.ln_f.bias": source["transformer.ln_f.bias"],
    }
    for i in range(config.num_hidden_layers):
        prefix = f"transformer.h.{i}."
        qkv = prefix + "self_attention.query_key_value."
        weight = source[qkv + "weight"]  # (3C, C)
        bias = source.get(qkv + "bias", weight.new_zeros(weight.shape[0]))  # bias=False Falcons: exactly zero
        state[prefix + "attn.c_attn.weight"] = interleaved_to_grouped(weight, n_head).t()  # (C, 3C)
        state[prefix + "attn.c_attn.bias"] = interleaved_to_grouped(bias, n_head)  # (3C,)
        for name, our_name in _NORMS.items():
            for part in ("weight", "bias"):
                state[f"{prefix}{our_name}.{part}"] = source[f"{prefix}{name}.{part}"]
        for name, our_name in _LINEARS.items():
            weight = source[f"{prefix}{name}.weight"]
            state[f"{prefix}{our_name}.weight"] = weight.t()  # Linear (out, in) -> Conv1D (in, out)
            state[f"{prefix}{our_name}.bias"] = source.get(f"{prefix}{name}.bias", weight.new_zeros(weight.shape[0]))
    return build_alibi_model(alibi_config, state, model)
