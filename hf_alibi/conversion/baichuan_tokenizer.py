"""Baichuan's tokenizer without its remote class: their `tokenizer.model` (SentencePiece BPE with byte fallback) read
into a transformers tokenizer that loads alone, and written back as their folders hold it.

Their `BaichuanTokenizer` no longer loads on transformers >= 4.34 (its `__init__` asks for the vocabulary before it has
loaded it). What it computes is small: `[bos] * add_bos_token + sp.encode(text) + [eos] * add_eos_token`, special
tokens in the text taken whole, `sp.decode` back; `add_bos_token` defaults to True and `add_eos_token` to False when
their tokenizer_config.json does not say. The import builds transformers' own tokenizer from the SentencePiece model
(`TokenizersBackend`, which reads the model's normaliser settings: dummy prefix, whitespace) with those settings, and
refuses it unless it encodes a set of probe texts exactly as SentencePiece itself does. The converted folder holds its
`tokenizer.json` (loaded without sentencepiece) and `tokenizer.model` unchanged, which the export writes back with
their tokenizer_config.json. Reading needs `sentencepiece` and `protobuf` (`pip install 'hf_alibi[sentencepiece]'`).
"""

import json
import shutil
import tempfile
from pathlib import Path

from ..import_utils import require_extra

MODEL_FILE = "tokenizer.model"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Text the built tokenizer must encode as SentencePiece does: Chinese, English, digits (split one by one in Baichuan's
# model), runs of spaces, tabs and newlines, characters only byte fallback covers
PROBES = (
    "百川大模型 Baichuan is a large language model.",
    "  two  spaces,\ttabs\nand newlines\n\n",
    "Prices rose 12.5% in 2023: 1234567890",
    "ünïcödé 𝔘 emoji 🙂 中文和English混合",
)


def _content(token) -> str | None:
    """A special token as their tokenizer_config.json writes it (a string, or an AddedToken dict) -> its text."""
    return token.get("content") if isinstance(token, dict) else token


def their_tokenizer_settings(folder: Path) -> dict:
    """What their tokenizer_config.json sets (their class's defaults otherwise): special tokens, `add_bos_token`,
    `add_eos_token`, `model_max_length`, `clean_up_tokenization_spaces`."""
    path = folder / "tokenizer_config.json"
    theirs = json.loads(path.read_text()) if path.is_file() else {}
    settings = {"add_bos_token": theirs.get("add_bos_token", True), "add_eos_token": theirs.get("add_eos_token", False)}
    settings["clean_up_tokenization_spaces"] = theirs.get("clean_up_tokenization_spaces", False)
    defaults = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None}
    settings |= {name: _content(theirs.get(name, defaults[name])) for name in SPECIAL_TOKENS}
    if isinstance(theirs.get("model_max_length"), int):
        settings["model_max_length"] = theirs["model_max_length"]
    return settings


def read_baichuan_tokenizer(folder: Path):
    """A transformers tokenizer (`TokenizersBackend`) encoding and decoding as their `BaichuanTokenizer` does, from
    the SentencePiece `tokenizer.model` and tokenizer_config.json of their `folder`; None without a tokenizer.model.
    `ValueError` when the built tokenizer encodes a probe text differently from SentencePiece."""
    if not (folder / MODEL_FILE).is_file():
        return None
    require_extra("sentencepiece", f"reading Baichuan's {MODEL_FILE}")
    import sentencepiece
    from transformers import TokenizersBackend

    settings = their_tokenizer_settings(folder)
    with tempfile.TemporaryDirectory() as scratch:  # their folder's tokenizer_config.json names their remote class
        shutil.copyfile(folder / MODEL_FILE, Path(scratch) / MODEL_FILE)
        tokenizer = TokenizersBackend.from_pretrained(scratch, **settings)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / MODEL_FILE))
    for text in PROBES:
        ours, theirs = tokenizer(text, add_special_tokens=False)["input_ids"], processor.encode(text)
        if ours != theirs:
            raise ValueError(
                f"{folder / MODEL_FILE}: the tokenizer transformers builds from it encodes {text!r} as {ours}, "
                f"SentencePiece as {theirs}: it cannot stand in for their tokenizer"
            )
    return tokenizer


def _adds(tokenizer, token_id: int | None, first: bool) -> bool:
    """Whether `tokenizer` puts `token_id` first (or last) in every encoding: read from the empty text's."""
    ids = tokenizer("")["input_ids"]
    return token_id is not None and bool(ids) and ids[0 if first else -1] == token_id


def write_baichuan_tokenizer(tokenizer, folder: Path, model_folder: Path | None) -> None:
    """Their tokenizer files in `folder`: `tokenizer.model` (from the ALiBi GPT-2 folder exported, or the file
    `tokenizer` was read from) and a tokenizer_config.json naming their class with `tokenizer`'s special tokens and
    whether it adds bos/eos. Nothing without a tokenizer; `ValueError` when no tokenizer.model is at hand."""
    if tokenizer is None:
        return
    sources = [model_folder / MODEL_FILE] if model_folder is not None else []
    vocab_file = getattr(tokenizer, "vocab_file", None)
    sources += [Path(vocab_file)] if isinstance(vocab_file, str) and vocab_file.endswith(".model") else []
    model_file = next((path for path in sources if path.is_file()), None)
    if model_file is None:
        raise ValueError(
            f"the Baichuan layout's tokenizer is a SentencePiece {MODEL_FILE}, which the tokenizer given does not "
            "come with: export the converted folder, which keeps it"
        )
    shutil.copyfile(model_file, folder / MODEL_FILE)
    specials = {name: getattr(tokenizer, name, None) for name in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "BaichuanTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_baichuan.BaichuanTokenizer", None]},
        "add_bos_token": _adds(tokenizer, tokenizer.bos_token_id, first=True),
        "add_eos_token": _adds(tokenizer, tokenizer.eos_token_id, first=False),
        "clean_up_tokenization_spaces": False,
        "sp_model_kwargs": {},
        **{name: str(token) for name, token in specials.items() if token is not None},
    }
    if tokenizer.model_max_length < 1e9:  # transformers' "no limit" is a huge number
        config["model_max_length"] = tokenizer.model_max_length
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {name: str(token) for name, token in specials.items() if token is not None}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
