"""MPT <-> ALiBi GPT-2, exactly: MPT-7B/30B (+ instruct, chat, storywriter), replit-code in MPT format.

MPT is ALiBi GPT-2 with no bias anywhere (`bias=False`), the exact erf GELU (`activation_function="gelu"`), an
optional clamp of the fused qkv (`clip_qkv`) and nn.Linear layers (transposed into Conv1D; its fused qkv is already
`[q | k | v]`). A `softmax_scale` other than `1/sqrt(head_dim)` is folded into the query weights (the ALiBi term is
added after scaling). Unlike transformers' MPT, the import runs past `max_seq_len`.
"""

import math

import torch
from transformers import MptConfig, MptForCausalLM
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

from ..models.alibi_gpt2.alibi import slopes_from_config
from ..models.alibi_gpt2.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi_gpt2.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import build_alibi_model, load_exactly, refuse, shared_fields

# (MPT suffix, ours) inside each block; Linear weights are transposed on the way
_NORMS = {"norm_1": "ln_1", "norm_2": "ln_2"}
_LINEARS = {"attn.out_proj": "attn.c_proj", "ffn.up_proj": "mlp.c_fc", "ffn.down_proj": "mlp.c_proj"}
# What transformers' MptForCausalLM (and so this import) cannot honour; each would change the function.
_REFUSED = {
    "attn_config.alibi": True,
    "attn_config.qk_ln": False,
    "attn_config.attn_type": "multihead_attention",
    "attn_config.prefix_lm": False,
    "attn_config.alibi_bias_max": 8,  # transformers' MPT always uses 8: another value is ambiguous
    "attn_config.kv_n_heads": None,  # llm-foundry's grouped-query attention
    "logit_scale": None,
}


def mpt_slopes(n_head: int) -> torch.Tensor:
    """MPT's own slopes, fp32 `(H,)`: its bias for 2 positions is `m_h * (j - 1)`, so `-m_h` at key 0."""
    return -build_mpt_alibi_tensor(n_head, 2)[:, 0, 0]  # (H,)


def _attn_config(config: MptConfig) -> dict:
    attn = config.attn_config
    return attn if isinstance(attn, dict) else attn.to_dict()


