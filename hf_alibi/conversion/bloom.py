"""BLOOM <-> ALiBi GPT-2, exactly: same function, weights permuted and transposed, nothing re-trained.

BLOOM (bloom, bloomz, BLOOMChat, Poro) is ALiBi GPT-2 with a LayerNorm after the token embedding
(`embedding_layernorm=True`), the tanh GELU (`gelu_new`), nn.Linear layers (transposed into Conv1D) and a fused qkv
interleaved per head (`[h, 3, d]`, ours is `[3, h, d]`). Its slopes are the paper's; they are copied as
`alibi_slopes`.
"""

import torch
from transformers import BloomConfig, BloomForCausalLM
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from ..models.alibi_gpt2.alibi import slopes_from_config
from ..models.alibi_gpt2.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi_gpt2.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import (
    TANH_GELUS, build_alibi_model, grouped_to_interleaved, interleaved_to_grouped, load_exactly, refuse, shared_fields,
)

# (BLOOM suffix, ours) inside each block; Linear weights are transposed on the way
_NORMS = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2"}
_LINEARS = {"self_attention.dense": "attn.c_proj", "mlp.dense_h_to_4h": "mlp.c_fc", "mlp.dense_4h_to_h": "mlp.c_proj"}
_REFUSED = {"apply_residual_connection_post_layernorm": False}


def bloom_slopes(n_head: int) -> torch.Tensor:
    """BLOOM's own slopes, fp32 `(H,)`: its bias at key position 1 of an unpadded row is `m_h * 1`."""
    return build_alibi_tensor(torch.ones(1, 2), n_head, torch.float32)[:, 0, 1]  # (H,)


def convert_bloom(model: BloomForCausalLM) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing exactly what `model` computes (fp32 rounding apart), at any length."""
    config = model.config
    refuse(config, _REFUSED, "BLOOM")
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
    source = model.state_dict()
    state = {
        "transformer.wte.weight": source["transformer.word_embeddings.weight"],
        "lm_head.weight": source["lm_head.weight"],
    }
    for part in ("weight", "bias"):
        state[f"transformer.ln_embd.{part}"] = source[f"transformer.word_embeddings_layernorm.{part}"]
        state[f"transformer.ln_f.{part}"] = source[f"transformer.ln_f.{part}"]
    for i in range(config.n_layer):
        theirs, ours = f"transformer.h.{i}.", f"transformer.h.{i}."
        qkv = theirs + "self_attention.query_key_value."
        state[ours + "attn.c_attn.weight"] = interleaved_to_grouped(source[qkv + "weight"], n_head).t()  # (C, 3C)
        state[ours + "attn.c_attn.bias"] = interleaved_to_grouped(source[qkv + "bias"], n_head)  # (3C,)
        for name, our_name in _NORMS.items():
            for part in ("weight", "bias"):
                state[f"{ours}{our_name}.{part}"] = source[f"{theirs}{name}.{part}"]
        for name, our_name in _LINEARS.items():
            state[f"{ours}{our_name}.weight"] = source[f"{theirs}{name}.weight"].t()  # Linear (out, in) -> (in, out)
            state[f"{ours}{our_name}.bias"] = source[f"{theirs}{name}.bias"]
    return build_alibi_model(alibi_config, state, model)


def check_bloom_exportable(config: AlibiGPT2Config) -> None:
    """`ValueError` naming the config field when BLOOM's architecture cannot hold a model of `config` exactly."""
    needs = {"embedding_layernorm": True, "bias": True, "clip_qkv": None, "scale_attn_weights": True}
    for field, value in needs.items():
        if getattr(config, field) != value:
            raise ValueError(f"BLOOM needs {field}={value!r}, the model has {field}={getattr(config, field)!r}")
    if config.activation_function not in TANH_GELUS:
        raise ValueError(f"BLOOM's MLP is the tanh GELU; activation_function={config.activation_function!r}")
    n_head, n_embd = config.n_head, config.n_embd
    if (config.n_inner or 4 * n_embd) != 4 * n_embd:
        raise ValueError(f"BLOOM's MLP is 4 * n_embd = {4 * n_embd} wide; n_inner={config.n_inner}")
    if not torch.equal(slopes_from_config(config), bloom_slopes(n_head)):
        raise ValueError(
            f"BLOOM computes the paper's slopes for {n_head} heads; this model's alibi_slopes/alibi_max_bias give "
            f"{slopes_from_config(config).tolist()}"
        )


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
        layer_norm_epsilon=config.layer_norm_epsilon,
        initializer_range=config.initializer_range,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        hidden_dropout=config.resid_pdrop,
        attention_dropout=config.attn_pdrop,
        tie_word_embeddings=config.tie_word_embeddings,
        architectures=["BloomForCausalLM"],
    )
    source = model.state_dict()
    state = {
        "transformer.word_embeddings.weight": source["transformer.wte.weight"],
        "lm_head.weight": source["lm_head.weight"],
    }
    for part in ("weight", "bias"):
        state[f"transformer.word_embeddings_layernorm.{part}"] = source[f"transformer.ln_embd.{part}"]
        state[f"transformer.ln_f.{part}"] = source[f"transformer.ln_f.{part}"]
    for i in range(config.n_layer):
        prefix = f"transformer.h.{i}."
        qkv = prefix + "self_attention.query_key_value."
        state[qkv + "weight"] = grouped_to_interleaved(source[prefix + "attn.c_attn.weight"].t(), n_head)  # (3C, C)
        state[qkv + "bias"] = grouped_to_interleaved(source[prefix + "attn.c_attn.bias"], n_head)  # (3C,)
        for name, our_name in _NORMS.items():
            for part in ("weight", "bias"):
                state[f"{prefix}{name}.{part}"] = source[f"{prefix}{our_name}.{part}"]
        for name, our_name in _LINEARS.items():
            state[f"{prefix}{name}.weight"] = source[f"{prefix}{our_name}.weight"].t()
            state[f"{prefix}{name}.bias"] = source[f"{prefix}{our_name}.bias"]
    bloom = BloomForCausalLM(bloom_config).to(model.dtype)
    load_exactly(bloom, state, "alibi_gpt2 -> bloom")
    bloom.generation_config = model.generation_config
    return bloom
