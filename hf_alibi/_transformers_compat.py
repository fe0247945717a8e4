"""Every private or version-dependent transformers name that hf_alibi uses outside the model folder, in one place.

hf_alibi supports transformers >= 5.0, < 6 (pyproject). A name that a release added, moved or changed is imported here
and nowhere else, with the releases it was checked against; `tests/test_transformers_surface.py` lists them. The model
folder that ships beside a checkpoint (`hf_alibi/models/alibi/`) has its own copy of this module
(`transformers_compat.py`), since remote code cannot import from the package.

A feature whose upstream piece is newer than the oldest supported release calls `require_transformers` once, at its
entry, and fails with one line naming the release it needs (never with a traceback from an import).
"""

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)
MINIMUM_TRANSFORMERS = "5.0"  # pyproject's lower bound


def transformers_at_least(minimum: str) -> bool:
    """Whether the installed transformers is `minimum` or newer (pre-releases of `minimum` count as `minimum`)."""
    return Version(TRANSFORMERS_VERSION.base_version) >= Version(minimum)


def require_transformers(minimum: str, feature: str) -> None:
    """`ImportError` with one line saying that `feature` needs transformers >= `minimum`, when it is older."""
    if not transformers_at_least(minimum):
        raise ImportError(
            f"{feature} needs transformers>={minimum}; this environment has {TRANSFORMERS_VERSION}: "
            f"pip install 'transformers>={minimum},<6'"
        )


# ---- conversion: each source family's own slopes, read from transformers' model files ------------------------------
# Not public API (functions inside `models/<family>/modeling_<family>.py`), the same in 4.57 and every 5.x to 5.25:
# `modeling_bloom.build_alibi_tensor(attention_mask, num_heads, dtype)` and `modeling_falcon.build_alibi_tensor` (the
# same signature; Falcon's rounds the slopes to bf16), `modeling_mpt.build_mpt_alibi_tensor(num_heads, sequence_length)`.
# Imported on call: each loads its model file.


def bloom_alibi_tensor(attention_mask, num_heads: int, dtype):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    return build_alibi_tensor(attention_mask, num_heads, dtype)


def falcon_alibi_tensor(attention_mask, num_heads: int, dtype):
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor

    return build_alibi_tensor(attention_mask, num_heads, dtype)


def mpt_alibi_tensor(num_heads: int, sequence_length: int):
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    return build_mpt_alibi_tensor(num_heads, sequence_length)


# ---- configs: the special token ids ----------------------------------------------------------------------------------
# 4.57's `PretrainedConfig.__init__` set `bos_token_id` / `eos_token_id` / `pad_token_id` (None by default) on every
# config; 5.0 moved them into each model's config class, and 5.0's `MptConfig` declares none (5.1+ does, None by
# default): on 5.0 an MPT config lacks them unless its config.json or caller gave them. Read here, as every other
# release reads them: None when absent.
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(config) -> dict:
    """`{"bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...}` of a transformers config, None where it has
    none (5.0's `MptConfig` may lack the attributes; 4.57 and 5.1+ give None)."""
    return {name: getattr(config, name, None) for name in SPECIAL_TOKEN_IDS}


# ---- GPT-NeoX's rotary share: the rotary baseline and its evaluation arms (experiments) ------------------------------
# `GPTNeoXConfig` holds the share of each head that rotary rotates as `rope_parameters["partial_rotary_factor"]`.
# 5.0-5.4 overwrite it on every construction (`from_pretrained` and `from_dict` too) with the legacy keyword
# `rotary_pct`, 0.25 when absent, and keep no `rotary_pct`: a config made, rebuilt from its `to_dict()` or saved and
# loaded with a share of 1.0 comes back at 0.25. 5.5+ keep the share given (checked on 5.5.4 through 5.25.0;
# `rotary_pct` only fills in a missing one). With `rotary_pct` given and kept as an attribute (so config.json holds
# it), every release reads the same share.


def config_from_dict(config_class, values: dict):
    """`config_class.from_dict(values)`; a GPT-NeoX config keeps the rotary share its `rope_parameters` give on every
    release, also once saved and loaded again or rebuilt from its own `to_dict()`."""
    share = (values.get("rope_parameters") or {}).get("partial_rotary_factor")
    if config_class.model_type != "gpt_neox" or share is None:
        return config_class.from_dict(values)
    config = config_class.from_dict({**values, "rotary_pct": share})
    config.rotary_pct = share  # 5.0-5.4 pop the keyword: the attribute is what reaches config.json
    return config


# ---- tokenizers: loading one, and what a folder of our model types says to AutoTokenizer -----------------------------
# `AutoTokenizer.from_pretrained` where no tokenizer can be built (a folder with a config and no vocabulary): 5.6+
# raise that error (a ValueError); 5.0-5.5 without protobuf raise an ImportError naming protobuf in its place (their
# `except import_protobuf_decode_error():` imports protobuf to name what it catches), the error itself kept as the
# ImportError's `__context__`.
TOKENIZER_ERRORS_UNMASKED = "5.6"


