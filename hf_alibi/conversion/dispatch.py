"""One entry point each way: `convert` (GPT-2, BLOOM, MPT, Falcon-RW, Jais, BTLM, Baichuan -> ALiBi GPT-2) and
`export` (-> BLOOM, MPT, Jais, BTLM, Baichuan, GGUF).

    import hf_alibi
    model = hf_alibi.convert("bigscience/bloom-560m")      # object, folder or Hub id; family read from model_type
    hf_alibi.convert("bigscience/bloom-560m", "bloom-alibi/")  # the same, written with its tokenizer
    model.config._attn_implementation                      # "sdpa": any length, no eager-only cap
    hf_alibi.export(model, "bloom", "bloom-again/")         # folder BloomForCausalLM loads
    hf_alibi.export(model, "gguf", "model.gguf", tokenizer=tokenizer)  # needs a tanh-GELU model (not BLOOM's norm)
    hf_alibi.convert("inceptionai/jais-family-590m", "jais-alibi/")  # remote-code checkpoints: read from their files
    hf_alibi.convert("baichuan-inc/Baichuan2-13B-Base", "baichuan-alibi/")  # the same, RMSNorm and NormHead folded
    hf_alibi.convert("jinaai/jina-embeddings-v2-small-en", "jina/")  # ALiBi encoders -> ALiBi BERT (encoder_files)
    hf_alibi.export("jina/", "mosaic", "mosaic/")                    # -> their layouts: jina(_code), mosaic, gguf

The same from the shell: `hf-alibi convert SRC DST`, `hf-alibi export SRC DST --to {bloom,mpt,jais,btlm,baichuan,gguf}`
(an ALiBi BERT folder: `--to {jina,jina_code,mosaic,gguf}`).

Remote-code families (their modeling code ships with their checkpoints) are each one record (`RemoteCodeFamily`, in
their own module) listed in `REMOTE_CODE`: their model types, layouts, names and both directions come from it.
"""

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from transformers import (
    BloomForCausalLM,
    FalconForCausalLM,
    GenerationConfig,
    GPT2LMHeadModel,
    MptForCausalLM,
    PreTrainedModel,
)

from ..models.alibi.configuration_alibi_gpt2 import AlibiGPT2Config
from ..models.alibi.modeling_alibi_gpt2 import AlibiGPT2LMHeadModel
from .baichuan import BAICHUAN
from .bloom import check_bloom_exportable, convert_bloom, export_bloom
from .common import check_destination, load_config, load_tokenizer, source_config, write_folder_atomically
from .encoder_files import (
    ENCODER_LAYOUTS,
    ENCODER_MODEL_TYPES,
    GGUF_LAYOUT,
    export_encoder_folder,
    import_encoder,
)
from .encoder_gguf import ARCHITECTURE as ENCODER_GGUF_ARCHITECTURE
from .encoders import SHORT_NAMES as ENCODER_LAYOUT_NAMES
from .falcon import convert_falcon
from .gguf_export import ARCHITECTURES as GPT2_GGUF_ARCHITECTURES
from .gguf_export import check_gguf_exportable, write_gguf
from .gpt2 import convert_gpt2
from .jais import JAIS
from .mpt import check_mpt_exportable, convert_mpt, export_mpt
from .remote_code import (
    SERVED_LENGTH,
    Checkpoint,
    RemoteCodeFamily,
    checkpoint_of_model,
    copy_tokenizer_files,
    read_checkpoint,
    source_folder,
)


class Family(NamedTuple):
    """A family transformers itself models: the class that loads its checkpoints, its import, what it is called."""

    loader: type[PreTrainedModel]
    convert: Callable[[PreTrainedModel], AlibiGPT2LMHeadModel]
    name: str  # what `hf-alibi convert --help` calls it


