"""ALiBi encoders on disk: an imported checkpoint's folder (model, tokenizer files as shipped, sentence-transformers
modules for an embedding model) and the folders of an export back to their layouts.

    hf-alibi convert jinaai/jina-embeddings-v2-small-en jina-small/    # AlibiBertModel + modules.json & co
    SentenceTransformer("jina-small/")                                  # Transformer -> Pooling (mean)
    hf-alibi export jina-small/ back/ --to jina                         # their layout again (or --to mosaic, gguf)

sentence-transformers reads `modules.json` (Transformer -> Pooling mean [-> Normalize]), `sentence_bert_config.json`
(`max_seq_length`) and `1_Pooling/config.json`, in the format every release since 2.x loads; the Transformer module
builds the model through `AutoConfig`/`AutoModel`, which find `alibi_bert` once hf_alibi is imported, or through the
code the folder ships with `trust_remote_code=True`.
"""

import json
import os
from pathlib import Path

from transformers import PreTrainedModel

from .._transformers_compat import named_tokenizer_inputs
from .common import check_destination, write_folder_atomically
from .encoders import HEADS, LAYOUTS, convert_encoder, encoder_family, export_encoder
from .remote_code import (
    Checkpoint,
    checkpoint_of_model,
    copy_tokenizer_files,
    read_config,
    read_state_dict,
    source_folder,
)

ENCODER_MODEL_TYPES = ("bert", None)  # jina-embeddings-v2, jina-reranker-v1, MosaicBERT; DNABERT-2 names none
# What `hf-alibi convert` imports as ALiBi BERT, by the names their checkpoints go by (the CLI's help reads these)
ENCODER_SOURCES = ("jina-embeddings-v2", "jina-reranker-v1", "MosaicBERT", "DNABERT-2")
GGUF_LAYOUT = "gguf"  # one llama.cpp file: ALiBi GPT-2's and ALiBi BERT's both
ENCODER_LAYOUTS = (*LAYOUTS, GGUF_LAYOUT)  # their folders' layouts (`encoders`), then GGUF
_NORMALIZE = "sentence_transformers.models.Normalize"