def convert_mpt(model: MptForCausalLM) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing exactly what `model` computes (fp32 rounding apart), with no length cap."""
    config = model.config
    attn = _attn_config(config)
    refuse({"attn_config": attn, "logit_scale": config.logit_scale}, _REFUSED, "MPT")
    n_head, n_embd = config.n_heads, config.d_model
    head_dim = n_embd // n_head
    softmax_scale = attn.get("softmax_scale")
    # Fold a non-default softmax_scale into W_q: (c*q).k / sqrt(d) = q.k * scale with c = scale * sqrt(d)
    query_factor = 1.0 if softmax_scale is None else softmax_scale * math.sqrt(head_dim)
    if query_factor != 1.0 and attn.get("clip_qkv") is not None:
        raise ValueError(
            f"MPT config has attn_config.softmax_scale={softmax_scale!r} with attn_config.clip_qkv: the clamp acts "
            "before the scale, so the scale cannot be folded into the query weights exactly"
        )
    source = model.state_dict()
    alibi_config = AlibiGPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_seq_len,  # metadata only: the import runs at any length
        n_embd=n_embd,
        n_layer=config.n_layers,
        n_head=n_head,
        n_inner=source["transformer.blocks.0.ffn.up_proj.weight"].shape[0],
        activation_function="gelu",  # MPT's nn.GELU(approximate="none")
        resid_pdrop=config.resid_pdrop,
        embd_pdrop=config.emb_pdrop,
        attn_pdrop=attn.get("attn_pdrop", 0.0),
        **shared_fields(config),
        alibi_slopes=mpt_slopes(n_head).tolist(),
        bias=False,
        clip_qkv=attn.get("clip_qkv"),
    )
    state = {
        "transformer.wte.weight": source["transformer.wte.weight"],
        "lm_head.weight": source["lm_head.weight"],
        "transformer.ln_f.weight": source["transformer.norm_f.weight"],
    }
    for i in range(config.n_layers):
        theirs, ours = f"transformer.blocks.{i}.", f"transformer.h.{i}."
        qkv = source[theirs + "attn.Wqkv.weight"]  # (3C, C), rows [q | k | v]
        if query_factor != 1.0:
            qkv = torch.cat([qkv[:n_embd] * query_factor, qkv[n_embd:]])  # (3C, C)
        state[ours + "attn.c_attn.weight"] = qkv.t()  # (C, 3C)
        for name, our_name in _NORMS.items():
            state[f"{ours}{our_name}.weight"] = source[f"{theirs}{name}.weight"]
        for name, our_name in _LINEARS.items():
            state[f"{ours}{our_name}.weight"] = source[f"{theirs}{name}.weight"].t()  # Linear (out, in) -> (in, out)
    return build_alibi_model(alibi_config, state, model)


def check_mpt_exportable(config: AlibiGPT2Config, max_seq_len: int | None = None) -> int:
    """The `max_seq_len` to export (default `n_positions`); `ValueError` naming the config field when MPT's
    architecture cannot hold a model of `config` exactly."""
    max_seq_len = config.n_positions if max_seq_len is None else max_seq_len
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    needs = {"bias": False, "embedding_layernorm": False, "activation_function": "gelu", "tie_word_embeddings": True}
    for field, value in needs.items():
        if getattr(config, field) != value:
            raise ValueError(f"MPT needs {field}={value!r}, the model has {field}={getattr(config, field)!r}")
    n_head, n_embd = config.n_head, config.n_embd
    if (config.n_inner or 4 * n_embd) != 4 * n_embd:
        raise ValueError(f"transformers' MPT MLP is 4 * n_embd = {4 * n_embd} wide; n_inner={config.n_inner}")
    if not torch.equal(slopes_from_config(config), mpt_slopes(n_head)):
        raise ValueError(
            f"MPT computes its slopes for {n_head} heads at max bias 8; this model's alibi_slopes/alibi_max_bias give "
            f"{slopes_from_config(config).tolist()}"
        )
    return max_seq_len


def export_mpt(model: AlibiGPT2LMHeadModel, max_seq_len: int | None = None) -> MptForCausalLM:
    """A transformers `MptForCausalLM` computing exactly what `model` computes, for inputs up to `max_seq_len`.

    `max_seq_len` (default: the model's `n_positions`) is the longest input MPT loaders accept: transformers, vLLM
    and TGI build their bias for that length and refuse anything longer. Raises `ValueError` naming the config field
    when MPT's architecture cannot hold the model exactly.
    """
    config = model.config
    max_seq_len = check_mpt_exportable(config, max_seq_len)
    n_head, n_embd = config.n_head, config.n_embd
    mpt_config = MptConfig(
        d_model=n_embd,
        n_heads=n_head,
        n_layers=config.n_layer,
        expansion_ratio=4,
        max_seq_len=max_seq_len,
        vocab_size=config.vocab_size,
        resid_pdrop=config.resid_pdrop,
        emb_pdrop=config.embd_pdrop,
        layer_norm_epsilon=config.layer_norm_epsilon,
        learned_pos_emb=False,
        no_bias=True,
        attn_config={
            "alibi": True,
            "alibi_bias_max": 8,
            "attn_pdrop": config.attn_pdrop,
            "clip_qkv": config.clip_qkv,
            "softmax_scale": None if config.scale_attn_weights else 1.0,
        },
        initializer_range=config.initializer_range,
        use_cache=config.use_cache,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        tie_word_embeddings=True,
        architectures=["MptForCausalLM"],
    )
    source = model.state_dict()
    state = {
        "transformer.wte.weight": source["transformer.wte.weight"],
        "lm_head.weight": source["lm_head.weight"],
        "transformer.norm_f.weight": source["transformer.ln_f.weight"],
    }
    for i in range(config.n_layer):
        theirs, ours = f"transformer.blocks.{i}.", f"transformer.h.{i}."
        state[theirs + "attn.Wqkv.weight"] = source[ours + "attn.c_attn.weight"].t()  # (3C, C)
        for name, our_name in _NORMS.items():
            state[f"{theirs}{name}.weight"] = source[f"{ours}{our_name}.weight"]
        for name, our_name in _LINEARS.items():
            state[f"{theirs}{name}.weight"] = source[f"{ours}{our_name}.weight"].t()
    mpt = MptForCausalLM(mpt_config).to(model.dtype)
    load_exactly(mpt, state, "alibi_gpt2 -> mpt")
    mpt.generation_config = model.generation_config
    return mpt