# model_type -> its family
FAMILIES = {
    "gpt2": Family(GPT2LMHeadModel, convert_gpt2, "GPT-2"),
    "bloom": Family(BloomForCausalLM, convert_bloom, "BLOOM"),
    "mpt": Family(MptForCausalLM, convert_mpt, "MPT"),
    "falcon": Family(FalconForCausalLM, convert_falcon, "Falcon-RW"),
}
# The families whose modeling code ships with their checkpoints, read from their files (no code run): one record each
REMOTE_CODE = (JAIS, BAICHUAN)
# model_type (and export layout) -> its family's record
REMOTE_CODE_FAMILIES: dict[str, RemoteCodeFamily] = {name: family for family in REMOTE_CODE for name in family.names}
EXACT_FAMILIES = ("bloom", "mpt", "falcon", *REMOTE_CODE_FAMILIES)  # imported without any change of function
# layout -> check(config, max_seq_len) raising ValueError naming what the layout cannot hold
EXPORTABLE = {
    "bloom": lambda config, max_seq_len: check_bloom_exportable(config),
    "mpt": check_mpt_exportable,
    **{name: family.check_exportable for name, family in REMOTE_CODE_FAMILIES.items()},
    GGUF_LAYOUT: lambda config, max_seq_len: check_gguf_exportable(config),
}
# The name lists the CLI (choices, help) and the docs' tests read: all derived from the records above, so a new
# family is one record. model_type -> what `hf-alibi convert` calls it (transformers' families, then remote code's)
NAMES = {
    **{model_type: family.name for model_type, family in FAMILIES.items()},
    **{model_type: name for family in REMOTE_CODE for model_type, name in family.names.items()},
}
FAMILY_NAMES = tuple(dict.fromkeys(NAMES.values()))  # GPT-2, BLOOM, MPT, Falcon-RW, Jais, BTLM, Baichuan
ENCODER_NAMES = tuple(dict.fromkeys(ENCODER_LAYOUT_NAMES.values()))  # the encoders' layouts, by name (Jina, MosaicBERT)
GGUF_NAME = "GGUF"
GPT2_LAYOUTS = tuple(EXPORTABLE)  # an ALiBi GPT-2 folder exports to these
LAYOUTS = tuple(dict.fromkeys([*GPT2_LAYOUTS, *ENCODER_LAYOUTS]))  # ALiBi GPT-2's, then ALiBi BERT's (gguf: both)
# layout -> what `hf-alibi export --help` calls it
LAYOUT_NAMES = {layout: {**NAMES, **ENCODER_LAYOUT_NAMES, GGUF_LAYOUT: GGUF_NAME}[layout] for layout in LAYOUTS}
# layout -> what `export --max-seq-len` sets in it (the layouts that take one)
MAX_SEQ_LEN = {
    "mpt": SERVED_LENGTH,
    **{model_type: family.max_seq_len for model_type, family in REMOTE_CODE_FAMILIES.items()},
    GGUF_LAYOUT: "the context length recorded",
}
GGUF_ARCHITECTURES = (*GPT2_GGUF_ARCHITECTURES, ENCODER_GGUF_ARCHITECTURE)  # llama.cpp's, in what `gguf` writes


