"""ALiBi BERT -> one GGUF file that llama.cpp runs as its `jina-bert-v2` architecture (embeddings, mean pooling).

Tensor names come from gguf's own table for that architecture (`get_tensor_name_map`, what llama.cpp's converter
uses): `token_embd`, `token_types`, `token_embd_norm`, per block `attn_q/k/v` (with `attn_q_norm`/`attn_k_norm` for
q/k LayerNorms), `attn_output`, `attn_output_norm`, `ffn_up` (the fused `gated_layers`, 2I rows: llama.cpp's GEGLU
applies the GELU to the first half, as Jina does), `ffn_down`, `layer_output_norm`. Weights are written F32 (exact);
llama.cpp computes its bias from the paper's slopes at max bias 8 (ours), bidirectional, no length cap.

jina-embeddings-v2-base-code's layer (`layer_layout="jina_code"`) goes into the same graph: `layer_norm_1` is
`attn_norm_2` (llama.cpp adds the layer input again before it), `down_layer` is `ffn_down`, `layer_norm_2` is
`layer_output_norm`, and `up_gated_layer`'s rows `[up | gate]` are split into `ffn_up` and `ffn_gate`, which llama.cpp
computes as `gelu(ffn_gate x) * ffn_up x`: Jina's activation on the second half. Left fused as one `ffn_up` (where
gguf's table maps it), llama.cpp's GEGLU would put the GELU on the first half instead.

What differs: ggml's GELU is the tanh approximation (as TEI's), read from an fp16 table, so llama.cpp's embeddings are
close to ours, not equal (TEI measured 4e-4 relative on Jina's own). Refused by name: `reglu` (llama.cpp's graph has
only the GELU GLU), a `glu` activation other than GELU, classifier heads (the gguf holds the encoder; llama.cpp's
converter keeps no pooler, so jina-reranker-v1's head is not held exactly). A masked-LM model's head is left out, as
llama.cpp's converter leaves it out. WordPiece vocabularies (jina-embeddings-v2-base-en's) go in as llama.cpp's `bert`
vocabulary, byte-level BPE ones (base-de/es/zh/code) as `gpt2`, with the `<s>`/`</s>` their post-processor adds.
"""

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ..atomic_files import check_destination, staged_file
from ..import_utils import require_extra
from .common import EXPORT_REFUSAL, Requirement, require
from .encoders import HEADS
from .gguf_export import _add_tokenizer, add_general_fields, write_out

ARCHITECTURE = "jina-bert-v2"
_NEEDS = (
    Requirement(
        "glu_activation",
        "gelu",
        "{family}'s GLU is GELU (GEGLU); this model's GLU activation is {value!r} (feed_forward_type="
        "{config.feed_forward_type!r})",
        read=lambda config: config.glu_activation,
    ),
)


def check_encoder_gguf_exportable(model) -> None:
    """`ValueError` naming what llama.cpp's `jina-bert-v2` graph cannot hold."""
    require(model.config, _NEEDS, f"llama.cpp's {ARCHITECTURE} graph", EXPORT_REFUSAL)
    head = HEADS[type(model).__name__]
    if head not in ("base", "masked_lm"):
        raise ValueError(
            f"a gguf export holds the encoder for embeddings; a {head} model's head has no exact place in llama.cpp's "
            f"{ARCHITECTURE} graph (its converter keeps no pooler): export the base AlibiBertModel"
        )


def encoder_gguf_tensors(model) -> dict[str, np.ndarray]:
    """gguf's `jina-bert-v2` names -> fp32 arrays (out, in), the encoder's tensors only (no pooler, no head)."""
    import gguf

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.JINA_BERT_V2, config.num_hidden_layers)
    arrays = {}
    for key, tensor in model.state_dict().items():
        key = key.removeprefix("bert.")
        if key.startswith(("pooler.", "cls.", "classifier.")):
            continue
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"gguf's {ARCHITECTURE} table has no name for {key}")
        array = np.ascontiguousarray(tensor.detach().float().cpu().numpy())
        if key.endswith(".mlp.up_gated_layer.weight"):
            arrays |= _up_and_gate(name, array, config.intermediate_size)
        else:
            arrays[name] = array
    return arrays


def _up_and_gate(up_name: str, fused: np.ndarray, inner: int) -> dict[str, np.ndarray]:
    """base-code's `up_gated_layer` rows `[up | gate]` (its activation on the gate, the second half) as llama.cpp's
    `ffn_up` and `ffn_gate` (a separate gate takes llama.cpp's `gelu(gate) * up` path, whichever half its fused GEGLU
    would activate)."""
    return {up_name: fused[:inner], up_name.replace(".ffn_up.", ".ffn_gate."): fused[inner:]}


def _add_wordpiece(writer, tokenizer, vocab_size: int) -> None:
    """A WordPiece vocabulary as llama.cpp's `bert` one: `##` pieces bare, word starts with a phantom space (U+2581),
    special tokens as they are."""
    import gguf

    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index, f"[PAD{index}]")
        if index in special or index not in by_id:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if index in special else gguf.TokenType.UNUSED)
        else:
            tokens.append(token[2:] if token.startswith("##") else "\u2581" + token)
            types.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as folder:  # gguf's own reader of the special tokens
        tokenizer.save_pretrained(folder)
        gguf.SpecialVocab(folder, n_vocab=vocab_size).add_to_gguf(writer)


def _tokenizer_of(tokenizer):
    """`tokenizer` itself, or the one saved in the folder `tokenizer` names; `ValueError` when there is none."""
    if tokenizer is None:
        raise ValueError("a gguf needs the model's tokenizer (llama.cpp reads text through it); pass tokenizer=")
    if isinstance(tokenizer, (str, os.PathLike)):
        from .common import load_tokenizer

        folder, tokenizer = tokenizer, load_tokenizer(tokenizer)
        if tokenizer is None:
            raise ValueError(f"{folder} has no tokenizer; a gguf needs one (llama.cpp reads text through it)")
    return tokenizer


def write_encoder_gguf(model, path: str | os.PathLike, tokenizer, context_length: int | None = None) -> Path:
    """Write `model` (an `AlibiBertModel` or `AlibiBertForMaskedLM`) and `tokenizer` (or the folder holding it) to the
    GGUF file `path`, atomically, as llama.cpp's `jina-bert-v2` with mean pooling; return the path.
    `context_length` (default: `max_position_embeddings`) is what llama.cpp reads as the trained length."""
    require_extra("gguf", "a gguf export (llama.cpp)")
    import gguf

    path = check_destination(path, file_suffix=".gguf")
    check_encoder_gguf_exportable(model)
    tokenizer, config = _tokenizer_of(tokenizer), model.config
    wordpiece = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["type"] == "WordPiece"
    with staged_file(path) as staging:
        writer = gguf.GGUFWriter(staging, ARCHITECTURE)
        add_general_fields(writer, model)
        writer.add_context_length(context_length or config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_layer_norm_eps(config.layer_norm_eps)
        writer.add_causal_attention(False)
        writer.add_pooling_type(gguf.PoolingType.MEAN)  # jina-embeddings-v2's own pooling
        writer.add_max_alibi_bias(8.0)  # the paper's slopes, which llama.cpp computes from it
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        if wordpiece:
            _add_wordpiece(writer, tokenizer, config.vocab_size)
        else:
            _add_tokenizer(writer, tokenizer, config.vocab_size)
        writer.add_token_type_count(config.type_vocab_size)
        write_out(writer, encoder_gguf_tensors(model))
    return path
