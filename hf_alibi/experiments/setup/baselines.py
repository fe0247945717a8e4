"""The position encodings ALiBi is compared with: same width, depth, heads, data and budget, GPT-2 everywhere else.

    model = build_model("sinusoidal", vocab_size=8192, n_embd=256, n_layer=4, n_head=8, train_length=256,
                        max_length=16 * 256)

| name                 | model                                | position information                      | runs up to |
|----------------------|--------------------------------------|-------------------------------------------|------------|
| `"alibi"`            | `AlibiGPT2LMHeadModel`               | linear bias on attention logits           | any length |
| `"nope"`             | `AlibiGPT2LMHeadModel`, slopes all 0 | none (causal masking only)                | any length |
| `"learned"`          | `GPT2LMHeadModel`                    | learned table, trained up to train_length | max_length |
| `"sinusoidal"`       | `GPT2LMHeadModel`, `wpe` frozen      | sin/cos table scaled to GPT-2's init      | max_length |
| `"sinusoidal_paper"` | `GPT2LMHeadModel`, `wpe` frozen      | the paper's: tokens x sqrt(d) + sin/cos   | max_length |
| `"rotary"`           | `GPTNeoXForCausalLM`, GPT-2-shaped   | rotary q/k (Su et al.), every dimension   | any length |

Every checkpoint loads with plain `AutoModelForCausalLM.from_pretrained` (ALiBi/NoPE through `hf_alibi`). Each
config records `position_encoding` and `train_length`. A `"sinusoidal_paper"` checkpoint is a plain GPT-2 whose
token-embedding multiplier lives in a forward hook, not in the weights: call `restore_position_encoding(model)`
after loading it (`hf_alibi.experiments.commands.evaluate_length` does).

The two sinusoidal variants differ only in the scale of the embedding sum. `"sinusoidal"` (the default in every
config) keeps GPT-2's std-0.02 token embeddings and scales the table by 0.02 (same token:position ratio as the
original Transformer, residual stream at GPT-2's scale); `"sinusoidal_paper"` is what the paper's fairseq baseline
does: token embeddings drawn with std `d ** -0.5`, multiplied by `sqrt(d)` on input (unit variance; the tied output
layer uses them unscaled), plus the unscaled table.
"""

import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, PreTrainedModel

from ..._transformers_compat import config_from_dict
from ...models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ...models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel

BASELINES = ("alibi", "nope", "learned", "sinusoidal", "sinusoidal_paper", "rotary")
INITIALIZER_RANGE = 0.02  # GPT-2's std for every weight matrix and embedding


def sinusoidal_table(num_positions: int, dim: int, scale: float = 1.0) -> torch.Tensor:
    """The fixed position table of Vaswani et al. (2017), fp32, shape `(num_positions, dim)`, times `scale`.

    `table[p, 2i] = sin(p / 10000 ** (2i / dim))` and `table[p, 2i + 1] = cos(p / 10000 ** (2i / dim))`.
    """
    if dim % 2 != 0:
        raise ValueError(f"a sinusoidal table needs an even dim, got {dim}")
    position = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim / 2,)
    angle = position * inv_freq  # (P, dim / 2)
    table = torch.stack((angle.sin(), angle.cos()), dim=-1).reshape(num_positions, dim)  # sin, cos interleaved
    return (scale * table).float()