def auto_tokenizer(source, **kwargs):
    """`AutoTokenizer.from_pretrained(source, **kwargs)`, raising the error that failed it on every release (5.0-5.5
    without protobuf: the one the ImportError about protobuf hides)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except ImportError as error:
        hidden = error.__context__
        if transformers_at_least(TOKENIZER_ERRORS_UNMASKED) or "protobuf" not in str(error) or hidden is None:
            raise
        raise hidden from None


# 5.0-5.2: for a folder whose config.json names a model type with no tokenizer in transformers' table (alibi_gpt2,
# alibi_bert), AutoTokenizer ignores the `tokenizer_class` that tokenizer_config.json names and builds the generic
# `TokenizersBackend`, whose `model_input_names` are input_ids and attention_mask: a BERT tokenizer (a reranker's)
# then gives no token_type_ids, and a pair's second text is read as the first's. 5.3+ build the class named (checked
# on 5.3.0 through 5.25.0). A tokenizer_config.json that lists the inputs itself gives the same on every release.


def named_tokenizer_inputs(tokenizer_config: dict) -> list[str] | None:
    """The `model_input_names` of the tokenizer class `tokenizer_config` (a tokenizer_config.json) names, for it to
    list itself; None where it lists them already or names no class this transformers has."""
    name = tokenizer_config.get("tokenizer_class")
    if "model_input_names" in tokenizer_config or not isinstance(name, str):
        return None
    for candidate in (name, name.removesuffix("Fast")):
        try:
            tokenizer_class = getattr(transformers, candidate)
        except (AttributeError, ImportError):  # not a class of this release; a backend that is not installed
            continue
        names = getattr(tokenizer_class, "model_input_names", None)
        if isinstance(names, list | tuple):
            return list(names)
    return None


# ---- sharding: transformers' engine ----------------------------------------------------------------------------------
# `transformers.distributed.DistributedConfig` exists from 4.57, with `tp_size` / `fsdp_size` from 5.13 and exported at the top level
# from 5.16; hf_alibi shards from 5.24 (`TENSOR_PARALLEL_TRANSFORMERS`), checked before this import.


def distributed_config(**kwargs):
    from transformers.distributed import DistributedConfig

    return DistributedConfig(**kwargs)


# ---- serving: `hf-alibi serve` on transformers' OpenAI-compatible server (transformers.cli.serving) ----------------
# Those modules import fastapi, which only the `serve` extra installs: every name below is imported when its function
# is called, never when this module is. Written against 5.24.0 and 5.25.0.

SERVING_MINIMUM = "5.24"  # the first release whose server (`build_server`, its handlers) `hf-alibi serve` builds
SERVING_MODEL_PROCESS = "5.25"  # from 5.25 the server runs each model in a process of its own


def serving_model_in_own_process() -> bool:
    """5.24: the server loads and runs its model in its own process (`ModelManager`); 5.25+: in a process it spawns
    (`EngineClient`), which loads the model with a pickled copy of the server's `ModelLoader`."""
    return transformers_at_least(SERVING_MODEL_PROCESS)


