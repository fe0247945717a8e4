"""Evaluation arms: a trained model as it is, or with a training-free length extension set through its own config.

    arm_model(trained["rotary"], "rotary+yarn", train_length=128, length=2048)   # YaRN, factor 2048 / 128 = 16
    arm_model(trained["alibi"], "alibi+slope_interp", train_length=128, length=2048)

An arm is named `MODEL` (the trained model, unchanged) or `MODEL+EXTENSION`:

| extension      | applies to | config change (nothing hand-written: the model's own code reads it)                          |
|----------------|------------|-----------------------------------------------------------------------------------------------|
| `slope_interp` | ALiBi      | `alibi_scaling={"type": "linear", "train_seq_len": train_length}`: slopes / max(1, K / L)       |
| `linear`       | rotary     | `rope_parameters` `rope_type="linear"`, `factor` = length / train_length (position interpolation)|
| `dynamic`      | rotary     | `rope_type="dynamic"`, same `factor` (NTK base rescaled from the input's own length)           |
| `yarn`         | rotary     | `rope_type="yarn"`, same `factor`, `original_max_position_embeddings` = train_length           |

The rotary baseline is transformers' GPT-NeoX (`baselines`), so the three `rope_type`s are transformers' own
(`modeling_rope_utils.ROPE_INIT_FUNCTIONS`). Their factor is the evaluation length over the training length, as a
user sets it for the length they need (1 at the training length, where linear and YaRN reduce to plain rotary;
dynamic NTK changes nothing on inputs up to `max_position_embeddings` = the training length, whatever the factor).
A variant is a fresh model of the same class built from the changed config, with the trained weights loaded.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..._transformers_compat import config_from_dict
from .baselines import restore_position_encoding

EXTENSIONS = {"slope_interp": "alibi", "linear": "rotary", "dynamic": "rotary", "yarn": "rotary"}
LENGTH_DEPENDENT = ("linear", "yarn")  # config differs per evaluation length (the factor)


def parse_arm(arm: str, models: list[str] | None = None) -> tuple[str, str | None]:
    """`"rotary+yarn"` -> `("rotary", "yarn")`; `"alibi"` -> `("alibi", None)`. The extension must fit the model's
    encoding, and the model must be among `models` when given."""
    model, plus, extension = arm.partition("+")
    if models is not None and model not in models:
        raise ValueError(f"arm {arm!r} evaluates model {model!r}, which is not trained (models: {models})")
    if plus:
        if extension not in EXTENSIONS:
            raise ValueError(f"arm {arm!r}: unknown extension {extension!r}; choose from {list(EXTENSIONS)}")
        encoding = model.partition("@")[0]
        if encoding != EXTENSIONS[extension]:
            raise ValueError(f"arm {arm!r}: {extension!r} extends {EXTENSIONS[extension]!r} models, not {encoding!r}")
        return model, extension
    return model, None


def rope_parameters(base: dict, rope_type: str, factor: float, train_length: int) -> dict:
    """`base` (the trained model's `rope_parameters`) with `rope_type` and its `factor` (and YaRN's original length)."""
    parameters = {**base, "rope_type": rope_type, "factor": float(factor)}
    if rope_type == "yarn":
        parameters["original_max_position_embeddings"] = train_length
    return parameters


def config_changes(model: PreTrainedModel, extension: str | None, train_length: int, length: int) -> dict:
    """The config fields an arm changes at evaluation length `length` ({} for the trained model as it is)."""
    if extension is None:
        return {}
    if extension == "slope_interp":
        return {"alibi_scaling": {"type": "linear", "train_seq_len": train_length}}
    factor = max(1.0, length / train_length)
    return {"rope_parameters": rope_parameters(model.config.rope_parameters, extension, factor, train_length)}


def with_config(model: PreTrainedModel, **changes) -> PreTrainedModel:
    """A fresh `type(model)` built from its config with `changes` (validated by the config class), holding `model`'s
    weights, in eval mode. `model` itself is untouched."""
    config = config_from_dict(type(model.config), {**model.config.to_dict(), **changes})  # rotary's share kept
    variant = type(model)(config)
    variant.load_state_dict(model.state_dict())  # strict: every weight, none left at its initial value
    restore_position_encoding(variant)
    return variant.to(next(model.parameters()).device).float().eval()


def arm_model(model: PreTrainedModel, arm: str, train_length: int, length: int) -> PreTrainedModel:
    """The model arm `arm` evaluates at `length` tokens: `model` itself (eval mode) or its extended variant."""
    _, extension = parse_arm(arm)
    changes = config_changes(model, extension, train_length, length)
    return with_config(model, **changes) if changes else model.float().eval()


def is_alibi(model: torch.nn.Module) -> bool:
    """Whether `model` has ALiBi slopes (the arms whose certified kept fraction is measured)."""
    return getattr(getattr(model, "config", None), "model_type", None) == "alibi_gpt2"


__all__ = [
    "EXTENSIONS",
    "LENGTH_DEPENDENT",
    "arm_model",
    "config_changes",
    "is_alibi",
    "parse_arm",
    "rope_parameters",
    "with_config",
]
