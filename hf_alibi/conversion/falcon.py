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

from .._transformers_compat import falcon_alibi_tensor
from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .bloom import bloom_weights
from .common import IMPORT_REFUSAL, Requirement, build_exactly, require, shared_fields
from .weight_map import WeightMap, map_weights

# Falcon-7B/40B/180B are rotary, multi-query or parallel-attention models: none of them is ALiBi GPT-2.
_REFUSED = (
    Requirement("alibi", True),
    Requirement("parallel_attn", False),
    Requirement("multi_query", False),
    Requirement("new_decoder_architecture", False),
)


def falcon_weights(n_head: int) -> WeightMap:
    """BLOOM's weight map less the embedding LayerNorm: Falcon-RW keeps BLOOM's module names and qkv layout."""
    return tuple(entry for entry in bloom_weights(n_head) if not entry.ours.startswith("transformer.ln_embd."))


def falcon_slopes(n_head: int, head_dim: int) -> torch.Tensor:
    """Falcon's effective slopes, fp32 `(H,)`: its (bf16-rounded) `m_h` divided by `sqrt(head_dim)`."""
    unit = falcon_alibi_tensor(torch.ones(1, 2), n_head, torch.float32)[:, 0, 1]  # (H,): m_h * 1, rounded to bf16
    return (unit.double() / math.sqrt(head_dim)).float()  # (H,)


def convert_falcon(model: FalconForCausalLM) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing what `model`'s SDPA path computes (fp32 rounding apart), at any length."""
    config = model.config
    require(config, _REFUSED, "Falcon", IMPORT_REFUSAL)
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
    for key, weight in list(source.items()):  # bias=False Falcons have no linear biases: ours hold exact zeros
        if key.startswith("transformer.h.") and weight.ndim == 2:
            source.setdefault(key.removesuffix("weight") + "bias", weight.new_zeros(weight.shape[0]))
    state = map_weights(
        falcon_weights(n_head), source, config.num_hidden_layers, to="ours", what="falcon -> alibi_gpt2"
    )
    return build_exactly(AlibiGPT2LMHeadModel, alibi_config, state, model)