def sentence_transformers_modules(normalize: bool) -> list[dict]:
    """`modules.json`: the Transformer at the folder's root, mean pooling, and a Normalize where the source has one."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _NORMALIZE})
    return modules


def write_sentence_transformers_files(
    folder: str | os.PathLike, config, *, normalize: bool = False, max_seq_length: int | None = None
) -> Path:
    """Make the saved embedding model at `folder` a sentence-transformers model: mean pooling over the real tokens
    (what jina-embeddings-v2's `encode` computes), `normalize` adding a unit-length Normalize, `max_seq_length`
    (default: the config's `max_position_embeddings`, 8192 for Jina) the length its tokenizer truncates to."""
    folder = Path(folder)
    max_seq_length = config.max_position_embeddings if max_seq_length is None else max_seq_length
    files = {
        "modules.json": sentence_transformers_modules(normalize),
        "sentence_bert_config.json": {"max_seq_length": max_seq_length, "do_lower_case": False},
        "1_Pooling/config.json": {
            "word_embedding_dimension": config.hidden_size,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
        },
    }
    if normalize:
        files["2_Normalize/config.json"] = {}
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")
    return folder


def source_sentence_settings(folder: Path | None) -> dict:
    """What the source's own sentence-transformers files say: `normalize` (a Normalize module in its modules.json)
    and `max_seq_length` (its sentence_bert_config.json); `{}` where it ships none."""
    if folder is None:
        return {}
    settings = {}
    if (folder / "modules.json").is_file():
        types = [module.get("type", "") for module in json.loads((folder / "modules.json").read_text())]
        settings["normalize"] = any(kind.endswith("Normalize") for kind in types)
    if (folder / "sentence_bert_config.json").is_file():
        length = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length")
        if length is not None:
            settings["max_seq_length"] = length
    return settings


def import_encoder(source, destination: str | os.PathLike | None = None, *, tokenizer=None):
    """The `AlibiBert*` model of the ALiBi encoder checkpoint `source` (a loaded remote-code model, a folder or a
    Hub id); with `destination`, saved there atomically with `tokenizer` (default: the source's tokenizer files, as
    shipped, tokenizer_config.json listing its inputs: `list_tokenizer_inputs`) and, for an embedding model, the sentence-transformers files (the source's Normalize and max_seq_length
    kept), and the path returned."""
    checkpoint = checkpoint_of_model(source) if isinstance(source, PreTrainedModel) else read_encoder_checkpoint(source)
    model = convert_encoder(checkpoint)
    if destination is None:
        return model
    sentence = source_sentence_settings(checkpoint.folder)

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        else:
            copy_tokenizer_files(checkpoint.folder, folder)
        list_tokenizer_inputs(folder)
        if HEADS[type(model).__name__] == "base":
            write_sentence_transformers_files(folder, model.config, **sentence)

    return write_folder_atomically(destination, write)


def list_tokenizer_inputs(folder: Path) -> None:
    """Write into `folder`'s tokenizer_config.json the inputs of the tokenizer class it names, unless it lists them:
    transformers 5.0-5.2 load any tokenizer of an `alibi_bert` folder as their generic one, which gives no
    token_type_ids, and a reranker scores a pair by them (`_transformers_compat.named_tokenizer_inputs`)."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    tokenizer_config = json.loads(path.read_text())
    names = named_tokenizer_inputs(tokenizer_config)
    if names is not None:
        path.write_text(
            json.dumps({**tokenizer_config, "model_input_names": names}, indent=2, ensure_ascii=False) + "\n"
        )


def read_encoder_checkpoint(source: str | os.PathLike) -> Checkpoint:
    """The config and weights of the folder or Hub id `source`; where the weights are missing, a config that shows no
    sign of ALiBi is refused as such first (it names the model type, not a missing file)."""
    folder = source_folder(source)
    config = read_config(folder)
    try:
        state = read_state_dict(folder)
    except ValueError:
        encoder_family(config, ())
        raise
    return Checkpoint(config, state, folder)


def load_alibi_bert(source: str | os.PathLike):
    """The `AlibiBert*` model saved at the folder `source`, of the class its config's `architectures` names."""
    from transformers import PretrainedConfig

    from ..models.alibi import modeling_alibi_bert

    architectures = PretrainedConfig.get_config_dict(source)[0].get("architectures") or ["AlibiBertModel"]
    if architectures[0] not in HEADS:
        raise ValueError(f"{source}: architectures {architectures} names no ALiBi BERT class ({sorted(HEADS)})")
    return getattr(modeling_alibi_bert, architectures[0]).from_pretrained(source, dtype="auto").eval()


def export_encoder_folder(model, layout: str, destination=None, *, tokenizer=None, max_seq_len: int | None = None):
    """`export` for an ALiBi BERT model (object or folder): a `Checkpoint` of their layout, or with `destination` a
    folder (config.json, weights as their code reads them, tokenizer) or, for "gguf", one llama.cpp file."""
    if layout not in ENCODER_LAYOUTS:
        raise ValueError(f"an ALiBi BERT model exports to {ENCODER_LAYOUTS}, got layout={layout!r}")
    if layout == "gguf" and destination is None:
        raise ValueError("a gguf export writes a file: pass destination='model.gguf'")
    if destination is not None:
        check_destination(destination, file_suffix=".gguf" if layout == "gguf" else None)
    folder = None if isinstance(model, PreTrainedModel) else Path(model)
    model = model if folder is None else load_alibi_bert(folder)
    if layout == "gguf":
        from .encoder_gguf import write_encoder_gguf

        return write_encoder_gguf(model, destination, tokenizer if tokenizer is not None else folder, max_seq_len)
    if max_seq_len is not None:
        raise ValueError(f"max_seq_len={max_seq_len} applies to the gguf layout; {layout}'s code has no length to set")
    exported = export_encoder(model, layout)
    return exported if destination is None else save_their_checkpoint(exported, layout, destination, tokenizer, folder)


def save_their_checkpoint(checkpoint: Checkpoint, layout: str, destination, tokenizer, tokenizer_files: Path | None):
    """`checkpoint` written as `layout`'s folders hold one (Jina: model.safetensors; MosaicBERT: pytorch_model.bin),
    with `tokenizer` (or the tokenizer files of `tokenizer_files` copied), atomically."""
    import torch
    from safetensors.torch import save_file

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(checkpoint.config, indent=2, sort_keys=True) + "\n")
        if layout == "mosaic":
            torch.save(checkpoint.state_dict, folder / "pytorch_model.bin")
        else:
            save_file(checkpoint.state_dict, folder / "model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        else:
            copy_tokenizer_files(tokenizer_files, folder)

    return write_folder_atomically(destination, write)
