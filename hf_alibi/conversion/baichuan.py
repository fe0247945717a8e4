"""Baichuan-13B and Baichuan2-13B (base and chat) <-> ALiBi GPT-2, exactly: Llama-shaped decoders with ALiBi,
published as `trust_remote_code` checkpoints whose code no longer runs on transformers 5 (its tokenizer since 4.34,
its generation on the tuple cache it expects).

Their layout (their `modeling_baichuan.py` and the checkpoints' files): `model.embed_tokens`, per layer
`model.layers.{i}.self_attn.W_pack.weight` `[3H, H]` (rows q, then k, then v; no per-head interleave) and `o_proj`,
`mlp.gate_proj` / `up_proj` / `down_proj`, `input_layernorm`, `post_attention_layernorm`; `model.norm`; an untied
`lm_head`. Each difference from ALiBi GPT-2's default is a config switch of ours: RMSNorm with its variance in fp32
(`norm_type="rms_norm"`, their `rms_norm_eps`), no biases anywhere (`bias=False`), the gated MLP
`down(act(gate(x)) * up(x))` (`gated_mlp`, their `hidden_act`: `gate_proj` is our gate `c_fc2`, `up_proj` our `c_fc`),
the untied head (`tie_word_embeddings=False`). Every weight is `nn.Linear` `(out, in)`, ours `Conv1D` `(in, out)`: a
transpose, so one table (`baichuan_weights`) maps both ways. The scale is `1/sqrt(head_dim)`; the slopes are the
paper's rule for `num_attention_heads` (their `_get_interleave`, equal to `get_alibi_slopes` bit for bit for every
head count to 128), added as `slope * j` by key index, which softmax makes `-slope * (i - j)`. `model_max_length` is
only where their mask cache starts (it grows past it): ALiBi GPT-2 keeps it as `n_positions`, metadata.

Baichuan2 (vocab 125696; its config carries `z_loss_weight`, which is how it is told from Baichuan-13B here) divides
each row of `lm_head.weight` by its L2 norm before use (`NormHead`, `F.normalize` in the weight's dtype, in place on
its first forward in eval mode): the import folds that into the head. A head already normalised (every row's norm 1
to within 4 units of its dtype's rounding) is kept as it is, so importing an export gives its tensors back bit for bit;
renormalising it would only re-round it. `z_loss_weight` only weighs a term of their training loss: not imported.

Baichuan-7B and Baichuan2-7B (hidden 4096, 32 layers) use rotary embeddings, not ALiBi, under the same model type:
refused in one line, before their weights are read. In half precision their code adds `slope * j` to the scores in the
model's dtype (bf16 spacing is 16 at j = 2048 and past): ours is fp32 and relative, so compare the two in fp32.
"""

import torch
from torch.nn import functional as F
from transformers.activations import ACT2FN

from ..models.alibi.alibi_bias import get_alibi_slopes, slopes_from_config
from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .baichuan_tokenizer import read_baichuan_tokenizer, write_baichuan_tokenizer
from .common import EXPORT_REFUSAL, IMPORT_REFUSAL, Requirement, load_exactly, require
from .remote_code import Checkpoint, RemoteCodeFamily
from .weight_map import IDENTITY, TRANSPOSE, Entry, WeightMap, map_weights

