"""ALiBi GPT-2 -> one GGUF file that llama.cpp (and so Ollama, LM Studio) runs, as its `mpt` or `jais` architecture.

llama.cpp's `mpt` graph is pre-LN blocks, fused `[q | k | v]`, ALiBi slopes computed from `max_alibi_bias` by the
paper's rule, the tanh GELU, optional biases, optional `clamp_kqv` and a tied output: the default family (gelu_new
with biases) and imported BLOOM-free models with the tanh GELU are exact there. A gated MLP (Jais, BTLM) goes to
its `jais` graph: the same blocks with a SwiGLU MLP (`ffn_up * silu(ffn_gate)`), biases required, `q . k` always
divided by `head_dim` and no multiplier of its own: as llama.cpp's own converter does, the embedding multiplier is
folded into `token_embd` (the same product, bit for bit) and the logit multiplier into an untied `output` (equal to
fp32 rounding). Weights are written as F32 (exact). The tokenizer (`tokenizer.json` of a byte-level BPE, as GPT-2,
BLOOM and MPT use) goes in the same file.
"""

import json
import os
import tempfile

import numpy as np
import torch

from ..atomic_files import check_destination, staged_file
from ..import_utils import require_extra
from ..models.alibi.alibi_bias import get_alibi_slopes, slopes_from_config
from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel, scaled
from .common import (
    LAYER_NORM,
    LENGTH_DEPENDENT_SCALING,
    NO_MUP_SWITCHES,
    TANH_GELUS,
    Requirement,
    checkpoint_name,
    require,
    source_card_metadata,
)

# The pre-tokenizers llama.cpp implements that byte-level BPE tokenizers of these families use (llama-vocab.cpp).
_BLOOM_SPLIT = " ?[^(\\s|[.,!?…。，、।۔،])]+"
_LAYERS = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
_JAIS_LAYERS = _LAYERS | {"mlp.c_fc2": "ffn_gate"}
# architecture -> what llama.cpp's graph of that name holds exactly
_NEEDS = {
    "mpt": (
        LAYER_NORM,
        Requirement(
            "activation_function",
            frozenset(TANH_GELUS),
            "{family} uses the tanh GELU; {field}={value!r} would run approximately",
        ),
        Requirement("embedding_layernorm", False),
        Requirement("scale_attn_weights", True),
        *NO_MUP_SWITCHES,
    ),
    "jais": (
        LAYER_NORM,
        Requirement("activation_function", "silu", "{family}'s gated MLP is SwiGLU; {field}={value!r}"),
        Requirement("bias", True, "{family} adds every bias (they are required tensors); {field}={value!r}"),
        Requirement("embedding_layernorm", False),
        Requirement("clip_qkv", None),
        Requirement("scale_attn_weights", True),
        Requirement("attn_scale_power", 1.0, "{family} divides q.k by head_dim (a fixed 1/d); {field}={value!r}"),
        LENGTH_DEPENDENT_SCALING,
        Requirement(
            "alibi_scaling.factor",
            None,
            "{family} computes its slopes from max_alibi_bias alone (no slope scale); {field}={value!r}",
        ),
    ),
}
ARCHITECTURES = tuple(_NEEDS)  # llama.cpp's architectures an ALiBi GPT-2 is written as


def gguf_architecture(config: AlibiGPT2Config) -> str:
    """llama.cpp's architecture for a model of `config`: `jais` for a gated (SwiGLU) MLP, else `mpt`."""
    return "jais" if config.gated_mlp else "mpt"


