"""MPT <-> ALiBi GPT-2, exactly: MPT-7B/30B (+ instruct, chat, storywriter), replit-code in MPT format.

MPT is ALiBi GPT-2 with no bias anywhere (`bias=False`), the exact erf GELU (`activation_function="gelu"`), an
optional clamp of the fused qkv (`clip_qkv`) and nn.Linear layers (transposed into Conv1D; its fused qkv is already
`[q | k | v]`). A `softmax_scale` other than `1/sqrt(head_dim)` is folded into the query weights (the ALiBi term is
added after scaling). Unlike transformers' MPT, the import runs past `max_seq_len`.
"""

import math

import torch
from transformers import MptConfig, MptForCausalLM

from .._transformers_compat import mpt_alibi_tensor
from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import (
    EXPORT_REFUSAL,
    IMPORT_REFUSAL,
    Requirement,
    build_exactly,
    export_requirements,
    require,
    shared_fields,
)
from .weight_map import IDENTITY, TRANSPOSE, Entry, Transform, WeightMap, map_weights

# What transformers' MptForCausalLM (and so this import) cannot honour; each would change the function.
_REFUSED = (
    Requirement("attn_config.alibi", True),
    Requirement("attn_config.qk_ln", False),
    Requirement("attn_config.attn_type", "multihead_attention"),
    Requirement("attn_config.prefix_lm", False),
    Requirement("attn_config.alibi_bias_max", 8),  # transformers' MPT always uses 8: another value is ambiguous
    Requirement("attn_config.kv_n_heads", None),  # llm-foundry's grouped-query attention
    Requirement("logit_scale", None),
)


def scale_query_rows(factor: float) -> Transform:
    """Import only: the q rows of a fused `[q | k | v]` weight `(3C, C)` times `factor` (a softmax scale folded into
    W_q). The scale is the weights' own afterwards: an export writes them as they are, with the default scale."""

    def scale(weight: torch.Tensor) -> torch.Tensor:
        n_embd = weight.shape[0] // 3
        return torch.cat([weight[:n_embd] * factor, weight[n_embd:]])  # (3C, C)

    def refuse(weight: torch.Tensor) -> torch.Tensor:
        raise ValueError("a softmax_scale folded into the query weights is not unfolded on export")

    return Transform(scale, refuse)


def mpt_weights(query_factor: float = 1.0) -> WeightMap:
    """(ours, MPT's, transform) for every tensor: nn.Linear weights transposed (MPT has no biases; its fused qkv is
    already `[q | k | v]`); `query_factor` (import only) folds a softmax scale into W_q."""
    fold = IDENTITY if query_factor == 1.0 else scale_query_rows(query_factor)
    ours, theirs = "transformer.h.{i}.", "transformer.blocks.{i}."
    return (
        Entry("transformer.wte.weight", "transformer.wte.weight"),
        Entry(ours + "ln_1.weight", theirs + "norm_1.weight"),
        Entry(ours + "attn.c_attn.weight", theirs + "attn.Wqkv.weight", fold.then(TRANSPOSE)),
        Entry(ours + "attn.c_proj.weight", theirs + "attn.out_proj.weight", TRANSPOSE),
        Entry(ours + "ln_2.weight", theirs + "norm_2.weight"),
        Entry(ours + "mlp.c_fc.weight", theirs + "ffn.up_proj.weight", TRANSPOSE),
        Entry(ours + "mlp.c_proj.weight", theirs + "ffn.down_proj.weight", TRANSPOSE),
        Entry("transformer.ln_f.weight", "transformer.norm_f.weight"),
        Entry("lm_head.weight", "lm_head.weight"),
    )


def mpt_slopes(n_head: int) -> torch.Tensor:
    """MPT's own slopes, fp32 `(H,)`: its bias for 2 positions is `m_h * (j - 1)`, so `-m_h` at key 0."""
    return -mpt_alibi_tensor(n_head, 2)[:, 0, 0]  # (H,)


def _attn_config(config: MptConfig) -> dict:
    attn = config.attn_config
    return attn if isinstance(attn, dict) else attn.to_dict()


def convert_mpt(model: MptForCausalLM) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing exactly what `model` computes (fp32 rounding apart), with no length cap."""
    config = model.config
    attn = _attn_config(config)
    require({"attn_config": attn, "logit_scale": config.logit_scale}, _REFUSED, "MPT", IMPORT_REFUSAL)
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
    state = map_weights(mpt_weights(query_factor), source, config.n_layers, to="ours", what="mpt -> alibi_gpt2")
    return build_exactly(AlibiGPT2LMHeadModel, alibi_config, state, model)


# What transformers' MPT architecture holds: anything else would change the function.
_NEEDS = export_requirements(
    Requirement("bias", False),
    Requirement("embedding_layernorm", False),
    Requirement("activation_function", "gelu"),
    Requirement("tie_word_embeddings", True),
    mlp="transformers' MPT MLP",
    slopes=mpt_slopes,
    rule="MPT computes its slopes for {config.n_head} heads at max bias 8",
)


def check_mpt_exportable(config: AlibiGPT2Config, max_seq_len: int | None = None) -> int:
    """The `max_seq_len` to export (default `n_positions`); `ValueError` naming the config field when MPT's
    architecture cannot hold a model of `config` exactly."""
    max_seq_len = config.n_positions if max_seq_len is None else max_seq_len
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    require(config, _NEEDS, "MPT", EXPORT_REFUSAL)
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
        learned_pos_emb=False,
        no_bias=True,
        attn_config={
            "alibi": True,
            "alibi_bias_max": 8,
            "attn_pdrop": config.attn_pdrop,
            "clip_qkv": config.clip_qkv,
            "softmax_scale": None if config.scale_attn_weights else 1.0,
        },
        use_cache=config.use_cache,
        **shared_fields(config),  # tie_word_embeddings: True, as _NEEDS requires
        architectures=["MptForCausalLM"],
    )
    state = map_weights(mpt_weights(), model.state_dict(), config.n_layer, to="theirs", what="alibi_gpt2 -> mpt")
    return build_exactly(MptForCausalLM, mpt_config, state, model)
