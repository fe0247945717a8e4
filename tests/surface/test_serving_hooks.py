"""The serving hooks `hf-alibi serve` stands on (`hf_alibi._transformers_compat`'s serving section), one test each."""

import inspect
from importlib.util import find_spec

import pytest

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi import _transformers_compat as serving_compat
from surface_helpers import parameters

# Serving (`hf-alibi serve`): the names of `hf_alibi._transformers_compat`'s serving section, one test each, on the
# installed release (5.24 or 5.25+). transformers' serving modules import fastapi: the `serve` extra.
serving = pytest.mark.skipif(
    not serving_compat.transformers_at_least(serving_compat.SERVING_MINIMUM) or find_spec("fastapi") is None,
    reason="hf-alibi serve needs transformers>=5.24 and the serve extra",
)
model_process = pytest.mark.skipif(
    not serving_compat.serving_model_in_own_process(), reason="5.25+: the model runs in a process of its own"
)


@pytest.fixture(scope="module")
def served_folder(tmp_path_factory):
    from serving.tiny_checkpoint import save_tiny_checkpoint  # tests/serving: a tiny ALiBi GPT-2 and its tokenizer

    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("surface") / "alibi-tiny"))


class FakeManager:
    """What `build_server` asks of a model manager, recorded."""

    is_dead = False  # 5.25+'s /health

    def __init__(self):
        self.shut_down = False

    def shutdown(self):
        self.shut_down = True


class FakeHandler:
    def __init__(self, name: str):
        self.name = name

    async def handle_request(self, body, request_id=None):
        from fastapi.responses import JSONResponse

        return JSONResponse({"handler": self.name, "body": body})


@serving
def test_serving_handler_classes_take_the_manager_and_state_and_answer_handle_request():
    state = serving_compat.serving_generation_state(False, None)
    manager = FakeManager()
    for name, handler_class in serving_compat.serving_handler_classes().items():
        handler = handler_class(model_manager=manager, generation_state=state)
        assert handler.model_manager is manager and handler.generation_state is state, name
        assert inspect.iscoroutinefunction(handler_class.handle_request), f"{name}.handle_request is not async"
        assert parameters(handler_class.handle_request) == ["self", "body", "request_id"], name


@serving
def test_serving_build_server_routes_to_the_handlers_given_and_its_lifespan_shuts_the_manager_down():
    """`serving.CheckedHandler` sits where transformers' handlers go; `_stop_on_shutdown` wraps the lifespan."""
    from fastapi.testclient import TestClient

    manager, state = FakeManager(), serving_compat.serving_generation_state(False, None)
    names = ("chat_handler", "completion_handler", "response_handler", "transcription_handler", "systemone_handler")
    app = serving_compat.serving_build_server(manager, state, **{name: FakeHandler(name) for name in names})
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        for path, name in [("/v1/chat/completions", "chat_handler"), ("/v1/completions", "completion_handler")]:
            assert client.post(path, json={"x": 1}).json() == {"handler": name, "body": {"x": 1}}, path
        assert not manager.shut_down
    assert manager.shut_down, "build_server's lifespan no longer ends in model_manager.shutdown()"


@serving
def test_serving_transcription_handler_is_built_on_the_manager():
    manager, state = FakeManager(), serving_compat.serving_generation_state(False, None)
    handler = serving_compat.serving_transcription_handler(manager, state)
    assert handler.model_manager is manager and parameters(type(handler).handle_request) == ["self", "request"]


@serving
def test_serving_generation_state_holds_our_paged_cache_config_and_puts_no_cap_on_an_alibi_prompt():
    """5.25+: the model's process sizes the cache from `cb_config` and refuses prompts past `context_length`, the
    config's `max_position_embeddings`, which an ALiBi config does not have; 5.24: `get_manager` builds continuous
    batching on `cb_config`."""
    from transformers import ContinuousBatchingConfig, GPT2Config

    cb_config = ContinuousBatchingConfig(num_blocks=4, page_size=16, max_batch_tokens=32)
    state = serving_compat.serving_generation_state(True, cb_config)
    if serving_compat.serving_model_in_own_process():
        assert state.cb_config is cb_config
        assert state.context_length(AlibiGPT2Config(n_positions=64)) is None, "an ALiBi prompt is capped"
        assert state.context_length(GPT2Config(n_positions=64)) == 64, "context_length no longer reads the config"
    else:
        assert state.get_manager("m", use_cb=True)._cb_config is cb_config


@serving
def test_serving_model_id_parts_splits_the_revision_and_keeps_a_folder_whole(tmp_path):
    folder = tmp_path / "checkpoint@1000"
    folder.mkdir()
    assert serving_compat.serving_model_id_parts("org/model@dev") == ("org/model", "dev")
    assert serving_compat.serving_model_id_parts("org/model") == ("org/model", None)
    assert serving_compat.serving_model_id_parts(str(folder)) == (str(folder), None)


