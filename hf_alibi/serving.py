"""`hf-alibi serve`: transformers' own OpenAI-compatible server (the app, handlers and generation state behind
`transformers serve`) for an ALiBi GPT-2 checkpoint, or any checkpoint `AutoModelForCausalLM` loads (GPT-2 too, so
both run on the same server in a benchmark).

    hf-alibi serve ./alibi-tiny --port 8000          # then openai.OpenAI(base_url="http://127.0.0.1:8000/v1", ...)
    hf-alibi serve ./alibi-tiny --continuous-batching --cb-block-size 32

Why not `transformers serve ./alibi-tiny` itself: transformers' server (`ModelManager._load_model` in 5.24,
`ModelLoader._load_model` in 5.25) finds the model class with `getattr(transformers, config.architectures[0])`, and
`AlibiGPT2LMHeadModel`, registered with the Auto classes by `import hf_alibi`, is not an attribute of `transformers`.
`serving_loader` loads through `AutoModelForCausalLM` instead; everything else is transformers' code. transformers
5.24 and 5.25 both work (`_transformers_compat`'s serving section holds what differs: 5.25 runs the model in a
process of its own); older releases are refused with one line.

Requests are checked (`check_request`) before transformers' handlers see them: the fields those handlers convert with
`int()`/`float()` would otherwise fail inside them as a 500, and a huge `max_tokens` would hold the one generation
thread (every other request waits on it) for as long as the model does not emit end-of-text. Chat requests to a
model whose tokenizer has no chat template (a base model) are a 400 saying so, not transformers' bare 500.

`--continuous-batching` sizes its paged cache from the --cb-* flags or their stated defaults
(`DEFAULT_CB_CACHE_TOKENS`), never from the machine's free memory as transformers would.
"""

import argparse
import json
import math
import time
from dataclasses import dataclass, field, fields

from .models.alibi.attention_plan import SUPPORTED_ATTENTION

ATTN_IMPLEMENTATIONS = SUPPORTED_ATTENTION  # the model's one list (its route chooser reads the same)
DTYPES = ("auto", "float32", "float16", "bfloat16")
GRACEFUL_SHUTDOWN_S = 5  # seconds open connections get after SIGTERM before uvicorn closes them
# seconds the shutting-down app waits for the model's process (transformers 5.25+), which transformers terminates and
# kills after 5 s
MODEL_PROCESS_EXIT_S = 10
# Request fields transformers' handlers turn into numbers with int() / float(): the token budgets and sampling knobs.
INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
NUMBER_FIELDS = ("temperature", "top_p", "frequency_penalty")
# The paged cache of --continuous-batching when no --cb-* flag sizes it. transformers alone would size it from the
# machine's free memory (tens of GiB on a server, however small the model); these hold 8 requests of 4096 tokens.
DEFAULT_CB_CACHE_TOKENS = 32768
DEFAULT_CB_BLOCK_SIZE = 256  # transformers' own page_size
DEFAULT_CB_MAX_BATCH_TOKENS = 1024  # tokens of one forward; its attention masks grow with it times the cache