def serving_handler_classes() -> dict:
    """5.24, 5.25: the handlers of /v1/chat/completions, /v1/completions, /v1/responses and /v1/systemone, each built
    as `Handler(model_manager=..., generation_state=...)`, each answering `await handle_request(body, request_id)`."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.systemone import SystemOneHandler

    return {
        "chat": ChatCompletionHandler,
        "completion": CompletionHandler,
        "response": ResponseHandler,
        "systemone": SystemOneHandler,
    }


def serving_generation_state(continuous_batching: bool, cb_config):
    """5.24, 5.25: `transformers.cli.serving.utils.GenerationState(continuous_batching=, cb_config=)`. 5.24: it runs
    the generation threads, continuous batching's from `cb_config`; 5.25+: settings the model's process reads."""
    from transformers.cli.serving.utils import GenerationState

    return GenerationState(continuous_batching=continuous_batching, cb_config=cb_config)


def serving_model_manager_class():
    """`transformers.cli.serving.model_manager.ModelManager`. 5.24: `ModelManager(device=, dtype=,
    attn_implementation=, continuous_batching=, force_model=)`, loading models in this process (`_load_model`);
    5.25+: `ModelManager(loader, generation_state, force_model=)`, each model in a process of its own."""
    from transformers.cli.serving.model_manager import ModelManager

    return ModelManager


def serving_model_loader_class():
    """5.25+: `transformers.cli.serving.model_manager.ModelLoader(device=, dtype=, attn_implementation=,
    continuous_batching=)`, whose `load_model_and_processor(model_id, on_progress=None)` the model's process calls
    (5.24 has none: `serving_model_manager_class` loads)."""
    require_transformers(SERVING_MODEL_PROCESS, "transformers' ModelLoader")
    from transformers.cli.serving.model_manager import ModelLoader

    return ModelLoader


def serving_model_id_parts(model_id: str) -> tuple[str, str | None]:
    """(repo or folder, revision) of the name a served model goes by: 5.24: `utils.split_revision('repo@revision')`;
    5.25+: `utils.parse_model_id('repo[@revision][:file.gguf]')`'s first two (split_revision is gone). An existing
    folder is itself, an `@` in its path included."""
    if serving_model_in_own_process():
        from transformers.cli.serving.utils import parse_model_id

        repo, revision, _ = parse_model_id(model_id)
        return repo, revision
    from transformers.cli.serving.utils import split_revision

    return split_revision(model_id)


def serving_processor(manager, model: str):
    """The processor (a tokenizer, for a text model) of `model`, as `manager` serves it: 5.24:
    `manager.load_model_and_processor(manager.process_model_name(model))` (the pinned model, loaded at start, from its
    cache); 5.25+: `manager.get_engine(model).processor`, which the server's process holds beside the model's."""
    if serving_model_in_own_process():
        return manager.get_engine(model).processor
    return manager.load_model_and_processor(manager.process_model_name(model))[1]


def serving_transcription_handler(manager, generation_state):
    """The /v1/audio/transcriptions handler: 5.24: `TranscriptionHandler(model_manager, generation_state)`; 5.25+:
    `TranscriptionHandler(model_manager)`."""
    from transformers.cli.serving.transcription import TranscriptionHandler

    if serving_model_in_own_process():
        return TranscriptionHandler(manager)
    return TranscriptionHandler(manager, generation_state)


def serving_build_server(manager, generation_state, **handlers):
    """`transformers.cli.serving.server.build_server(manager, chat_handler, completion_handler=, response_handler=,
    transcription_handler=, systemone_handler=)`, its lifespan ending in `manager.shutdown()`: 5.24 also takes
    `generation_state=` (its /health asks whether continuous batching's worker lives); 5.25+ does not (it asks
    `manager.is_dead`)."""
    from transformers.cli.serving.server import build_server

    chat_handler = handlers.pop("chat_handler")
    if not serving_model_in_own_process():
        handlers["generation_state"] = generation_state
    return build_server(manager, chat_handler, **handlers)


def serving_model_processes(manager) -> list:
    """The processes running `manager`'s models: 5.24: none, the models are in the server's process; 5.25+: each
    running `EngineClient.managed_process` of `manager.engines` (a `multiprocessing` process; `manager.shutdown()`
    terminates it, and forgets it before it has exited)."""
    if not serving_model_in_own_process():
        return []
    return [engine.managed_process for engine in manager.engines.values() if engine.managed_process is not None]


def serving_loading_error(error: RuntimeError) -> Exception:
    """The error that failed loading in the model's process, as that process reported it: 5.25+ sends
    `RuntimeError(f"{type(error).__name__}: {error}")` (`EngineClient.run_engine`), which this turns back into the
    builtin exception it names (`ImportError`, `OSError`, `ValueError`, ...), the error 5.24 raised in the server's
    own process; an error of another type (a library's own) is returned as it is."""
    import builtins

    name, separator, message = str(error).partition(": ")
    kind = getattr(builtins, name, None) if separator and name.isidentifier() else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    return error


def serving_stop_generation(generation_state) -> None:
    """Stop what generates, once the server's lifespan has ended: 5.24: `generation_state.shutdown()` (continuous
    batching's thread, which `manager.shutdown()` leaves running); 5.25+: nothing, `manager.shutdown()` stopped the
    model's process, its generation with it."""
    if not serving_model_in_own_process():
        generation_state.shutdown()


__all__ = [
    "MINIMUM_TRANSFORMERS",
    "TOKENIZER_ERRORS_UNMASKED",
    "SERVING_MINIMUM",
    "SERVING_MODEL_PROCESS",
    "TRANSFORMERS_VERSION",
    "auto_tokenizer",
    "bloom_alibi_tensor",
    "distributed_config",
    "config_from_dict",
    "falcon_alibi_tensor",
    "mpt_alibi_tensor",
    "named_tokenizer_inputs",
    "require_transformers",
    "serving_build_server",
    "serving_generation_state",
    "serving_handler_classes",
    "serving_loading_error",
    "serving_model_id_parts",
    "serving_model_in_own_process",
    "serving_model_loader_class",
    "serving_model_manager_class",
    "serving_model_processes",
    "serving_processor",
    "serving_stop_generation",
    "serving_transcription_handler",
    "special_token_ids",
    "transformers_at_least",
]
