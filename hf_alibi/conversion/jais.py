"""Jais and BTLM <-> ALiBi GPT-2, exactly: Jais (jais-13b, jais-30b, the Jais-family and their chat variants) and
BTLM-3B-8K, Cerebras's GPT-2 + muP + SwiGLU line of ALiBi models, published as `trust_remote_code` checkpoints.

They keep GPT-2's module names and `Conv1D` layout, biases everywhere, no position table and a tied head, so every
weight copies over as it is (one identity table, `cerebras_weights`). What differs is a config switch of ours each:

- the MLP is SwiGLU, `c_proj(c_fc(x) * silu(c_fc2(x)))` (`activation_function: "swiglu"`): `gated_mlp` with
  `activation_function="silu"`; any other activation is their plain GPT-2 MLP and copies as it is;
- `q . k` is divided by `head_dim` rather than its square root when `scale_qk_dot_by_d` (jais-13b's code) or
  `mup_scale_qk_dot_by_d` (the Jais-family and BTLM code) is set: `attn_scale_power=1.0`; ALiBi is added after;
- muP multipliers: embeddings times `embeddings_scale` / `mup_embeddings_scale` (`embedding_scale`), logits times
  `width_scale` (jais-13b's code) or `mup_output_alpha * mup_width_scale` (the Jais-family and BTLM code:
  BTLM-3B-8K's 2.22 * 0.1 = 0.222, never its `mup_width_scale` 0.1 alone) (`logit_scale`);
- slopes: their code loads `transformer.relative_pe.slopes` from the checkpoint over what its init computed, so
  those values are copied (`alibi_slopes`); their `alibi_scaling` is ours, copied as it is: a static
  `{"type": "linear", "factor": f}` divides the slopes by f, the length-dependent `{"type": "linear",
  "train_seq_len": n}` by max(1, K / n) in each forward over K keys (cached + new, padding included), as their
  `AlibiPositionEmbeddingLayer` computes it. Their bias is the symmetric `-m |i - j|`, ours `-m (i - j)`: the same on
  every key a causal row sees.

Their code caps inputs at `n_positions` (a `tril(ones(n_positions, n_positions))` mask buffer); ALiBi GPT-2 has no
cap. In bf16 their code rounds the bias `m |i - j|` to bf16; ours is fp32: compare the two in fp32. Their
`reorder_and_upcast_attn` only upcasts the scores to fp32 (the same function) and is accepted.
"""

import math

import torch
from transformers.activations import ACT2FN

from ..models.alibi.alibi_bias import get_alibi_slopes
from ..models.alibi.configuration_alibi_gpt2 import (
    AlibiGPT2Config,
    checked_alibi_scaling,
    static_scaling_factor,
    train_seq_len,
)
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .common import EXPORT_REFUSAL, IMPORT_REFUSAL, LAYER_NORM, Requirement, load_exactly, require
from .remote_code import Checkpoint, RemoteCodeFamily
from .weight_map import Entry, WeightMap, map_weights

NAMES = {"jais": "Jais", "btlm": "BTLM"}
# Their config classes' defaults, for keys a config.json leaves out (JAISConfig and BTLMConfig agree on these)
_DEFAULTS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "scale_attn_weights": True,
    "use_cache": True,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "pad_token_id": None,
    "tie_word_embeddings": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "position_embedding_type": "learned",
    "add_cross_attention": False,
    "alibi_scaling": None,
}
_ALIASES = {
    "hidden_size": "n_embd",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
    "max_position_embeddings": "n_positions",
}  # their attribute_map
_REFUSED = (
    Requirement(
        "position_embedding_type",
        "alibi",
        "{family} config has position_embedding_type={value!r}: a learned position table (wpe) is not ALiBi",
    ),
    Requirement(
        "activation_function",
        frozenset({"swiglu", *ACT2FN}),
        "{family} config has activation_function={value!r}, which neither their code nor ALiBi GPT-2 implements",
    ),
    Requirement("scale_attn_by_inverse_layer_idx", False),
    Requirement("add_cross_attention", False),
)
# The muP settings as each code generation reads them: ours <- (jais-13b's keys, the Jais-family's and BTLM's keys)
_OLD_KEYS = {"logit_scale": "width_scale", "embedding_scale": "embeddings_scale", "scale_by_d": "scale_qk_dot_by_d"}
_NEW_KEYS = {
    "logit_scale": "mup_output_alpha * mup_width_scale",
    "embedding_scale": "mup_embeddings_scale",
    "scale_by_d": "mup_scale_qk_dot_by_d",
}
_MASK_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers older code saved; theirs ignores them on load
SLOPES_KEY = "transformer.relative_pe.slopes"