def build_model(
    name: str,
    *,
    vocab_size: int,
    n_embd: int,
    n_layer: int,
    n_head: int,
    train_length: int,
    max_length: int,
    dropout: float = 0.0,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """A freshly initialised causal LM with position encoding `name`, one of `BASELINES`.

    Args:
        name: The position encoding; see the module docstring.
        vocab_size, n_embd, n_layer, n_head: Shape, shared by every baseline (MLP width `4 * n_embd`).
        train_length: The sequence length it will be trained at (recorded as `config.train_length`; ALiBi and NoPE
            also store it as `n_positions`).
        max_length: The longest length it will be evaluated at. `"learned"` and `"sinusoidal"` get a table this
            long; only the first `train_length` rows of the learned one are ever trained, which is the comparison.
        dropout: Every dropout probability (embeddings, residual branches, attention).
        bos_token_id, eos_token_id, pad_token_id: The tokenizer's special ids (one id for all three with
            `hf_alibi.experiments.data.tokenization`).

    All use GPT-2's initialisation (normal, std 0.02, residual projections scaled by `1 / sqrt(2 * n_layer)`),
    tied input/output embeddings and a loss when called with `labels`, so they train with `transformers.Trainer`.
    """
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; valid names are {list(BASELINES)}")
    if not 0 < train_length <= max_length:
        raise ValueError(f"need 0 < train_length <= max_length, got {train_length=}, {max_length=}")
    ids = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    shape = {"vocab_size": vocab_size, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head}
    dropouts = {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    recorded = {"position_encoding": name, "train_length": train_length}
    if name in ("alibi", "nope"):
        slopes = [0.0] * n_head if name == "nope" else None
        config = AlibiGPT2Config(
            **shape,
            **dropouts,
            **ids,
            n_positions=train_length,
            alibi_slopes=slopes,
            initializer_range=INITIALIZER_RANGE,
        )
        model = AlibiGPT2LMHeadModel(config)
    elif name in ("learned", "sinusoidal", "sinusoidal_paper"):
        config = GPT2Config(**shape, **dropouts, **ids, n_positions=max_length, initializer_range=INITIALIZER_RANGE)
        model = GPT2LMHeadModel(config)
        if name == "sinusoidal":
            freeze_sinusoidal_table(model)
        elif name == "sinusoidal_paper":
            with torch.no_grad():  # fairseq's Embedding init: std d ** -0.5, so sqrt(d) * embedding has unit variance
                model.transformer.wte.weight.normal_(0.0, n_embd**-0.5)
            freeze_sinusoidal_table(model, scale=1.0)
            scale_token_embeddings(model, math.sqrt(n_embd))
    else:
        model = _gpt2_shaped_neox(**shape, dropout=dropout, ids=ids, train_length=train_length)
    for key, value in recorded.items():
        setattr(model.config, key, value)
    return model


def freeze_sinusoidal_table(model: GPT2LMHeadModel, scale: float | None = None) -> None:
    """Fill GPT-2's `wpe` with a sinusoidal table times `scale` (default: the init std), and stop it from training.

    The original Transformer adds sin/cos (amplitude 1, per-dim RMS 1/sqrt(2)) to token embeddings initialised with
    std `d ** -0.5` and multiplied by `sqrt(d)`, i.e. unit variance. GPT-2 initialises token embeddings with std
    0.02 and no multiplier, so an unscaled table would be ~35x the tokens at d = 256 and drown them. Scaling the table
    by 0.02 keeps the original token:position ratio of sqrt(2) at initialisation (measured, d = 128, 2 layers, 100
    AdamW steps on the stdlib at length 128: training loss 6.21 scaled, 6.68 unscaled, 6.03 learned), and keeps the
    model a plain GPT-2 (no custom forward) that loads with `AutoModelForCausalLM.from_pretrained`.
    `requires_grad=False` keeps the table out of `Trainer`'s optimizer. A reloaded checkpoint has `requires_grad`
    back on: call this again before training it further. `scale=1.0` is the paper's unscaled table (it goes with
    `scale_token_embeddings`, see the module docstring).
    """
    wpe = model.transformer.wpe.weight
    scale = model.config.initializer_range if scale is None else scale
    with torch.no_grad():
        wpe.copy_(sinusoidal_table(wpe.shape[0], wpe.shape[1], scale=scale))
    wpe.requires_grad_(False)


def scale_token_embeddings(model: GPT2LMHeadModel, scale: float) -> None:
    """Multiply GPT-2's token embeddings by `scale` on input only (fairseq's `embed_scale`), recorded in the config.

    A forward hook on `wte`: the tied output layer reads `wte.weight` directly, so it stays unscaled, and the weights
    and state-dict names stay GPT-2's. Hooks are not saved: `restore_position_encoding` re-attaches it after loading.
    Calling it again replaces the earlier hook (never scales twice).
    """
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"embedding scale must be positive and finite, got {scale!r}")
    wte = model.transformer.wte
    previous = getattr(wte, "_hf_alibi_scale_hook", None)
    if previous is not None:
        previous.remove()
    wte._hf_alibi_scale_hook = wte.register_forward_hook(lambda module, args, output: output * scale)
    model.config.embedding_scale = scale


def restore_position_encoding(model: PreTrainedModel) -> PreTrainedModel:
    """After `from_pretrained`: re-freeze a sinusoidal table and re-attach `"sinusoidal_paper"`'s embedding scale.

    A no-op for every other model (their position encoding is entirely in their weights or code). Returns `model`.
    """
    encoding = getattr(model.config, "position_encoding", None)
    if encoding in ("sinusoidal", "sinusoidal_paper"):
        model.transformer.wpe.weight.requires_grad_(False)
    if encoding == "sinusoidal_paper":
        scale = getattr(model.config, "embedding_scale", None)
        if scale is None:
            raise ValueError(f"a sinusoidal_paper checkpoint must record embedding_scale in its config, got {scale}")
        scale_token_embeddings(model, scale)
    return model


def _gpt2_shaped_neox(
    *, vocab_size: int, n_embd: int, n_layer: int, n_head: int, dropout: float, ids: dict, train_length: int
) -> GPTNeoXForCausalLM:
    """GPT-NeoX with rotary on every q/k dimension, configured as close to GPT-2 as its config allows.

    Same as GPT-2: sequential pre-LayerNorm blocks (`use_parallel_residual=False`), `gelu_new` MLP of width
    `4 * n_embd`, biases on every linear layer, LayerNorm eps 1e-5, tied embeddings, dropout on embeddings, residual
    branches and attention, final LayerNorm, and (re-drawn here) GPT-2's init with residual projections scaled by
    `1 / sqrt(2 * n_layer)`. Different, and not configurable: rotary (base 10000) rotates q and k instead of adding
    a position table, and the fused qkv projection is laid out per head (the same function, other weight order).
    """
    values = dict(
        vocab_size=vocab_size,
        hidden_size=n_embd,
        num_hidden_layers=n_layer,
        num_attention_heads=n_head,
        intermediate_size=4 * n_embd,
        hidden_act="gelu_new",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        use_parallel_residual=False,
        attention_bias=True,
        layer_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        # Metadata only: rotary angles are computed for any position.
        max_position_embeddings=train_length,
        initializer_range=INITIALIZER_RANGE,
        **ids,
    )
    model = GPTNeoXForCausalLM(config_from_dict(GPTNeoXConfig, values))  # the rotary share kept on 5.0-5.4 too
    std = INITIALIZER_RANGE / math.sqrt(2 * n_layer)  # GPT-2: two residual branches per block
    with torch.no_grad():
        for layer in model.gpt_neox.layers:
            layer.attention.dense.weight.normal_(0.0, std)
            layer.mlp.dense_4h_to_h.weight.normal_(0.0, std)
    return model


def max_supported_length(model: PreTrainedModel) -> int | None:
    """The longest input `model` can run: the rows of its position table (`wpe`), or `None` without one."""
    wpe = getattr(model.base_model, "wpe", None)
    return wpe.num_embeddings if isinstance(wpe, torch.nn.Embedding) else None


__all__ = [
    "BASELINES",
    "build_model",
    "freeze_sinusoidal_table",
    "max_supported_length",
    "restore_position_encoding",
    "scale_token_embeddings",
    "sinusoidal_table",
]
