"""GPT-2 -> ALiBi GPT-2: every weight but wpe copied exactly, bad inputs refused, and the `hf-alibi convert` command."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

from conftest import tiny_config_kwargs
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel, convert_gpt2, get_alibi_slopes
from hf_alibi.cli import run

FINE_TUNE_WARNING = "(?i)fine-tune"


def tiny_gpt2(**overrides) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(**tiny_config_kwargs(**overrides))).eval()


def convert_expecting_warning(model, **kwargs):
    with pytest.warns(UserWarning, match=FINE_TUNE_WARNING):
        return convert_gpt2(model, **kwargs)


def test_convert_copies_every_weight_except_wpe_exactly():
    gpt2 = tiny_gpt2()
    with pytest.warns(UserWarning, match=FINE_TUNE_WARNING):
        alibi = convert_gpt2(gpt2)
    assert type(alibi) is AlibiGPT2LMHeadModel
    source = {k: v for k, v in gpt2.state_dict().items() if k != "transformer.wpe.weight"}
    target = alibi.state_dict()
    only_alibi, only_gpt2 = set(target) - set(source), set(source) - set(target)
    assert not only_alibi and not only_gpt2, f"only ALiBi: {only_alibi}; only GPT-2: {only_gpt2}"
    differing = [key for key, tensor in source.items() if not torch.equal(target[key], tensor)]
    assert not differing, f"weights not copied exactly: {differing}"
    assert alibi.lm_head.weight.data_ptr() == alibi.transformer.wte.weight.data_ptr()  # still tied
    for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "activation_function"):
        assert getattr(alibi.config, name) == getattr(gpt2.config, name), name
    assert torch.equal(alibi.transformer.alibi_slopes, get_alibi_slopes(12))


def test_convert_passes_alibi_settings_through():
    alibi = convert_expecting_warning(tiny_gpt2(), alibi_max_bias=4.0)
    assert alibi.config.alibi_max_bias == 4.0
    assert torch.equal(alibi.transformer.alibi_slopes, get_alibi_slopes(12, 4.0))


def test_convert_rejects_models_that_are_not_gpt2():
    with pytest.raises(ValueError, match="alibi_gpt2"):
        convert_gpt2(AlibiGPT2LMHeadModel(AlibiGPT2Config(**tiny_config_kwargs())))
    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match="bloom"):
        convert_gpt2(bloom)


@pytest.mark.parametrize("flag", ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"])
def test_convert_rejects_gpt2_flags_alibi_does_not_implement(flag):
    with pytest.raises(ValueError, match=flag):
        convert_gpt2(tiny_gpt2(**{flag: True}))


@pytest.fixture
def gpt2_folder(tmp_path):
    model = tiny_gpt2()
    folder = tmp_path / "gpt2"
    model.save_pretrained(folder)
    return model, folder


def test_cli_convert_writes_a_loadable_folder_with_the_converted_weights(gpt2_folder, tmp_path, random_ids):
    gpt2, source = gpt2_folder
    destination = tmp_path / "out" / "alibi"
    with pytest.warns(UserWarning, match=FINE_TUNE_WARNING):
        run(["convert", str(source), str(destination), "--alibi-max-bias", "6"])
    with safe_open(destination / "model.safetensors", "pt") as weights:
        assert not any("wpe" in key for key in weights.keys())  # noqa: SIM118  (safe_open is no mapping: no `in`)
    assert json.loads((destination / "config.json").read_text())["model_type"] == "alibi_gpt2"
    assert not (destination / "tokenizer.json").exists()  # the source has no tokenizer: none is invented
    loaded = AutoModelForCausalLM.from_pretrained(destination).eval()
    assert type(loaded) is AlibiGPT2LMHeadModel
    assert torch.equal(loaded.transformer.alibi_slopes, get_alibi_slopes(12, 6.0))
    expected = convert_expecting_warning(gpt2, alibi_max_bias=6.0)
    ids = random_ids(2, 40)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, atol=0, rtol=0)


def test_cli_convert_ships_the_source_tokenizer(gpt2_folder, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, source = gpt2_folder
    vocab = {"<|endoftext|>": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(source)
    destination = tmp_path / "alibi"
    with pytest.warns(UserWarning, match=FINE_TUNE_WARNING):
        run(["convert", str(source), str(destination)])
    assert AutoTokenizer.from_pretrained(destination)("hello world")["input_ids"] == [1, 2]


def test_cli_convert_accepts_an_existing_empty_destination(gpt2_folder, tmp_path):
    _, source = gpt2_folder
    destination = tmp_path / "empty"
    destination.mkdir()
    with pytest.warns(UserWarning, match=FINE_TUNE_WARNING):
        run(["convert", str(source), str(destination)])
    assert (destination / "model.safetensors").is_file()


def test_cli_convert_refuses_a_non_empty_destination(gpt2_folder, tmp_path):
    _, source = gpt2_folder
    destination = tmp_path / "taken"
    destination.mkdir()
    (destination / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        run(["convert", str(source), str(destination)])
    assert [p.name for p in destination.iterdir()] == ["keep.txt"]
    assert (destination / "keep.txt").read_text() == "mine"


def test_cli_convert_failure_leaves_no_partial_destination(gpt2_folder, tmp_path, monkeypatch):
    _, source = gpt2_folder
    parent = tmp_path / "outputs"
    parent.mkdir()

    def save_then_fail(self, folder, *args, **kwargs):
        (folder / "config.json").write_text("{}")  # a partial write, then the disk "fills up"
        raise OSError("disk full")

    monkeypatch.setattr(AlibiGPT2LMHeadModel, "save_pretrained", save_then_fail)
    with pytest.warns(UserWarning, match=FINE_TUNE_WARNING), pytest.raises(OSError, match="disk full"):
        run(["convert", str(source), str(parent / "alibi")])
    assert list(parent.iterdir()) == [], f"left behind: {list(parent.iterdir())}"


def test_cli_convert_of_a_missing_source_creates_nothing(tmp_path):
    with pytest.raises((OSError, ValueError)):
        run(["convert", str(tmp_path / "no_such_model"), str(tmp_path / "alibi")])
    assert not (tmp_path / "alibi").exists()