def _with_defaults(config: dict) -> dict:
    config = dict(config)
    for alias, name in _ALIASES.items():
        if alias in config:
            config.setdefault(name, config.pop(alias))
    return _DEFAULTS | {key: value for key, value in config.items() if value is not None or key not in _DEFAULTS}


def _mup_readings(config: dict) -> dict[str, dict]:
    """{generation: {setting: value}} for each key generation the config uses (the Jais-family's when it uses none:
    the defaults agree)."""
    old = {
        "logit_scale": config.get("width_scale", 1.0),
        "embedding_scale": config.get("embeddings_scale", 1.0),
        "scale_by_d": bool(config.get("scale_qk_dot_by_d", False)),
    }
    new = {
        "logit_scale": config.get("mup_output_alpha", 1.0) * config.get("mup_width_scale", 1.0),
        "embedding_scale": config.get("mup_embeddings_scale", 1.0),
        "scale_by_d": bool(config.get("mup_scale_qk_dot_by_d", False)),
    }
    if config["model_type"] == "btlm":  # BTLM's code reads only the mup_* keys
        return {"new": new}
    uses_old = any(key in config for key in _OLD_KEYS.values())
    uses_new = any(key.startswith("mup_") for key in config)
    return {"old": old, "new": new} if uses_old and uses_new else {"old": old} if uses_old else {"new": new}


def mup_settings(config: dict) -> dict:
    """`logit_scale`, `embedding_scale`, `scale_by_d` of a Jais/BTLM config dict (defaults filled); `ValueError` when
    the keys of the two code generations are both there and disagree, or BTLM's `output_logits_scale` (the name
    Cerebras's own stack gives the product) disagrees with the product its code computes."""
    family, readings = NAMES[config["model_type"]], _mup_readings(config)
    if len(readings) == 2:
        for setting, value in readings["old"].items():
            if value != readings["new"][setting]:
                raise ValueError(
                    f"{family} config has {_OLD_KEYS[setting]}={value!r} (read by jais-13b's code) but "
                    f"{_NEW_KEYS[setting]}={readings['new'][setting]!r} (read by the Jais-family code): which code "
                    "runs this checkpoint is ambiguous, so it cannot be imported exactly"
                )
    settings = readings.get("new", readings.get("old"))
    stated = config.get("output_logits_scale")
    if stated is not None and not math.isclose(stated, settings["logit_scale"], rel_tol=1e-6):
        raise ValueError(
            f"{family} config has output_logits_scale={stated!r} but its code multiplies the logits by "
            f"mup_output_alpha * mup_width_scale = {settings['logit_scale']!r}: the two disagree"
        )
    return settings


def their_alibi_scaling(config: dict) -> dict | None:
    """Their `alibi_scaling`, which is ours (`AlibiGPT2Config.alibi_scaling` validates it, naming the field);
    refused with jais-13b's keys, whose code ignores it."""
    scaling, family = config["alibi_scaling"], NAMES[config["model_type"]]
    if scaling is None:
        return None
    if "old" in _mup_readings(config) and "new" not in _mup_readings(config):
        raise ValueError(f"{family} config has alibi_scaling={scaling!r} with jais-13b's keys: that code ignores it")
    try:
        return checked_alibi_scaling(scaling)
    except ValueError as error:
        raise ValueError(f"{family} config: {error}") from None


def cerebras_weights(gated: bool, tied: bool) -> WeightMap:
    """(ours, theirs) for every tensor: the same GPT-2 names and Conv1D layout on both sides; the gate `c_fc2` when
    the MLP is gated, `lm_head` when it is not tied. The slopes buffer is read into the config, not mapped."""
    parts = [
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ] + (["mlp.c_fc2.weight", "mlp.c_fc2.bias"] if gated else [])
    names = [
        "transformer.wte.weight",
        *(f"transformer.h.{{i}}.{part}" for part in parts),
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ] + ([] if tied else ["lm_head.weight"])
    return tuple(Entry(name, name) for name in names)