NAMES = {"baichuan": "Baichuan"}
ROTARY_WIDTH = 4096  # Baichuan-7B's and Baichuan2-7B's hidden_size: how engines tell the rotary models apart
# Their config class's defaults (Baichuan-13B's; Baichuan2-13B's adds z_loss_weight), for keys a config.json leaves out
_DEFAULTS = {
    "vocab_size": 64000,
    "hidden_size": 5120,
    "intermediate_size": 13696,
    "num_hidden_layers": 40,
    "num_attention_heads": 40,
    "hidden_act": "silu",
    "model_max_length": 4096,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-6,
    "use_cache": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
_REFUSED = (
    Requirement(
        "hidden_size",
        True,
        "{family} config has hidden_size={config[hidden_size]}: that is Baichuan-7B or Baichuan2-7B, which use "
        "rotary position embeddings, not ALiBi (engines tell them apart by hidden_size == 4096); hf_alibi imports "
        "the ALiBi models (Baichuan-13B, Baichuan2-13B)",
        read=lambda config: config["hidden_size"] != ROTARY_WIDTH,
    ),
    Requirement(
        "hidden_act",
        frozenset(ACT2FN),
        "{family} config has hidden_act={value!r}, which neither their code nor ALiBi GPT-2 implements",
    ),
    Requirement(
        "tie_word_embeddings",
        False,
        "{family} config has tie_word_embeddings={value!r}: their NormHead would untie it on its first forward",
    ),
    Requirement(
        "num_key_value_heads",
        True,
        "{family} config has num_key_value_heads={config[num_key_value_heads]!r}: W_pack holds as many key heads as "
        "query heads ({config[num_attention_heads]})",
        read=lambda config: (
            config.get("num_key_value_heads", config["num_attention_heads"]) == config["num_attention_heads"]
        ),
    ),
)
_LAYER = {  # ours -> theirs, in every block
    "ln_1.weight": "input_layernorm.weight",
    "attn.c_attn.weight": "self_attn.W_pack.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "ln_2.weight": "post_attention_layernorm.weight",
    "mlp.c_fc.weight": "mlp.up_proj.weight",
    "mlp.c_fc2.weight": "mlp.gate_proj.weight",  # the gate: act(gate(x)) * up(x)
    "mlp.c_proj.weight": "mlp.down_proj.weight",
}


def baichuan_weights() -> WeightMap:
    """(ours, theirs, transform) for every tensor: norms as they are, every projection transposed."""
    return (
        Entry("transformer.wte.weight", "model.embed_tokens.weight"),
        *(
            Entry(
                f"transformer.h.{{i}}.{ours}", f"model.layers.{{i}}.{theirs}", IDENTITY if "ln_" in ours else TRANSPOSE
            )
            for ours, theirs in _LAYER.items()
        ),
        Entry("transformer.ln_f.weight", "model.norm.weight"),
        Entry("lm_head.weight", "lm_head.weight"),
    )


def with_defaults(config: dict) -> dict:
    """Their config dict with their config class's defaults for the keys it leaves out."""
    return _DEFAULTS | {key: value for key, value in config.items() if value is not None or key not in _DEFAULTS}


def check_baichuan_config(config: dict) -> None:
    """`ValueError` naming what their config asks for that ALiBi GPT-2 cannot hold (first of all Baichuan-7B's
    rotary embeddings); read before any weight."""
    if config.get("model_type") not in NAMES:
        raise ValueError(f"model_type must be one of {sorted(NAMES)}, got {config.get('model_type')!r}")
    config = with_defaults(config)
    require(config, _REFUSED, "Baichuan", IMPORT_REFUSAL)
    if config["hidden_size"] % config["num_attention_heads"]:
        raise ValueError(
            f"Baichuan config has hidden_size={config['hidden_size']}, not divisible by num_attention_heads="
            f"{config['num_attention_heads']}"
        )


def has_norm_head(config: dict) -> bool:
    """Whether their code divides the head's rows by their norms: Baichuan2's, whose config carries `z_loss_weight`
    (and whose vocabulary is 125696)."""
    return "z_loss_weight" in config or config.get("vocab_size") == 125696


def is_normalised(head: torch.Tensor) -> bool:
    """Whether every row of `head` has norm 1 to within 4 units of its dtype's rounding (float64 norms)."""
    deviation = (head.double().norm(dim=-1) - 1).abs().max().item()
    return deviation <= 4 * torch.finfo(head.dtype).eps


def folded_norm_head(head: torch.Tensor) -> torch.Tensor:
    """NormHead's weight as their code uses it: `F.normalize(weight)` (each row over its L2 norm, in the weight's
    dtype); a head already normalised is returned as it is (`is_normalised`)."""
    return head if is_normalised(head) else F.normalize(head, dim=-1)


def convert_baichuan(checkpoint: Checkpoint) -> AlibiGPT2LMHeadModel:
    """An `AlibiGPT2LMHeadModel` computing what the Baichuan checkpoint's own code computes (fp32 rounding apart),
    at any length; `ValueError` naming the config field or tensor it cannot hold exactly."""
    check_baichuan_config(checkpoint.config)
    config = with_defaults(checkpoint.config)
    state = dict(checkpoint.state_dict)
    dtypes = sorted({str(tensor.dtype) for tensor in state.values() if tensor.is_floating_point()})
    if len(dtypes) != 1:
        raise ValueError(f"Baichuan checkpoint mixes weight dtypes {dtypes}: one model dtype is needed")
    if has_norm_head(config) and "lm_head.weight" in state:
        state["lm_head.weight"] = folded_norm_head(state["lm_head.weight"])
    alibi_config = AlibiGPT2Config(
        vocab_size=config["vocab_size"],
        n_positions=config["model_max_length"],
        n_embd=config["hidden_size"],
        n_layer=config["num_hidden_layers"],
        n_head=config["num_attention_heads"],
        n_inner=config["intermediate_size"],
        activation_function=config["hidden_act"],
        resid_pdrop=0.0,  # their code has no dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=config["rms_norm_eps"],
        initializer_range=config["initializer_range"],
        use_cache=config["use_cache"],
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        pad_token_id=config["pad_token_id"],
        tie_word_embeddings=False,
        norm_type="rms_norm",
        bias=False,
        gated_mlp=True,
    )
    what = "baichuan -> alibi_gpt2"
    ours = map_weights(baichuan_weights(), state, config["num_hidden_layers"], to="ours", what=what)
    model = AlibiGPT2LMHeadModel(alibi_config).to(next(iter(ours.values())).dtype)
    return load_exactly(model, ours, what)


# What their architecture (and llama.cpp's `baichuan` graph, vLLM's former BaichuanForCausalLM) holds exactly
_NEEDS = (
    Requirement("norm_type", "rms_norm", "{family} normalises with RMSNorm; {field}={value!r}"),
    Requirement("bias", False, "{family} has no biases; {field}={value!r}"),
    Requirement("gated_mlp", True, "{family}'s MLP is gated, down(act(gate(x)) * up(x)); {field}={value!r}"),
    Requirement(
        "activation_function", "silu", "{family}'s gate is SiLU in llama.cpp and vLLM alike; {field}={value!r}"
    ),
    Requirement("tie_word_embeddings", False, "{family}'s lm_head is a weight of its own; {field}={value!r}"),
    Requirement("embedding_layernorm", False),
    Requirement("clip_qkv", None),
    Requirement("scale_attn_weights", True),
    Requirement("attn_scale_power", 0.5, "{family} divides q.k by sqrt(head_dim); {field}={value!r}"),
    Requirement("embedding_scale", 1.0),
    Requirement("logit_scale", 1.0),
    Requirement("alibi_scaling", None, "{family} has no slope scale; {field}={value!r}"),
    Requirement(
        "n_embd",
        True,
        "{family} checkpoints 4096 wide are read as Baichuan-7B's, with rotary embeddings (llama.cpp, vLLM); "
        "{field}={config.n_embd}",
        read=lambda config: config.n_embd != ROTARY_WIDTH,
    ),
    Requirement(
        "alibi_slopes",
        lambda config: get_alibi_slopes(config.n_head).tolist(),
        "{family} computes the paper's slopes for {config.n_head} heads; this model's alibi_slopes/alibi_max_bias "
        "give {value}",
        read=lambda config: slopes_from_config(config).tolist(),
    ),
)


def check_baichuan_exportable(config: AlibiGPT2Config, max_seq_len: int | None = None) -> int:
    """The `model_max_length` to export (default the model's `n_positions`); `ValueError` naming the config field
    their architecture cannot hold."""
    max_seq_len = config.n_positions if max_seq_len is None else max_seq_len
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    require(config, _NEEDS, "Baichuan", EXPORT_REFUSAL)
    return max_seq_len


def baichuan_config(config: AlibiGPT2Config, model_max_length: int, dtype: str, norm_head: bool) -> dict:
    """Their config.json for a model of `config` stored in `dtype`: every key of their config class, Baichuan2's
    `z_loss_weight` (0: a training-loss term) when the head is normalised (`norm_head`), `auto_map` naming their code
    (theirs to ship: put `configuration_baichuan.py` and `modeling_baichuan.py` beside it)."""
    theirs = {
        "model_type": "baichuan",
        "architectures": ["BaichuanForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_baichuan.BaichuanConfig",
            "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM",
        },
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.n_inner or 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "hidden_act": config.activation_function,
        "model_max_length": model_max_length,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.layer_norm_epsilon,
        "use_cache": config.use_cache,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }
    return theirs | ({"z_loss_weight": 0} if norm_head else {})


def export_baichuan(model: AlibiGPT2LMHeadModel, model_type: str = "baichuan", max_seq_len: int | None = None):
    """`model` as a Baichuan checkpoint (`Checkpoint`: their config dict and state dict), `W_pack` fused as theirs.

    A head whose rows are normalised (an imported Baichuan2) is written as Baichuan2's, with `z_loss_weight` in the
    config: their NormHead, llama.cpp's converter (which copies `lm_head` as stored, without NormHead) and Baichuan-13B's
    plain head then all compute the same function. Any other head is written as Baichuan-13B's. `max_seq_len` becomes
    `model_max_length`.
    """
    if model_type not in NAMES:
        raise ValueError(f"model_type must be one of {sorted(NAMES)}, got {model_type!r}")
    config = model.config
    model_max_length = check_baichuan_exportable(config, max_seq_len)
    ours = model.state_dict()
    state = map_weights(baichuan_weights(), ours, config.n_layer, to="theirs", what="alibi_gpt2 -> baichuan")
    dtype = str(model.dtype).removeprefix("torch.")
    theirs = baichuan_config(config, model_max_length, dtype, norm_head=is_normalised(ours["lm_head.weight"]))
    return Checkpoint(theirs, {name: tensor.detach().contiguous() for name, tensor in state.items()})


# What dispatch needs to know of Baichuan: the 7B check before any weight, the SentencePiece tokenizer both ways
BAICHUAN = RemoteCodeFamily(
    names=NAMES,
    convert=convert_baichuan,
    export=export_baichuan,
    check_exportable=check_baichuan_exportable,
    check_config=check_baichuan_config,
    read_tokenizer=read_baichuan_tokenizer,
    write_tokenizer=write_baichuan_tokenizer,
    max_seq_len="its model_max_length",
)