def check_gguf_exportable(config: AlibiGPT2Config) -> float:
    """The `max_alibi_bias` llama.cpp needs to compute the slopes of a model of `config`; `ValueError` naming what
    it cannot hold."""
    architecture = gguf_architecture(config)
    require(
        config,
        _NEEDS[architecture],
        f"llama.cpp's {architecture} graph",
        "{family} needs {field}={accepted!r}, the model has {value!r}",
    )
    slopes = slopes_from_config(config)
    if torch.all(slopes == 0):
        return 0.0  # llama.cpp: max_alibi_bias 0 means no ALiBi at all
    # llama.cpp derives every slope from max_alibi_bias and the head count; other slopes are not representable
    if not torch.allclose(slopes, get_alibi_slopes(config.n_head, config.alibi_max_bias), rtol=1e-6, atol=0):
        raise ValueError(
            f"llama.cpp computes slopes from max_alibi_bias by the paper's rule; alibi_slopes={slopes.tolist()} are "
            f"not that rule at alibi_max_bias={config.alibi_max_bias}"
        )
    return float(config.alibi_max_bias)


def _pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a `tokenizer.json`, or `ValueError` naming it."""
    if (spec.get("normalizer") or {}).get("type") not in (None, "NFC"):
        raise ValueError(f"tokenizer normalizer {spec['normalizer']} has no llama.cpp counterpart")
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True) and not steps[0].get("add_prefix_space"):
        return "gpt-2"  # GPT-2's regex; GPT-NeoX (MPT) and OLMo use the same one
    if (
        kinds == ["Split", "ByteLevel"]
        and steps[0].get("pattern", {}).get("Regex") == _BLOOM_SPLIT
        and not steps[1].get("use_regex", True)
    ):
        return "bloom"
    raise ValueError(f"tokenizer pre_tokenizer {json.dumps(pre)} is not one llama.cpp implements (gpt-2, bloom)")


def _add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """Tokens, token types, merges, special ids and the pre-tokenizer of a fast byte-level BPE `tokenizer`."""
    import gguf

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers go into a gguf here, got {spec['model']['type']}")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(spec))
    by_id = {index: token for token, index in spec["model"]["vocab"].items()}
    added = {entry["id"]: entry for entry in spec.get("added_tokens", [])}
    by_id.update({index: entry["content"] for index, entry in added.items()})
    if by_id and max(by_id) >= vocab_size:
        raise ValueError(f"tokenizer has token id {max(by_id)} but the model's vocab_size is {vocab_size}")
    tokens, types = [], []
    for index in range(vocab_size):  # llama.cpp needs exactly one entry per embedding row
        if index not in by_id:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.CONTROL if added[index].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[index])
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as folder:  # gguf's own reader of merges and special tokens
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
        special.add_to_gguf(writer)
    if not special.merges:
        writer.add_token_merges([_inert_merge(tokens, types)])
    adds_bos = tokenizer.bos_token_id is not None and tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]
    writer.add_add_bos_token(adds_bos)


def _inert_merge(tokens: list[str], types: list) -> str:
    """One merge for a BPE of bytes alone (the byte-level demo's 257 tokens), whose gguf would have none: llama.cpp
    refuses a gpt2 vocabulary without merges, and gguf cannot store an empty list. The merge joins two byte tokens into
    a string that is no token, so llama.cpp's tokenizer, which emits a merged symbol missing from the vocabulary as
    its bytes again, tokenizes exactly as before (tests/conversion/test_gguf_export.py checks it against ours)."""
    import gguf

    normal = [token for token, kind in zip(tokens, types) if kind == gguf.TokenType.NORMAL and len(token) == 1]
    vocabulary = set(tokens)
    for first in normal:
        for second in normal:
            if first + second not in vocabulary:
                return f"{first} {second}"
    raise ValueError("the tokenizer has no merges and no two byte tokens to write an inert one from")


def write_gguf(model: AlibiGPT2LMHeadModel, path: str | os.PathLike, tokenizer, context_length: int | None = None):
    """Write `model` and `tokenizer` (a fast tokenizer) to the GGUF file `path`, atomically; return the path.

    `context_length` (default: the model's `n_positions`) is the `{mpt,jais}.context_length` llama.cpp reads as the
    training length; ALiBi itself runs past it (`llama-cli -c N`).
    """
    require_extra("gguf", "a gguf export (llama.cpp)")
    import gguf

    path = check_destination(path, file_suffix=".gguf")
    max_alibi_bias = check_gguf_exportable(model.config)
    if tokenizer is None:
        raise ValueError("a gguf needs the model's tokenizer (llama.cpp reads text through it); pass tokenizer=")
    config = model.config
    with staged_file(path) as staging:  # gguf's writer opens the file itself
        writer = gguf.GGUFWriter(staging, gguf_architecture(config))
        add_general_fields(writer, model)
        writer.add_context_length(context_length or config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_head_count_kv(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_max_alibi_bias(max_alibi_bias)  # always: without it llama.cpp runs with no ALiBi at all
        if config.clip_qkv is not None:
            writer.add_clamp_kqv(config.clip_qkv)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        _add_tokenizer(writer, tokenizer, config.vocab_size)
        write_out(writer, gguf_tensors(model))
    return path


def write_out(writer, tensors: dict[str, np.ndarray]) -> None:
    """Add `tensors` to the gguf `writer`, then write its header, key-values and tensors, and close it."""
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_general_fields(writer, model: AlibiGPT2LMHeadModel) -> None:
    """llama.cpp's `general.*` fields: the model folder's name (not its path), type, size label and, where the
    folder's model card names them, licence and base model."""
    import gguf

    source = getattr(model.config, "_name_or_path", "") or ""
    writer.add_type("model")
    writer.add_name(checkpoint_name(source) if source else "alibi_gpt2")
    writer.add_size_label(gguf.size_label(sum(p.numel() for p in model.parameters()), 0, 0, 0))
    card = source_card_metadata(source) if source else {}
    for field, add in (
        ("license", writer.add_license),
        ("license_name", writer.add_license_name),
        ("license_link", writer.add_license_link),
    ):
        if field in card:
            add(card[field])
    base_models = card.get("base_model", [])
    base_models = [base_models] if isinstance(base_models, str) else base_models
    if base_models:
        writer.add_base_model_count(len(base_models))
        for index, repo in enumerate(base_models):
            writer.add_base_model_name(index, repo.split("/")[-1])
            writer.add_base_model_repo_url(index, f"https://huggingface.co/{repo}")


def gguf_tensors(model: AlibiGPT2LMHeadModel) -> dict[str, np.ndarray]:
    """llama.cpp `mpt` or `jais` tensor names -> fp32 arrays in its (out, in) row-major layout (Conv1D weights
    transposed); for `jais` the muP multipliers folded into `token_embd` and `output`, which it always has."""
    config = model.config
    state = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    jais = gguf_architecture(config) == "jais"
    # `scaled` is the model's own product (wte(ids) * scale in fp32): the same bits, looked up before or after
    arrays = {"token_embd.weight": scaled(state["transformer.wte.weight"], config.embedding_scale)}  # (V, C)
    for part in ("weight", "bias"):
        if f"transformer.ln_f.{part}" in state:
            arrays[f"output_norm.{part}"] = state[f"transformer.ln_f.{part}"]
    if jais or not config.tie_word_embeddings:
        head = state["transformer.wte.weight" if config.tie_word_embeddings else "lm_head.weight"]  # (V, C)
        arrays["output.weight"] = scaled(head, config.logit_scale)  # h @ (W s)^T: (h @ W^T) s to fp32 rounding
    for i in range(config.n_layer):
        for ours, theirs in (_JAIS_LAYERS if jais else _LAYERS).items():
            weight = state[f"transformer.h.{i}.{ours}.weight"]
            # Conv1D (in, out) -> (out, in); LayerNorm weights are 1-D
            arrays[f"blk.{i}.{theirs}.weight"] = weight.t() if weight.ndim == 2 else weight
            if f"transformer.h.{i}.{ours}.bias" in state:
                arrays[f"blk.{i}.{theirs}.bias"] = state[f"transformer.h.{i}.{ours}.bias"]
    return {name: np.ascontiguousarray(tensor.numpy()) for name, tensor in arrays.items()}
