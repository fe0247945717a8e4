"""Checkpoints whose modeling code ships beside them (`trust_remote_code`: Jais, BTLM, Baichuan), read from their
files alone, and the record (`RemoteCodeFamily`) that says all hf_alibi needs to know of one such family.

Their code does not import on transformers 5 (it imports removed pruning helpers and modules, or breaks in the
tokenizer and the cache), and running it would run whatever the folder holds: the import reads `config.json` as a
dict and the weights as tensors (pickles with `weights_only=True`), nothing else. A local folder or a Hub id (the
Hub's files go through the local cache; `HF_HUB_OFFLINE=1` reads only the cache).
"""

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .common import check_checkpoint_folder, check_hub_id

# What the checkpoints' tokenizers are made of; copied through byte for byte, as the checkpoints ship them
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",  # WordPiece (jina-embeddings-v2-base-en, MosaicBERT)
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",  # SentencePiece (Baichuan): what their tokenizer class and llama.cpp's converter read
)
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")
# An embedding model's sentence-transformers settings (its Normalize, its max_seq_length), kept by the encoder import
_SENTENCE_FILES = ("modules.json", "sentence_bert_config.json")


class Checkpoint(NamedTuple):
    """A checkpoint as its files hold it: the config dict, the state dict and the folder (None: built in memory)."""

    config: dict
    state_dict: dict[str, torch.Tensor]
    folder: Path | None = None


# What `export --max-seq-len` is for a layout whose loader refuses longer inputs (MPT, Jais, BTLM)
SERVED_LENGTH = "longest input served (their loaders refuse more)"


class RemoteCodeFamily(NamedTuple):
    """One family of remote-code checkpoints, whole: the model types it goes by, its import and export, and how its
    tokenizer crosses over. `dispatch` reads these records (for `convert`, `export`, the layouts and the names the CLI
    offers): a new family is its own module, which defines its record, and one entry in `dispatch.REMOTE_CODE`."""

    names: dict[str, str]  # each model_type its config.json says (also the name of its export layout) -> its name
    convert: Callable[[Checkpoint], Any]  # their files -> an ALiBi GPT-2 computing their function, or a ValueError
    export: Callable[[Any, str, int | None], Checkpoint]  # (ALiBi GPT-2, model_type, max_seq_len) -> their files
    check_exportable: Callable[[Any, int | None], object]  # (config, max_seq_len): a ValueError naming what their
    # layout cannot hold, before any weight loads
    check_config: Callable[[dict], None] | None = None  # a ValueError for a config.json it refuses, before the
    # weights are read (or downloaded)
    read_tokenizer: Callable[[Path], Any] | None = None  # their folder -> a tokenizer transformers loads without
    # their code (None when the folder has none); None: their tokenizer files are copied unchanged
    write_tokenizer: Callable[[Any, Path, Path | None], None] | None = None  # (tokenizer, folder being written, the
    # ALiBi GPT-2 folder exported or None) -> their tokenizer files; None: `tokenizer.save_pretrained(folder)`
    max_seq_len: str = SERVED_LENGTH  # what `export --max-seq-len` sets in
    # their layout (`hf-alibi export --help` reads it); SERVED_LENGTH below


def source_folder(source: str | os.PathLike) -> Path:
    """The local folder of `source`: itself, or the Hub id's snapshot of config, weights, tokenizer and generation
    config (downloaded into the Hub cache, or read from it offline); `ValueError` naming `source` otherwise."""
    path = Path(source)
    if path.exists():
        check_checkpoint_folder(path)
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    check_hub_id(source)  # no valid id, or no Hub to ask and not cached: at once, not after the client's retries
    patterns = ["config.json", "generation_config.json", *TOKENIZER_FILES, *_WEIGHT_PATTERNS, *_SENTENCE_FILES]
    try:
        return Path(snapshot_download(str(source), allow_patterns=patterns))
    except (HFValidationError, OSError) as exc:  # the hub's errors for unknown ids, offline misses, no network
        raise ValueError(f"{str(source)!r}: no such folder, and no model of that id on the Hub or its cache") from exc


def read_config(source: str | os.PathLike) -> dict:
    """`config.json` of the folder or Hub id `source`, as a dict (no config class: its model_type may be unknown)."""
    path = source_folder(source) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable config.json ({exc})") from exc


def _weight_files(folder: Path) -> list[Path]:
    """The weight files of `folder`: the shards an index names, else the single file; safetensors first."""
    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = folder / index_name
        if index.is_file():
            return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        if (folder / single).is_file():
            return [folder / single]
    raise ValueError(f"{folder} has no model.safetensors or pytorch_model.bin (nor a sharded index of either)")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `folder`, as saved (dtype included); pickled `.bin` files are read with
    `weights_only=True` (tensors only, no code)."""
    from safetensors.torch import load_file

    state = {}
    for file in _weight_files(folder):
        try:
            part = load_file(file) if file.suffix == ".safetensors" else torch.load(file, "cpu", weights_only=True)
        except pickle.UnpicklingError as exc:  # weights_only refuses any object but tensors and plain containers
            raise ValueError(f"{file}: not a plain pickle of tensors, so it is not read ({exc})") from None
        twice = sorted(set(part) & set(state))
        if twice:
            raise ValueError(f"{file}: tensors {twice} are also in another shard")
        state.update(part)
    return state


def read_checkpoint(source: str | os.PathLike) -> Checkpoint:
    """The config dict and the state dict of the folder or Hub id `source`."""
    folder = source_folder(source)
    return Checkpoint(read_config(folder), read_state_dict(folder), folder)


def checkpoint_of_model(model) -> Checkpoint:
    """A remote-code model object already loaded (on a transformers its code still imports on): config and weights."""
    return Checkpoint(model.config.to_dict(), dict(model.state_dict()), None)


def copy_tokenizer_files(source_folder_: Path | None, destination: Path) -> list[str]:
    """Copy the tokenizer files of `source_folder_` into `destination` unchanged; the names copied."""
    if source_folder_ is None:
        return []
    copied = []
    for name in TOKENIZER_FILES:
        if (source_folder_ / name).is_file():
            (destination / name).write_bytes((source_folder_ / name).read_bytes())
            copied.append(name)
    return copied
