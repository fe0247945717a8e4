"""Convert a transformers GPT-2 model into an ALiBi GPT-2: drop `wpe`, copy every other weight, check key by key.

The converted model has never seen ALiBi: fine-tune it (at short length is enough) before trusting its outputs.
"""

import warnings

from transformers import GPT2Config, GPT2LMHeadModel

from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import Requirement, build_exactly, require

# GPT-2 config fields that carry over unchanged (AlibiGPT2Config uses GPT-2's names).
_SHARED_FIELDS = (
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "activation_function",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "layer_norm_epsilon",
    "initializer_range",
    "scale_attn_weights",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
)
_DROPPED_KEYS = ("transformer.wpe.weight",)  # every other key is ours already
_UNSUPPORTED = tuple(
    Requirement(flag, frozenset({False, None}))  # unset or off
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")
)
_UNSUPPORTED_MESSAGE = "{family} config has {field}={value!r}, which ALiBi GPT-2 does not implement"


def alibi_config_from_gpt2(gpt2_config: GPT2Config, **alibi_kwargs) -> AlibiGPT2Config:
    """The ALiBi config with GPT-2's architecture; `alibi_kwargs` set ALiBi fields (e.g. `alibi_max_bias`)."""
    require(gpt2_config, _UNSUPPORTED, "GPT-2", _UNSUPPORTED_MESSAGE)
    fields = {name: getattr(gpt2_config, name) for name in _SHARED_FIELDS}
    return AlibiGPT2Config(**fields, **alibi_kwargs)


def convert_gpt2(model: GPT2LMHeadModel, **alibi_kwargs) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` holding `model`'s weights minus the position embeddings.

    Raises `ValueError` if any key or shape fails to line up. Warns that the result must be fine-tuned.
    """
    if getattr(model.config, "model_type", None) != "gpt2":
        raise ValueError(f"convert_gpt2 expects a GPT-2 model, got model_type={model.config.model_type!r}")
    config = alibi_config_from_gpt2(model.config, **alibi_kwargs)
    state = {key: tensor for key, tensor in model.state_dict().items() if key not in _DROPPED_KEYS}
    alibi_model = build_exactly(AlibiGPT2LMHeadModel, config, state, model)
    warnings.warn(
        "Converted GPT-2 to ALiBi: the position embeddings are gone and the model has never seen ALiBi biases. "
        "Fine-tune it (a short-length run is enough) before using its outputs.",
        UserWarning,
        stacklevel=2,
    )
    return alibi_model
