"""`hf_alibi.convert` / `hf-alibi convert` pick the family by model_type; `hf-alibi export` writes loadable layouts."""

import json
import warnings

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MptConfig,
    MptForCausalLM,
    PreTrainedTokenizerFast,
)

from family_checks import VOCAB, perturb
from hf_alibi import AlibiGPT2LMHeadModel, convert
from hf_alibi.cli import run

SOURCES = {
    "bloom": lambda: BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)),
    "mpt": lambda: MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)),
    "falcon": lambda: FalconForCausalLM._from_config(
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            alibi=True,
            bias=True,
            parallel_attn=False,
            multi_query=False,
        ),
        attn_implementation="sdpa",
    ),
}


def save_with_tokenizer(model, folder):
    model.generation_config = GenerationConfig(max_new_tokens=7, do_sample=False)
    model.save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({"<eos>": 0, "hello": 5, "world": 6}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(folder)


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_cli_convert_imports_each_family_exactly_with_tokenizer_and_generation_config(family, tmp_path, capsys):
    source = perturb(SOURCES[family]())
    save_with_tokenizer(source, tmp_path / "source")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fine-tune warning: the import is exact
        run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    assert f"exact import of the {family} model" in capsys.readouterr().out
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "alibi").eval()
    assert type(loaded) is AlibiGPT2LMHeadModel
    assert AutoTokenizer.from_pretrained(tmp_path / "alibi")("hello world")["input_ids"] == [5, 6]
    assert loaded.generation_config.max_new_tokens == 7
    ids = torch.randint(3, VOCAB, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, atol=2e-5, rtol=0)


def test_convert_accepts_objects_and_folders_alike(tmp_path):
    source = perturb(SOURCES["bloom"]())
    source.save_pretrained(tmp_path)
    from_object, from_folder = convert(source), convert(str(tmp_path))
    for key, tensor in from_object.state_dict().items():
        assert torch.equal(from_folder.state_dict()[key], tensor), key


def test_convert_with_a_destination_writes_the_folder_as_export_does(tmp_path):
    source = perturb(SOURCES["mpt"]())
    save_with_tokenizer(source, tmp_path / "source")
    path = convert(str(tmp_path / "source"), tmp_path / "alibi")
    assert path == tmp_path / "alibi"
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(loaded) is AlibiGPT2LMHeadModel and loaded.generation_config.max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(path)("hello world")["input_ids"] == [5, 6]
    alone = convert(source, tmp_path / "alone")  # an object and no tokenizer given: the model alone
    assert (alone / "model.safetensors").is_file() and not (alone / "tokenizer_config.json").exists()
    with pytest.raises(ValueError, match="not empty"):
        convert(str(tmp_path / "no_such_source"), path)  # the destination is refused before the source is read
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alibi", "alone", "source"]


def test_convert_refuses_an_unknown_family_by_model_type(tmp_path):
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    )
    with pytest.raises(ValueError, match="llama"):
        convert(llama)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="llama"):
        convert(str(tmp_path / "llama"))


def test_alibi_settings_are_refused_for_exact_imports():
    with pytest.raises(ValueError, match="alibi_max_bias"):
        convert(SOURCES["mpt"](), alibi_max_bias=4.0)


def test_cli_export_to_mpt_writes_a_folder_mpt_loads_with_tokenizer(tmp_path):
    mpt = perturb(SOURCES["mpt"]())
    save_with_tokenizer(mpt, tmp_path / "source")
    run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    run(["export", str(tmp_path / "alibi"), str(tmp_path / "mpt"), "--to", "mpt", "--max-seq-len", "4096"])
    assert json.loads((tmp_path / "mpt" / "config.json").read_text())["max_seq_len"] == 4096
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mpt").eval()
    assert type(loaded) is MptForCausalLM
    assert AutoTokenizer.from_pretrained(tmp_path / "mpt")("hello")["input_ids"] == [5]
    for key, tensor in mpt.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key


def test_cli_export_refusal_names_the_switch_and_writes_nothing(tmp_path):
    save_with_tokenizer(perturb(SOURCES["mpt"]()), tmp_path / "source")
    run(["convert", str(tmp_path / "source"), str(tmp_path / "alibi")])
    with pytest.raises(ValueError, match="embedding_layernorm"):
        run(["export", str(tmp_path / "alibi"), str(tmp_path / "bloom"), "--to", "bloom"])
    with pytest.raises(ValueError, match="activation_function"):
        run(["export", str(tmp_path / "alibi"), str(tmp_path / "model.gguf"), "--to", "gguf"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alibi", "source"]


def test_each_remote_code_record_is_what_import_export_and_the_cli_offer():
    """A remote-code family is one record: its model types are imported exactly, exported as layouts of the same
    names (checked by its record's function), and offered by `hf-alibi export --to` and `hf-alibi --help`."""
    from hf_alibi.cli import build_parser
    from hf_alibi.conversion.dispatch import EXACT_FAMILIES, EXPORTABLE, LAYOUTS, REMOTE_CODE, REMOTE_CODE_FAMILIES

    parser = build_parser()
    assert {"jais", "btlm", "baichuan"} <= set(REMOTE_CODE_FAMILIES)
    for family in REMOTE_CODE:
        for model_type, name in family.names.items():
            assert REMOTE_CODE_FAMILIES[model_type] is family and model_type in EXACT_FAMILIES
            assert EXPORTABLE[model_type] is family.check_exportable and model_type in LAYOUTS
            assert parser.parse_args(["export", "src", "dst", "--to", model_type]).to == model_type
            assert name in parser.format_help()