@dataclass(frozen=True)
class ServeOptions:
    """What `hf-alibi serve` runs; every field is a flag (`--continuous-batching`, `--cb-block-size N`, ...)."""

    model: str = field(metadata={"help": "checkpoint folder or Hub id, loaded once at start and served alone"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port to listen on (1-65535)"})
    continuous_batching: bool = field(
        default=False, metadata={"help": "batch concurrent requests on transformers' paged attention cache"}
    )
    cb_max_batch_tokens: int | None = field(
        default=None,
        metadata={"help": f"continuous batching: tokens per batch (default {DEFAULT_CB_MAX_BATCH_TOKENS})"},
    )
    cb_num_blocks: int | None = field(
        default=None,
        metadata={"help": f"continuous batching: KV cache blocks (default: {DEFAULT_CB_CACHE_TOKENS} tokens' worth)"},
    )
    cb_block_size: int | None = field(
        default=None, metadata={"help": f"continuous batching: tokens per KV block (default {DEFAULT_CB_BLOCK_SIZE})"}
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": f"one of {', '.join(ATTN_IMPLEMENTATIONS)} (default: the model's own)"}
    )
    alibi_skip_eps: str | None = field(
        default=None,
        metadata={
            "help": "ALiBi models only: 'auto' (the default) or skip keys of softmax mass <= this (in [0, 1); 0: dense)"
        },
    )
    device: str = field(default="auto", metadata={"help": "device_map for loading: auto, cpu, cuda:0, ..."})
    dtype: str = field(default="auto", metadata={"help": f"one of {', '.join(DTYPES)} (auto: the weights' own)"})
    max_tokens_limit: int = field(
        default=4096, metadata={"help": "largest max_tokens a request may ask for (more is a 400)"}
    )

    def __post_init__(self):
        if not self.model:
            raise ValueError(f"model must name a folder or Hub id, got {self.model!r}")
        if not self.host:
            raise ValueError(f"host must be an address, got {self.host!r}")
        if not _is_int(self.port) or not 1 <= self.port <= 65535:
            raise ValueError(f"port must be an integer in 1-65535, got {self.port!r}")
        attention = self.attn_implementation
        if attention is not None and attention not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"attn_implementation must be one of {ATTN_IMPLEMENTATIONS}, got {attention!r}")
        eps = self.alibi_skip_eps
        if isinstance(eps, str) and eps != "auto":  # the command line's text
            try:
                eps = float(eps)
                object.__setattr__(self, "alibi_skip_eps", eps)  # frozen: the number the text names
            except ValueError:
                raise ValueError(f"alibi_skip_eps must be 'auto' or a number in [0, 1), got {eps!r}") from None
        if eps not in (None, "auto") and (
            isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 <= eps < 1
        ):
            raise ValueError(f"alibi_skip_eps must be 'auto' or a number in [0, 1), got {eps!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not _is_int(self.max_tokens_limit) or self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be a positive integer, got {self.max_tokens_limit!r}")
        for name in ("cb_max_batch_tokens", "cb_num_blocks", "cb_block_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value is not None and not self.continuous_batching:
                raise ValueError(f"{name}={value} needs continuous_batching (--continuous-batching)")

    def continuous_batching_settings(self) -> dict[str, int]:
        """The `ContinuousBatchingConfig` fields, as `transformers serve` names its --cb-* flags (`--cb-block-size` is
        the config's `page_size`, which replaced `block_size` in transformers 5.17); a flag not given takes its stated
        default, so the cache is never sized from the machine's free memory."""
        page_size = self.cb_block_size or DEFAULT_CB_BLOCK_SIZE
        num_blocks = self.cb_num_blocks or math.ceil(DEFAULT_CB_CACHE_TOKENS / page_size)
        return {
            "max_batch_tokens": self.cb_max_batch_tokens or DEFAULT_CB_MAX_BATCH_TOKENS,
            "num_blocks": num_blocks,
            "page_size": page_size,
        }


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `ServeOptions` field (`model` positional), its help the field's own."""
    for option in fields(ServeOptions):
        help_text = option.metadata["help"]
        if option.name == "model":
            parser.add_argument("model", help=help_text)
        elif option.type is bool:
            parser.add_argument(f"--{option.name.replace('_', '-')}", action="store_true", help=help_text)
        else:
            kind = {int: int, float: float, str: str}[next(t for t in (int, float, str) if t in _types(option))]
            shown = "" if option.default is None or "default" in help_text else f" (default: {option.default})"
            parser.add_argument(
                f"--{option.name.replace('_', '-')}", type=kind, default=option.default, help=help_text + shown
            )


def _types(option) -> tuple:
    return getattr(option.type, "__args__", (option.type,))


def options_from_arguments(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(**{option.name: getattr(args, option.name) for option in fields(ServeOptions)})


def check_request(body: dict, max_tokens_limit: int, required: tuple[str, ...] = ()) -> None:
    """Raise a 400 naming the first field of `body` that transformers' handlers would fail on (as a 500, or as a 200
    whose stream holds the error) or that would make generation run without end: a missing `required` field, a
    token budget (also inside transformers' `generation_config` JSON) that is not an integer in 1-`max_tokens_limit`,
    a sampling parameter that is not a number, chat `messages` that are not a list of {role, content} objects."""
    from fastapi import HTTPException

    for name in required:
        if name not in body:
            raise HTTPException(400, f"{name} is required")
    for name in INTEGER_FIELDS:
        value = body.get(name)
        if value is not None and (not _is_int(value) or not 1 <= value <= max_tokens_limit):
            raise HTTPException(400, f"{name} must be an integer in 1-{max_tokens_limit}, got {value!r}")
    for name in NUMBER_FIELDS:
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value)):
            raise HTTPException(400, f"{name} must be a number, got {value!r}")
    if body.get("generation_config") is not None:
        _check_generation_config(body["generation_config"], max_tokens_limit)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(_is_message(message) for message in messages):
            raise HTTPException(400, f"messages must be a list of {{role, content}} objects, got {messages!r}")


def _check_generation_config(text, max_tokens_limit: int) -> None:
    """transformers' own request field: a JSON object of `GenerationConfig` fields, which must not lift the limit."""
    from fastapi import HTTPException

    try:
        settings = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        settings = None
    if not isinstance(settings, dict):
        raise HTTPException(400, f"generation_config must be a string holding a JSON object, got {text!r}")
    for name in ("max_new_tokens", "max_length"):
        value = settings.get(name)
        if value is not None and (not _is_int(value) or not 1 <= value <= max_tokens_limit):
            raise HTTPException(
                400, f"generation_config's {name} must be an integer in 1-{max_tokens_limit}, got {value!r}"
            )


def _is_message(message) -> bool:
    """What transformers' `get_processor_inputs_from_messages` reads without failing: a string role, and content
    that is absent, a string, or a list of typed parts."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    content = message.get("content")
    return (
        content is None
        or isinstance(content, str)
        or (isinstance(content, list) and all(isinstance(part, dict) and "type" in part for part in content))
    )


class CheckedHandler:
    """A transformers handler whose requests pass `check_request` first (`build_server` calls `handle_request`), or
    are all refused with a 400 saying `refusal` (why the endpoint cannot answer for this model), when one is given.
    Refusals are OpenAI's error object (`{"error": {"message": ...}}`), whose message the `openai` client shows."""

    def __init__(self, handler, max_tokens_limit: int, required: tuple[str, ...] = (), refusal: str | None = None):
        self.handler = handler
        self.max_tokens_limit = max_tokens_limit
        self.required = required
        self.refusal = refusal

    async def handle_request(self, body: dict, request_id: str):
        from fastapi import HTTPException
        from fastapi.responses import JSONResponse

        try:
            check_request(body, self.max_tokens_limit, self.required)
            if self.refusal is not None:
                raise HTTPException(400, self.refusal)
        except HTTPException as refused:
            error = {"message": refused.detail, "type": "invalid_request_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=refused.status_code)
        return await self.handler.handle_request(body, request_id)


def chat_refusal(tokenizer, model: str) -> str | None:
    """Why chat requests to `model` cannot be answered, or None: a tokenizer without a chat template (a base model,
    as every checkpoint the recipe trains), whose messages transformers' handlers would fail to format (a bare 500)."""
    if getattr(tokenizer, "chat_template", None):
        return None
    return (
        f"{model} has no chat template, so chat messages cannot be made into a prompt: send a prompt to "
        "/v1/completions instead, or give the checkpoint a template (tokenizer.chat_template = '...', then "
        "tokenizer.save_pretrained(folder))"
    )


def build_app(options: ServeOptions):
    """The FastAPI app of `transformers serve` for `options.model`, loaded now (the server is pinned to it).

    `ImportError` with one line when transformers is older than `SERVING_MINIMUM` (5.24) or its serving packages are
    missing (naming `hf_alibi[serve]`); `ValueError` naming the source when it holds no checkpoint, or
    `alibi_skip_eps` for a model that is not ALiBi. The app's `state` holds `model_manager` and `generation_state`.
    On transformers 5.25+ the model runs in a process the manager starts now (multiprocessing's "spawn", which
    re-imports the calling script: call this under `if __name__ == "__main__":`), stopped with the app.
    """
    from ._transformers_compat import SERVING_MINIMUM, require_transformers
    from .import_utils import require_extra

    require_transformers(SERVING_MINIMUM, "hf-alibi serve")  # before any import of transformers' serving modules
    require_extra("serve", "hf-alibi serve")
    from transformers import ContinuousBatchingConfig

    from ._transformers_compat import serving_build_server, serving_generation_state, serving_processor
    from .conversion.common import load_config
    from .serving_loader import pinned_model_manager

    config = load_config(options.model)  # a missing folder or unknown id fails here, naming it
    model_kwargs = {}
    if options.alibi_skip_eps is not None:
        if config.model_type != "alibi_gpt2":
            raise ValueError(
                f"alibi_skip_eps={options.alibi_skip_eps} needs an ALiBi GPT-2 (alibi_gpt2) checkpoint; "
                f"{options.model} is model_type {config.model_type!r}"
            )
        model_kwargs["alibi_skip_eps"] = options.alibi_skip_eps
    cb = options.continuous_batching
    state = serving_generation_state(
        cb, ContinuousBatchingConfig(**options.continuous_batching_settings()) if cb else None
    )
    settings = dict(
        device=options.device,
        dtype=options.dtype,
        attn_implementation=options.attn_implementation,
        continuous_batching=options.continuous_batching,
    )
    manager = pinned_model_manager(options.model, settings, model_kwargs, state)
    refusal = chat_refusal(serving_processor(manager, options.model), options.model)
    app = serving_build_server(manager, state, **_checked_handlers(manager, state, options.max_tokens_limit, refusal))
    _stop_on_shutdown(app, manager, state)
    app.state.model_manager = manager
    app.state.generation_state = state
    return app


def _checked_handlers(manager, state, max_tokens_limit: int, refusal: str | None) -> dict:
    """`build_server`'s handlers: transformers' own, those that generate text behind `CheckedHandler` (chat and
    responses refused with `refusal` when it is given)."""
    from ._transformers_compat import serving_handler_classes, serving_transcription_handler

    handler = {
        name: cls(model_manager=manager, generation_state=state) for name, cls in serving_handler_classes().items()
    }
    return {
        "chat_handler": CheckedHandler(handler["chat"], max_tokens_limit, ("messages",), refusal),
        "completion_handler": CheckedHandler(handler["completion"], max_tokens_limit),
        "response_handler": CheckedHandler(handler["response"], max_tokens_limit, ("input",), refusal),
        "transcription_handler": serving_transcription_handler(manager, state),
        "systemone_handler": handler["systemone"],
    }


def _stop_on_shutdown(app, manager, state) -> None:
    """When the app shuts down, after `build_server`'s own lifespan has freed the model (`manager.shutdown()`), stop
    what still generates (5.24: `state`'s continuous batching thread) and wait up to `MODEL_PROCESS_EXIT_S` for the
    model's process to exit (5.25+), whose memory is then free: whichever ASGI server runs the app, nothing it
    started outlives it."""
    import asyncio
    from contextlib import asynccontextmanager

    from ._transformers_compat import serving_model_processes, serving_stop_generation

    served = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app):
        processes = []
        try:
            async with served(app) as lifespan_state:
                try:
                    yield lifespan_state
                finally:
                    processes = serving_model_processes(manager)  # before the lifespan's shutdown forgets them
        finally:
            serving_stop_generation(state)
            await asyncio.to_thread(_wait_for_exit, processes, MODEL_PROCESS_EXIT_S)

    app.router.lifespan_context = lifespan


def _wait_for_exit(processes: list, timeout: float) -> None:
    """Return once every one of `processes` (`multiprocessing` processes) has exited, or after `timeout` seconds."""
    from multiprocessing.connection import wait

    sentinels = [process.sentinel for process in processes]
    end = time.monotonic() + timeout
    while sentinels and time.monotonic() < end:
        ready = wait(sentinels, end - time.monotonic())
        sentinels = [sentinel for sentinel in sentinels if sentinel not in ready]


def serve(options: ServeOptions) -> None:
    """Build the app and serve it with uvicorn until SIGINT or SIGTERM. Open connections get `GRACEFUL_SHUTDOWN_S`
    to finish, so a stalled streaming client cannot hold the exit. uvicorn re-raises the signal once it has shut
    down: SIGTERM ends the process by that signal; Ctrl-C's KeyboardInterrupt is how a server is stopped, not an
    error, and returns."""
    app = build_app(options)  # first: it refuses a transformers older than 5.24, which has no serve extra to install
    import uvicorn

    config = uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
    )
    print(f"serving {options.model} on http://{options.host}:{options.port}/v1", flush=True)
    if options.continuous_batching:
        cache = options.continuous_batching_settings()
        print(
            f"continuous batching: a paged cache of {cache['num_blocks']} blocks x {cache['page_size']} tokens, "
            f"{cache['max_batch_tokens']} tokens per batch (--cb-num-blocks, --cb-block-size, --cb-max-batch-tokens)",
            flush=True,
        )
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:
        print("stopped", flush=True)


__all__ = ["ServeOptions", "add_arguments", "build_app", "chat_refusal", "check_request", "serve"]
