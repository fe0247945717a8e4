"""Optional dependencies: which install extra brings which packages, and one check that names the missing extra.

`pip install hf_alibi` is the model (torch, transformers, safetensors); `hf_alibi[experiments]` adds the
train-short/test-long experiment's packages, `hf_alibi[gguf]` the GGUF writer, `hf_alibi[sentencepiece]` what reads a
SentencePiece `tokenizer.model` (Baichuan's) into a transformers tokenizer, `hf_alibi[embeddings]`
sentence-transformers (to encode with an imported encoder), `hf_alibi[serve]` the packages of
transformers' OpenAI-compatible server (`hf-alibi serve`). The table below and pyproject's
`[project.optional-dependencies]` say the same (`tests/test_packaging.py` checks it in the built wheel).
"""

import importlib.util

# extra -> {module imported: distribution installed}
EXTRAS = {
    "experiments": {
        "datasets": "datasets",
        "evaluate": "evaluate",
        "accelerate": "accelerate",
        "matplotlib": "matplotlib",
        "yaml": "pyyaml",
    },
    "gguf": {"gguf": "gguf"},
    # reading a SentencePiece `tokenizer.model` (Baichuan's) into a transformers tokenizer: transformers' own converter
    "sentencepiece": {"sentencepiece": "sentencepiece", "google.protobuf": "protobuf"},
    # `SentenceTransformer(folder)` / `CrossEncoder(folder)` on an imported encoder (the files need nothing)
    "embeddings": {"sentence_transformers": "sentence-transformers"},
    # `hf-alibi serve` runs transformers' own server: its `serving` extra (transformers' is_serve_available)
    "serve": {module: "transformers[serving]" for module in ("fastapi", "uvicorn", "pydantic", "openai")},
}


def _installed(module: str) -> bool:
    """Whether `module` can be imported; a dotted name whose parent package is absent (`google.protobuf`) is not."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def missing_extra(extra: str, feature: str) -> str | None:
    """One line naming `feature`, the missing packages and `pip install 'hf_alibi[extra]'`; None when installed."""
    # dict.fromkeys: one distribution (transformers[serving]) may bring several of the modules
    missing = list(dict.fromkeys(d for module, d in EXTRAS[extra].items() if not _installed(module)))
    if not missing:
        return None
    return (
        f"{feature} needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: "
        f"pip install 'hf_alibi[{extra}]'"
    )


def require_extra(extra: str, feature: str) -> None:
    """Raise `ImportError` with `missing_extra`'s line when the extra's packages are missing."""
    message = missing_extra(extra, feature)
    if message is not None:
        raise ImportError(message)


__all__ = ["EXTRAS", "missing_extra", "require_extra"]
