"""ALiBi models, the GPT-2-style decoder (`*_alibi_gpt2.py`) and the jina-embeddings-v2 / MosaicBERT encoder
(`*_alibi_bert.py`), on one shared attention core: exactly the files `save_pretrained` copies into checkpoints (a
family's configuration and modeling, and all they import relatively: slopes, the attention plan and its paths,
certified skipping, continuous batching, the tensor-parallel styles), so one `ls` of this folder shows what a
checkpoint carries. Registration with the Auto classes lives in `hf_alibi/__init__.py`; conversion, the CLI and the
experiment live outside and import from here.
"""
