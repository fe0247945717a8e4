"""`hf-alibi serve`: --help lists every option; a bad value, or a transformers older than 5.24, is one line
`hf-alibi: error: ...` naming it, exit status 2, before any server starts (were one started, `main` would not
return); the options reach the model the app serves; and transformers' own loading still fails on an ALiBi checkpoint
(the reason `hf_alibi/serving_loader.py` exists)."""

import asyncio
import sys

import pytest
from packaging.version import Version

from hf_alibi import _transformers_compat
from hf_alibi._transformers_compat import (
    serving_model_in_own_process,
    serving_model_loader_class,
    serving_model_manager_class,
)
from hf_alibi.cli import main
from tiny_checkpoint import checkpoint, save_tiny_checkpoint  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "gpt2-tiny", family="gpt2")


def test_serve_help_lists_every_option_and_exits_0(capsys):
    assert main(["serve", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: hf-alibi serve")
    for flag in (
        "--host",
        "--port",
        "--continuous-batching",
        "--cb-max-batch-tokens",
        "--cb-num-blocks",
        "--cb-block-size",
        "--attn-implementation",
        "--alibi-skip-eps",
        "--device",
        "--dtype",
        "--max-tokens-limit",
    ):
        assert flag in text, flag


# (case, arguments after `serve GPT2_FOLDER`, text the error line must name)
CASES = [
    ("port_too_large", ["--port", "70000"], "got 70000"),
    ("port_zero", ["--port", "0"], "got 0"),
    ("port_not_a_number", ["--port", "http"], "'http'"),
    ("negative_skip_eps", ["--alibi-skip-eps", "-1"], "got -1.0"),
    ("skip_eps_of_one", ["--alibi-skip-eps", "1"], "got 1.0"),
    ("unknown_attention", ["--attn-implementation", "paged"], "got 'paged'"),
    ("unknown_dtype", ["--dtype", "float8"], "got 'float8'"),
    ("zero_max_tokens_limit", ["--max-tokens-limit", "0"], "got 0"),
    ("cb_flag_without_cb", ["--cb-block-size", "16"], "cb_block_size=16 needs continuous_batching"),
    ("negative_cb_blocks", ["--continuous-batching", "--cb-num-blocks", "-4"], "got -4"),
    ("extra_argument", ["surplus"], "surplus"),
]


def _error_line(capfd) -> str:
    captured = capfd.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-alibi: error: "), captured
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


@pytest.mark.parametrize("arguments, names", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_serve_option_is_one_error_line_naming_the_value_with_status_2(gpt2_folder, capfd, arguments, names):
    assert main(["serve", str(gpt2_folder), *arguments]) == 2
    assert names in _error_line(capfd)


def test_serving_a_missing_folder_is_one_error_line_naming_it(tmp_path, capfd):
    assert main(["serve", str(tmp_path / "no_such_model")]) == 2
    assert f"{str(tmp_path / 'no_such_model')!r}: no such folder" in _error_line(capfd)


def test_skip_eps_for_a_model_that_is_not_alibi_is_refused_naming_its_type(gpt2_folder, capfd):
    assert main(["serve", str(gpt2_folder), "--alibi-skip-eps", "1e-7"]) == 2
    assert "model_type 'gpt2'" in _error_line(capfd)


def describe_model(model, processor) -> dict:
    """What the served model was loaded with. At the top of the module: on transformers 5.25+ it runs in the model's
    process, which unpickles it by name."""
    return {
        "class": type(model).__name__,
        "alibi_skip_eps": model.config.alibi_skip_eps,
        "attention": model.config._attn_implementation,
        "chat_template": processor.chat_template is not None,
    }


def ask_served_model(app, model: str, function):
    """`function(model, processor)` on the model the app serves: 5.24 holds it in this process, 5.25+ in its own."""
    manager = app.state.model_manager
    if serving_model_in_own_process():
        return asyncio.run(manager.get_engine(model).submit(function))
    return function(*manager.load_model_and_processor(manager.process_model_name(model)))  # the preloaded one


def test_skip_eps_and_attention_implementation_reach_the_served_model(checkpoint):
    from hf_alibi.serving import ServeOptions, build_app

    app = build_app(ServeOptions(str(checkpoint), alibi_skip_eps=1e-7, attn_implementation="eager", device="cpu"))
    try:
        served = ask_served_model(app, str(checkpoint), describe_model)
    finally:
        app.state.model_manager.shutdown()  # 5.25+: the model's process
    assert served == {
        "class": "AlibiGPT2LMHeadModel",
        "alibi_skip_eps": 1e-7,
        "attention": "eager",
        "chat_template": True,
    }


def test_transformers_own_loading_still_cannot_load_an_alibi_checkpoint(checkpoint):
    """Why `hf_alibi/serving_loader.py` exists; when this fails, transformers loads through the Auto classes: drop
    it. 5.24: `ModelManager` loads the pinned model as it starts; 5.25+: `ModelLoader`, in the model's process."""
    with pytest.raises(AttributeError, match="AlibiGPT2LMHeadModel"):
        if serving_model_in_own_process():
            serving_model_loader_class()(device="cpu").load_model_and_processor(str(checkpoint))
        else:
            serving_model_manager_class()(device="cpu", force_model=str(checkpoint))


def test_serve_on_transformers_older_than_5_24_is_one_error_line_before_anything_loads(tmp_path, monkeypatch, capfd):
    """The version is checked first: before the source is read (a missing folder is not the error) and before any of
    transformers' serving modules or the serve extra's packages is imported (each made unimportable here: an older
    transformers has no serve extra to install)."""
    monkeypatch.setattr(_transformers_compat, "TRANSFORMERS_VERSION", Version("5.23.0"))
    for name in [name for name in sys.modules if name.startswith("transformers.cli.serving")]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in ("transformers.cli.serving", "uvicorn", "fastapi"):
        monkeypatch.setitem(sys.modules, name, None)
    assert main(["serve", str(tmp_path / "absent")]) == 2
    assert _error_line(capfd) == (
        "hf-alibi: error: hf-alibi serve needs transformers>=5.24; this environment has 5.23.0: "
        "pip install 'transformers>=5.24,<6'"
    )


def test_continuous_batching_cache_takes_the_flags_or_stated_defaults_never_free_memory():
    """transformers sizes a paged cache from free memory when `num_blocks` or `max_batch_tokens` is None: the
    settings `build_app` gives it always hold both (the served cache's memory: test_server_continuous_batching)."""
    from hf_alibi.serving import DEFAULT_CB_CACHE_TOKENS, ServeOptions

    default = ServeOptions("x", continuous_batching=True).continuous_batching_settings()
    assert default == {"max_batch_tokens": 1024, "num_blocks": DEFAULT_CB_CACHE_TOKENS // 256, "page_size": 256}
    smaller_blocks = ServeOptions("x", continuous_batching=True, cb_block_size=32).continuous_batching_settings()
    assert smaller_blocks["num_blocks"] * smaller_blocks["page_size"] == DEFAULT_CB_CACHE_TOKENS
    given = ServeOptions("x", continuous_batching=True, cb_num_blocks=64, cb_block_size=16, cb_max_batch_tokens=256)
    assert given.continuous_batching_settings() == {"max_batch_tokens": 256, "num_blocks": 64, "page_size": 16}
