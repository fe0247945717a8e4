"""Conversions into ALiBi GPT-2 (GPT-2, BLOOM, MPT, Falcon-RW, Jais, BTLM, Baichuan) and exports out of it (BLOOM, MPT,
Jais, BTLM, Baichuan, GGUF); into ALiBi BERT (jina-embeddings-v2, jina-reranker-v1, MosaicBERT, DNABERT-2) and back out (their
layouts, GGUF `jina-bert-v2`).

Not shipped with checkpoints. `convert` and `export` (in `dispatch`) pick the family module by `model_type`; each
family's weights are one table (`weight_map`) applied both ways, its refusals another (`common.Requirement`); a
remote-code family is one record (`remote_code.RemoteCodeFamily`) that `dispatch.REMOTE_CODE` lists.
"""

from .baichuan import convert_baichuan, export_baichuan
from .bloom import convert_bloom, export_bloom
from .dispatch import EXACT_FAMILIES, FAMILIES, LAYOUTS, convert, export, load_source
from .encoder_files import write_sentence_transformers_files
from .encoders import convert_encoder, export_encoder
from .falcon import convert_falcon
from .gguf_export import write_gguf
from .gpt2 import alibi_config_from_gpt2, convert_gpt2
from .jais import convert_cerebras, export_cerebras
from .mpt import convert_mpt, export_mpt

__all__ = [
    "EXACT_FAMILIES",
    "FAMILIES",
    "LAYOUTS",
    "alibi_config_from_gpt2",
    "convert",
    "convert_baichuan",
    "convert_cerebras",
    "convert_bloom",
    "convert_encoder",
    "convert_falcon",
    "convert_gpt2",
    "convert_mpt",
    "export",
    "export_baichuan",
    "export_cerebras",
    "export_bloom",
    "export_encoder",
    "export_mpt",
    "load_source",
    "write_gguf",
    "write_sentence_transformers_files",
]
