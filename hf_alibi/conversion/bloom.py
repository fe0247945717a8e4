"""BLOOM <-> ALiBi GPT-2, exactly: same function, weights permuted and transposed, nothing re-trained.

BLOOM (bloom, bloomz, BLOOMChat, Poro) is ALiBi GPT-2 with a LayerNorm after the token embedding
(`embedding_layernorm=True`), the tanh GELU (`gelu_new`), nn.Linear layers (transposed into Conv1D) and a fused qkv
interleaved per head (`[h, 3, d]`, ours is `[3, h, d]`). Its slopes are the paper's; they are copied as
`alibi_slopes`.
"""

import torch
from transformers import BloomConfig, BloomForCausalLM

from .._transformers_compat import bloom_alibi_tensor
from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import (
    EXPORT_REFUSAL,
    IMPORT_REFUSAL,
    TANH_GELUS,
    Requirement,
    build_exactly,
    export_requirements,
    require,
    shared_fields,
)
from .weight_map import TRANSPOSE, Entry, WeightMap, map_weights, per_head_qkv

_REFUSED = (Requirement("apply_residual_connection_post_layernorm", False),)


def bloom_weights(n_head: int) -> WeightMap:
    """(ours, BLOOM's, transform) for every tensor: nn.Linear weights transposed, the fused qkv regrouped."""
    qkv, ours, theirs = per_head_qkv(n_head), "transformer.h.{i}.", "transformer.h.{i}."
    return (
        Entry("transformer.wte.weight", "transformer.word_embeddings.weight"),
        Entry("transformer.ln_embd.weight", "transformer.word_embeddings_layernorm.weight"),
        Entry("transformer.ln_embd.bias", "transformer.word_embeddings_layernorm.bias"),
        Entry(ours + "ln_1.weight", theirs + "input_layernorm.weight"),
        Entry(ours + "ln_1.bias", theirs + "input_layernorm.bias"),
        Entry(ours + "attn.c_attn.weight", theirs + "self_attention.query_key_value.weight", qkv.then(TRANSPOSE)),
        Entry(ours + "attn.c_attn.bias", theirs + "self_attention.query_key_value.bias", qkv),
        Entry(ours + "attn.c_proj.weight", theirs + "self_attention.dense.weight", TRANSPOSE),
        Entry(ours + "attn.c_proj.bias", theirs + "self_attention.dense.bias"),
        Entry(ours + "ln_2.weight", theirs + "post_attention_layernorm.weight"),
        Entry(ours + "ln_2.bias", theirs + "post_attention_layernorm.bias"),
        Entry(ours + "mlp.c_fc.weight", theirs + "mlp.dense_h_to_4h.weight", TRANSPOSE),
        Entry(ours + "mlp.c_fc.bias", theirs + "mlp.dense_h_to_4h.bias"),
        Entry(ours + "mlp.c_proj.weight", theirs + "mlp.dense_4h_to_h.weight", TRANSPOSE),
        Entry(ours + "mlp.c_proj.bias", theirs + "mlp.dense_4h_to_h.bias"),
        Entry("transformer.ln_f.weight", "transformer.ln_f.weight"),
        Entry("transformer.ln_f.bias", "transformer.ln_f.bias"),
        Entry("lm_head.weight", "lm_head.weight"),
    )


def bloom_slopes(n_head: int) -> torch.Tensor:
    """BLOOM's own slopes, fp32 `(H,)`: its bias at key position 1 of an unpadded row is `m_h * 1`."""
    return bloom_alibi_tensor(torch.ones(1, 2), n_head, torch.float32)[:, 0, 1]  # (H,)


def convert_bloom(model: BloomForCausalLM) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing exactly what `model` computes (fp32 rounding apart), at any length."""
    config = model.config
    require(config, _REFUSED, "BLOOM", IMPORT_REFUSAL)
    n_head, n_embd = config.n_head, config.hidden_size
    alibi_config = AlibiGPT2Config(
        vocab_size=config.vocab_size,
        n_positions=getattr(config, "seq_length", 2048),  # metadata only (BLOOM was trained at 2048)
        n_embd=n_embd,
        n_layer=config.n_layer,
        n_head=n_head,
        n_inner=4 * n_embd,
        activation_function="gelu_new",
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=0.0,
        attn_pdrop=config.attention_dropout,
        **shared_fields(config),
        alibi_slopes=bloom_slopes(n_head).tolist(),
        embedding_layernorm=True,
    )
    state = map_weights(
        bloom_weights(n_head), model.state_dict(), config.n_layer, to="ours", what="bloom -> alibi_gpt2"
    )
    return build_exactly(AlibiGPT2LMHeadModel, alibi_config, state, model)


# What BLOOM's architecture holds: anything else would change the function.
_NEEDS = export_requirements(
    Requirement("embedding_layernorm", True),
    Requirement("bias", True),
    Requirement("clip_qkv", None),
    Requirement("scale_attn_weights", True),
    Requirement("activation_function", frozenset(TANH_GELUS), "BLOOM's MLP is the tanh GELU; {field}={value!r}"),
    mlp="BLOOM's MLP",
    slopes=bloom_slopes,
    rule="BLOOM computes the paper's slopes for {config.n_head} heads",
)


def check_bloom_exportable(config: AlibiGPT2Config) -> None:
    """`ValueError` naming the config field when BLOOM's architecture cannot hold a model of `config` exactly."""
    require(config, _NEEDS, "BLOOM", EXPORT_REFUSAL)


def export_bloom(model: AlibiGPT2LMHeadModel) -> BloomForCausalLM:
    """A transformers `BloomForCausalLM` computing exactly what `model` computes.

    Raises `ValueError` naming the config field when BLOOM's architecture cannot hold the model exactly.
    """
    config = model.config
    check_bloom_exportable(config)
    n_head, n_embd = config.n_head, config.n_embd
    bloom_config = BloomConfig(
        vocab_size=config.vocab_size,
        hidden_size=n_embd,
        n_layer=config.n_layer,
        n_head=n_head,
        hidden_dropout=config.resid_pdrop,
        attention_dropout=config.attn_pdrop,
        **shared_fields(config),
        architectures=["BloomForCausalLM"],
    )
    state = map_weights(
        bloom_weights(n_head), model.state_dict(), config.n_layer, to="theirs", what="alibi_gpt2 -> bloom"
    )
    return build_exactly(BloomForCausalLM, bloom_config, state, model)