def spoken(names, conjunction: str = "or") -> str:
    """A name list as help texts say it: `a, b or c` (`conjunction="and"`: `a, b and c`)."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


SENTENCEPIECE_MODEL = "tokenizer.model"  # Baichuan's tokenizer: copied beside the tokenizer a convert writes


def load_source(source: PreTrainedModel | str | os.PathLike) -> PreTrainedModel:
    """`source` itself if it is a model, else the checkpoint at that folder or Hub id, in its saved dtype.

    Refuses checkpoints with weights the transformers class would drop (e.g. MPT's learned position embeddings or
    biases under `no_bias=False`, which transformers' MPT ignores) or would leave random: such a load is not exact.
    """
    if isinstance(source, PreTrainedModel):
        return source
    model_type = load_config(source).model_type
    if model_type not in FAMILIES:
        raise ValueError(f"{source}: cannot import model_type {model_type!r}: hf_alibi imports {sorted(FAMILIES)}")
    model, info = FAMILIES[model_type][0].from_pretrained(source, dtype="auto", output_loading_info=True)
    if info["unexpected_keys"] or info["missing_keys"]:
        raise ValueError(
            f"{source}: transformers' {model_type} class would drop weights {sorted(info['unexpected_keys'])} and "
            f"leave {sorted(info['missing_keys'])} random (e.g. learned_pos_emb or no_bias=False in MPT): "
            "the checkpoint cannot be imported exactly"
        )
    return model.eval()


def convert(
    source: PreTrainedModel | str | os.PathLike,
    destination: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    **gpt2_alibi_kwargs,
) -> AlibiGPT2LMHeadModel | Path:
    """Import a GPT-2, BLOOM, MPT, Falcon-RW, Jais, BTLM or Baichuan model (object, folder or Hub id) into an
    `AlibiGPT2LMHeadModel`.

    Without `destination`, returns the model. With one, writes it atomically (a folder that is absent or empty) with
    its generation config and `tokenizer` (default: the one saved at `source`, if any; a Jais or BTLM checkpoint's
    tokenizer files are copied unchanged, Baichuan's SentencePiece model is read into a tokenizer transformers loads
    alone) and returns the path. BLOOM, MPT, Falcon-RW, Jais, BTLM and Baichuan imports are exact (same function; see
    each family's module); the remote-code families are read from their files, their code never runs.
    GPT-2 loses its position embeddings: `gpt2_alibi_kwargs` (e.g. `alibi_max_bias`) choose its slopes, and it warns
    that it must be fine-tuned. Raises `ValueError` naming any field of the source that ALiBi GPT-2 cannot hold exactly.
    A `bert`-typed (or untyped) source is an ALiBi encoder (jina-embeddings-v2, jina-reranker-v1, MosaicBERT,
    DNABERT-2): imported exactly into ALiBi BERT by `encoder_files.import_encoder`, or refused by name.
    """
    if destination is not None:  # refused before the (possibly long) load
        check_destination(destination)
    config = source.config.to_dict() if isinstance(source, PreTrainedModel) else source_config(source)
    model_type = config.get("model_type")
    known = sorted([*FAMILIES, *REMOTE_CODE_FAMILIES, "bert"])
    if model_type not in known and model_type not in ENCODER_MODEL_TYPES:
        raise ValueError(f"{source}: cannot import model_type {model_type!r}: hf_alibi imports {known}")
    if model_type != "gpt2" and gpt2_alibi_kwargs:
        raise ValueError(
            f"{model_type} imports copy the checkpoint's own slopes; ALiBi settings {sorted(gpt2_alibi_kwargs)} apply "
            "to GPT-2 only"
        )
    if model_type in ENCODER_MODEL_TYPES:  # jina-embeddings-v2, jina-reranker-v1, MosaicBERT, DNABERT-2
        return import_encoder(source, destination, tokenizer=tokenizer)
    if model_type in REMOTE_CODE_FAMILIES:
        return _convert_remote_code(source, config, REMOTE_CODE_FAMILIES[model_type], destination, tokenizer)
    if gpt2_alibi_kwargs:
        AlibiGPT2Config(**gpt2_alibi_kwargs)  # bad values fail before the checkpoint loads
    converted = FAMILIES[model_type][1](load_source(source), **gpt2_alibi_kwargs)
    if destination is None:
        return converted
    if tokenizer is None and not isinstance(source, PreTrainedModel):
        tokenizer = load_tokenizer(source)
    return save_folder(converted, tokenizer, destination)


def _convert_remote_code(source, config: dict, family: RemoteCodeFamily, destination, tokenizer):
    """`convert` for a remote-code family: its config checked before any weight is read, its tokenizer read by the
    family (or, without a reader, its files copied) before its weights too, its generation config kept."""
    if family.check_config is not None:
        family.check_config(config)  # e.g. Baichuan-7B (rotary) before 14 GB of its weights are downloaded
    folder = None if isinstance(source, PreTrainedModel) else source_folder(source)
    if destination is not None and tokenizer is None and folder is not None and family.read_tokenizer is not None:
        tokenizer = family.read_tokenizer(folder)  # a missing extra fails here, not after the weights
    checkpoint = checkpoint_of_model(source) if folder is None else read_checkpoint(folder)
    converted = family.convert(checkpoint)
    if folder is not None and (folder / "generation_config.json").is_file():
        converted.generation_config = GenerationConfig.from_pretrained(folder)
    if destination is None:
        return converted
    return save_folder(converted, tokenizer, destination, tokenizer_files=folder)


def export(
    model: AlibiGPT2LMHeadModel | str | os.PathLike,
    layout: str,
    destination: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    max_seq_len: int | None = None,
):
    """Export an ALiBi GPT-2 model to `layout`: "bloom", "mpt" (transformers/vLLM/TGI), "jais", "btlm", "baichuan"
    (their remote-code layouts; Baichuan's is also what llama.cpp's converter reads) or "gguf" (llama.cpp).

    Without `destination`, returns the `BloomForCausalLM` / `MptForCausalLM`, or for a remote-code layout a
    `Checkpoint` (their config dict and state dict). With one, writes it atomically (a folder with the tokenizer, or one `.gguf`
    file, which needs the tokenizer) and returns the path. `max_seq_len`: MPT's serving length (its loaders refuse
    longer inputs), Jais's and BTLM's `n_positions` (the same) or the gguf's context length; default `n_positions`.
    A layout that cannot hold the model exactly raises `ValueError` naming the config field; nothing is written.
    An ALiBi BERT model goes to "jina", "jina_code" (base-code's), "mosaic" (their remote-code layouts) or "gguf"
    (`jina-bert-v2`) instead (`encoder_files.export_encoder_folder`).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "bloom" and max_seq_len is not None:
        raise ValueError(
            f"max_seq_len={max_seq_len} applies to the mpt, jais, btlm and gguf layouts; BLOOM has no length cap"
        )
    if layout == "gguf" and destination is None:
        raise ValueError("a gguf export writes a file: pass destination='model.gguf'")
    if destination is not None:  # refused before the model loads
        check_destination(destination, file_suffix=".gguf" if layout == "gguf" else None)
    config = model.config if isinstance(model, PreTrainedModel) else load_config(model)
    if config.model_type == "alibi_bert":
        return export_encoder_folder(model, layout, destination, tokenizer=tokenizer, max_seq_len=max_seq_len)
    if config.model_type != "alibi_gpt2":
        raise ValueError(
            f"export expects an ALiBi GPT-2 or ALiBi BERT model, got model_type={config.model_type!r} ({model})"
        )
    if layout not in EXPORTABLE:
        raise ValueError(f"an ALiBi GPT-2 model exports to {tuple(EXPORTABLE)}, got layout={layout!r}")
    EXPORTABLE[layout](config, max_seq_len)  # a refusal comes before the weights load
    model_folder = None
    if not isinstance(model, PreTrainedModel):
        model_folder = Path(model)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
        model = AlibiGPT2LMHeadModel.from_pretrained(model, dtype="auto").eval()
    if layout == "gguf":
        return write_gguf(model, destination, tokenizer, context_length=max_seq_len)
    family = REMOTE_CODE_FAMILIES.get(layout)
    if family is not None:
        exported = family.export(model, layout, max_seq_len)
        if destination is None:
            return exported
        return save_checkpoint(exported, model, tokenizer, destination, family, model_folder)
    exported = export_bloom(model) if layout == "bloom" else export_mpt(model, max_seq_len)
    return exported if destination is None else save_folder(exported, tokenizer, destination)


def save_folder(
    model: PreTrainedModel, tokenizer, destination: str | os.PathLike, tokenizer_files: Path | None = None
) -> Path:
    """`model` (with its generation config) and `tokenizer`, if not None, saved to the folder `destination`,
    atomically: a failure leaves nothing there. Without a `tokenizer`, the tokenizer files of the folder
    `tokenizer_files` (if any) are copied unchanged; with one, a SentencePiece `tokenizer.model` there is copied
    beside the tokenizer's own files (it is what an export to the source's layout writes back)."""

    def write(folder: Path) -> None:
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
            sentencepiece = None if tokenizer_files is None else tokenizer_files / SENTENCEPIECE_MODEL
            if sentencepiece is not None and sentencepiece.is_file() and not (folder / SENTENCEPIECE_MODEL).exists():
                (folder / SENTENCEPIECE_MODEL).write_bytes(sentencepiece.read_bytes())
        else:
            copy_tokenizer_files(tokenizer_files, folder)

    return write_folder_atomically(destination, write)


def save_checkpoint(
    checkpoint: Checkpoint,
    model: PreTrainedModel,
    tokenizer,
    destination: str | os.PathLike,
    family: RemoteCodeFamily,
    model_folder: Path | None = None,
) -> Path:
    """A remote-code `checkpoint` as their folders hold one (config.json, safetensors, `model`'s generation config,
    `tokenizer` as the family writes it; `model_folder`: the ALiBi GPT-2 folder exported, if any), atomically."""
    from huggingface_hub import save_torch_state_dict

    def write(folder: Path) -> None:
        (folder / "config.json").write_text(json.dumps(checkpoint.config, indent=2, sort_keys=True) + "\n")
        save_torch_state_dict(checkpoint.state_dict, folder)
        model.generation_config.save_pretrained(folder)
        if family.write_tokenizer is not None:
            family.write_tokenizer(tokenizer, folder, model_folder)
        elif tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return write_folder_atomically(destination, write)