@serving
def test_serving_loading_hook_is_what_transformers_calls_and_loads_through_the_auto_classes(served_folder):
    """5.25+: the model's process calls a pickled `partial(loader.load_model_and_processor, model_id)`; 5.24:
    `ModelManager.load_model_and_processor` calls `_load_model`. `hf_alibi.serving_loader` overrides each."""
    import pickle
    from functools import partial

    from hf_alibi import serving_loader

    settings = dict(device="cpu", dtype="auto", attn_implementation="eager", continuous_batching=False)
    if serving_compat.serving_model_in_own_process():
        base = serving_compat.serving_model_loader_class()
        assert parameters(base.load_model_and_processor) == ["self", "model_id", "on_progress"]
        loader = serving_loader.AutoModelLoader(model_kwargs={"alibi_skip_eps": 0.0}, **settings)
        load = pickle.loads(pickle.dumps(partial(loader.load_model_and_processor, served_folder)))
        model, tokenizer = load(on_progress=None)
    else:
        base = serving_compat.serving_model_manager_class()
        expected = ["self", "model_id_and_revision", "tqdm_class", "progress_callback", "gguf_file"]
        assert parameters(base._load_model) == expected, parameters(base._load_model)
        manager = serving_loader.AutoLoadingModelManager(model_kwargs={"alibi_skip_eps": 0.0}, **settings)
        model, tokenizer = manager.load_model_and_processor(manager.process_model_name(served_folder))
    assert isinstance(model, AlibiGPT2LMHeadModel) and tokenizer.chat_template is not None
    assert model.config.alibi_skip_eps == 0.0 and model.config._attn_implementation == "eager"


@serving
def test_serving_processor_is_the_served_models_tokenizer(served_folder):
    """5.25+: the engine of a model, which the server's process creates without starting the model's process."""
    from hf_alibi import serving_loader

    state = serving_compat.serving_generation_state(False, None)
    settings = dict(device="cpu", dtype="auto", attn_implementation=None, continuous_batching=False)
    if serving_compat.serving_model_in_own_process():
        manager = serving_compat.serving_model_manager_class()(
            serving_loader.AutoModelLoader(model_kwargs={}, **settings), state
        )
    else:
        manager = serving_loader.AutoLoadingModelManager(model_kwargs={}, **settings)
    tokenizer = serving_compat.serving_processor(manager, served_folder)
    assert tokenizer.chat_template is not None and tokenizer("hello")["input_ids"]
    assert serving_compat.serving_model_processes(manager) == [], "no model's process was started"


@serving
@model_process
def test_serving_model_processes_are_the_engines_until_shutdown_terminates_and_forgets_them(served_folder):
    """`_stop_on_shutdown` reads them before `manager.shutdown()`, then waits for them to exit."""
    import multiprocessing
    import time

    from hf_alibi import serving_loader

    settings = dict(device="cpu", dtype="auto", attn_implementation=None, continuous_batching=False)
    loader = serving_loader.AutoModelLoader(model_kwargs={}, **settings)
    state = serving_compat.serving_generation_state(False, None)
    manager = serving_compat.serving_model_manager_class()(loader, state)
    engine = manager.get_engine(served_folder)
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=time.sleep, args=(60,), daemon=True)  # stands for the model's process
    process.start()
    engine.managed_process, engine.requests_queue = process, context.Queue()
    assert serving_compat.serving_model_processes(manager) == [process]
    manager.shutdown()
    assert serving_compat.serving_model_processes(manager) == [], "shutdown no longer forgets the process"
    # shutdown's own thread joins (reaps) the process: a second join here can race it and return before the exit code
    # is set, so wait for the exit code itself
    deadline = time.monotonic() + 10
    while process.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.exitcode is not None, "shutdown no longer terminates the model's process"


@serving
@model_process
def test_serving_loading_error_is_the_builtin_error_the_model_process_reports_as_text():
    """`EngineClient.run_engine` sends a failed load as `RuntimeError("ImportError: ...")` through its pipe."""
    import logging

    sent = []

    class Writer:
        send, close = sent.append, staticmethod(lambda: None)

    def failing_load(on_progress=None):
        raise ImportError("the package for FlashAttention2 is not installed")

    from transformers.cli.serving.model_manager import EngineClient

    state, level = serving_compat.serving_generation_state(False, None), logging.getLogger("transformers.cli").level
    EngineClient.run_engine(failing_load, state, None, [], Writer(), False, level)
    assert len(sent) == 1 and isinstance(sent[0], RuntimeError), sent
    error = serving_compat.serving_loading_error(sent[0])
    assert type(error) is ImportError and str(error) == "the package for FlashAttention2 is not installed", error
    other = RuntimeError("SafetensorError: header too large")  # a library's own type stays as it came
    assert serving_compat.serving_loading_error(other) is other


@serving
def test_serving_stop_generation_stops_what_the_manager_shutdown_leaves_running():
    """5.24: continuous batching's manager, which `GenerationState.shutdown` stops and drops; 5.25+: nothing (the
    model's process, generation and all, stops with `manager.shutdown()`)."""
    state = serving_compat.serving_generation_state(True, None)
    if serving_compat.serving_model_in_own_process():
        assert not hasattr(state, "shutdown"), "5.25's GenerationState has a shutdown again: call it"
    else:
        state.get_manager("m", use_cb=True)
        serving_compat.serving_stop_generation(state)
        assert state._cb_manager is None, "GenerationState.shutdown no longer drops continuous batching's manager"
    serving_compat.serving_stop_generation(state)