def _their_tensors(checkpoint: Checkpoint, config: dict, family: str) -> tuple[dict, torch.Tensor | None]:
    """Their state dict less what their code does not read as weights (mask buffers, a tied lm_head equal to wte),
    and the slopes tensor (None when absent: their init's, the paper's)."""
    state = dict(checkpoint.state_dict)
    slopes = state.pop(SLOPES_KEY, None)
    for i in range(config["n_layer"]):
        for buffer in _MASK_BUFFERS:
            state.pop(f"transformer.h.{i}.{buffer}", None)
    head = state.get("lm_head.weight")
    if config["tie_word_embeddings"] and head is not None:
        if not torch.equal(head, state["transformer.wte.weight"]):
            raise ValueError(
                f"{family} checkpoint is tied (tie_word_embeddings) but its lm_head.weight differs from "
                "transformer.wte.weight: which one their code uses depends on load order"
            )
        del state["lm_head.weight"]
    dtypes = sorted({str(tensor.dtype) for tensor in state.values() if tensor.is_floating_point()})
    if len(dtypes) != 1:
        raise ValueError(f"{family} checkpoint mixes weight dtypes {dtypes}: one model dtype is needed")
    return state, slopes


def convert_cerebras(checkpoint: Checkpoint) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing what the Jais or BTLM checkpoint's own code computes (fp32 rounding
    apart), at any length; `ValueError` naming the config field or tensor it cannot hold exactly."""
    if checkpoint.config.get("model_type") not in NAMES:
        raise ValueError(f"model_type must be one of {sorted(NAMES)}, got {checkpoint.config.get('model_type')!r}")
    config = _with_defaults(checkpoint.config)
    family = NAMES[config["model_type"]]
    require(config, _REFUSED, family, IMPORT_REFUSAL)
    mup, scaling = mup_settings(config), their_alibi_scaling(config)
    n_head, n_layer, swiglu = config["n_head"], config["n_layer"], config["activation_function"] == "swiglu"
    state, slopes = _their_tensors(checkpoint, config, family)
    if slopes is not None and slopes.numel() != n_head:
        raise ValueError(
            f"{family} checkpoint's {SLOPES_KEY} has shape {tuple(slopes.shape)}, not one per head ({n_head})"
        )
    slopes = get_alibi_slopes(n_head) if slopes is None else slopes.float().flatten()  # (H,)
    alibi_config = AlibiGPT2Config(
        vocab_size=config["vocab_size"],
        n_positions=config["n_positions"],
        n_embd=config["n_embd"],
        n_layer=n_layer,
        n_head=n_head,
        n_inner=config["n_inner"],
        activation_function="silu" if swiglu else config["activation_function"],
        resid_pdrop=config["resid_pdrop"],
        embd_pdrop=config["embd_pdrop"],
        attn_pdrop=config["attn_pdrop"],
        layer_norm_epsilon=config["layer_norm_epsilon"],
        initializer_range=config["initializer_range"],
        scale_attn_weights=config["scale_attn_weights"],
        use_cache=config["use_cache"],
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        pad_token_id=config["pad_token_id"],
        tie_word_embeddings=config["tie_word_embeddings"],
        alibi_slopes=slopes.tolist(),
        gated_mlp=swiglu,
        attn_scale_power=1.0 if mup["scale_by_d"] else 0.5,
        embedding_scale=mup["embedding_scale"],
        logit_scale=mup["logit_scale"],
        alibi_scaling=scaling,
    )
    what = f"{config['model_type']} -> alibi_gpt2"
    ours = map_weights(cerebras_weights(swiglu, config["tie_word_embeddings"]), state, n_layer, to="ours", what=what)
    if config["tie_word_embeddings"]:
        ours["lm_head.weight"] = ours["transformer.wte.weight"]  # our state dict names the tied head too
    model = AlibiGPT2LMHeadModel(alibi_config).to(next(iter(ours.values())).dtype)
    return load_exactly(model, ours, what)


# What their architecture holds: anything else would change the function.
_NEEDS = (
    LAYER_NORM,
    Requirement("bias", True),
    Requirement("embedding_layernorm", False),
    Requirement("clip_qkv", None),
    Requirement(
        "activation_function",
        "silu",
        "their gated MLP is SwiGLU; {field}={value!r} with gated_mlp",
        read=lambda config: config.activation_function if config.gated_mlp else "silu",
    ),
    Requirement(
        "attn_scale_power",
        frozenset({0.5, 1.0}),
        "their attention divides q.k by head_dim or its square root; {field}={value!r}",
    ),
    Requirement(
        "alibi_scaling.factor",
        True,
        "their config accepts an alibi_scaling.factor > 1 only (1: none); {field}={config.alibi_scaling[factor]!r}",
        read=lambda config: static_scaling_factor(config.alibi_scaling) >= 1.0,
    ),
    Requirement(
        "alibi_scaling.train_seq_len",
        True,
        "their config accepts an alibi_scaling.train_seq_len > 1 only; {field}={config.alibi_scaling[train_seq_len]!r}",
        read=lambda config: (train_seq_len(config.alibi_scaling) or 2) > 1,
    ),
)


def check_cerebras_exportable(config: AlibiGPT2Config, max_seq_len: int | None = None) -> int:
    """The `n_positions` to export (their code refuses longer inputs; default the model's); `ValueError` naming the
    config field their architecture cannot hold."""
    max_seq_len = config.n_positions if max_seq_len is None else max_seq_len
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    require(config, _NEEDS, "Jais/BTLM", EXPORT_REFUSAL)
    return max_seq_len


def cerebras_config(config: AlibiGPT2Config, model_type: str, n_positions: int, dtype: str) -> dict:
    """Their config dict (`export_cerebras`) for a model of `config` stored in `dtype` (e.g. "float32")."""
    scaling, by_d = config.alibi_scaling, config.attn_scale_power == 1.0
    if scaling is not None and scaling.get("factor") == 1.0:
        scaling = None  # their config refuses a factor of 1 (no scale at all)
    module = "jais" if model_type == "jais" else "btlm"
    prefix = "JAIS" if model_type == "jais" else "BTLM"
    theirs = {
        "model_type": model_type,
        "architectures": [f"{prefix}LMHeadModel"],
        "auto_map": {
            "AutoConfig": f"configuration_{module}.{prefix}Config",
            "AutoModel": f"modeling_{module}.{prefix}Model",
            "AutoModelForCausalLM": f"modeling_{module}.{prefix}LMHeadModel",
        },
        "vocab_size": config.vocab_size,
        "n_positions": n_positions,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": config.n_inner,
        "activation_function": "swiglu" if config.gated_mlp else config.activation_function,
        "resid_pdrop": config.resid_pdrop,
        "embd_pdrop": config.embd_pdrop,
        "attn_pdrop": config.attn_pdrop,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "initializer_range": config.initializer_range,
        "scale_attn_weights": config.scale_attn_weights,
        "use_cache": config.use_cache,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "position_embedding_type": "alibi",
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "mup_width_scale": 1.0,
        "mup_output_alpha": config.logit_scale,
        "mup_embeddings_scale": config.embedding_scale,
        "mup_scale_qk_dot_by_d": by_d,
        "alibi_scaling": None if scaling is None else dict(scaling),
        "torch_dtype": dtype,
    }
    if model_type == "jais":
        theirs |= {
            "width_scale": config.logit_scale,
            "embeddings_scale": config.embedding_scale,
            "scale_qk_dot_by_d": by_d,
        }
    return theirs


def export_cerebras(model: AlibiGPT2LMHeadModel, model_type: str, max_seq_len: int | None = None) -> Checkpoint:
    """`model` as a Jais (`model_type="jais"`) or BTLM checkpoint: their config dict and state dict (`Checkpoint`).

    A Jais config carries both key generations, equal (jais-13b's code reads `width_scale`, `embeddings_scale`,
    `scale_qk_dot_by_d`; the Jais-family code the `mup_*` keys); BTLM's the `mup_*` keys its code reads. The logit
    multiplier is written whole as `mup_output_alpha` (with `mup_width_scale` 1: it only matters to muP training).
    `auto_map` names their code's modules, which are theirs to ship: put their `configuration_*.py` and
    `modeling_*.py` beside it. `max_seq_len` becomes `n_positions`, the longest input their code accepts.
    """
    if model_type not in NAMES:
        raise ValueError(f"model_type must be one of {sorted(NAMES)}, got {model_type!r}")
    config = model.config
    n_positions = check_cerebras_exportable(config, max_seq_len)
    slopes = (
        torch.tensor(config.alibi_slopes)
        if config.alibi_slopes is not None
        else get_alibi_slopes(config.n_head, config.alibi_max_bias)
    )
    theirs = cerebras_config(config, model_type, n_positions, dtype=str(model.dtype).removeprefix("torch."))
    table = cerebras_weights(config.gated_mlp, config.tie_word_embeddings)
    ours = model.state_dict()
    if config.tie_word_embeddings:
        del ours["lm_head.weight"]  # the tied head is wte: their checkpoints do not store it twice
    state = map_weights(table, ours, config.n_layer, to="theirs", what=f"alibi_gpt2 -> {model_type}")
    state[SLOPES_KEY] = slopes.to(model.dtype)[:, None]  # (H, 1), their parameter's shape and the model's dtype
    return Checkpoint(theirs, {name: tensor.detach().contiguous() for name, tensor in state.items()})


# What dispatch needs to know of Jais and BTLM: their tokenizer files are byte-level BPE, copied unchanged
JAIS = RemoteCodeFamily(
    names=NAMES, convert=convert_cerebras, export=export_cerebras, check_exportable=check_cerebras_exportable
)
