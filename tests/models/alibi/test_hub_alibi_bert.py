"""The encoder's Hub path: `save_pretrained` ships the encoder's files and the attention core they import (relative
imports only, resolved inside the saved folder), an auto_map for every head, and a fresh process without hf_alibi loads
each head with `trust_remote_code=True` to the installed model's outputs."""

import json

import pytest
import torch
from test_hub import (
    ENCODER_ENTRY_FILES,
    PACKAGE,
    assert_auto_map_names_classes_in,
    code_closure,
    imports,
    run_without_hf_alibi,
)

from hf_alibi import AlibiBertForMaskedLM, get_alibi_slopes
from hf_alibi.models.alibi.configuration_alibi_bert import AUTO_MAP

ENCODER_CODE_FILES = code_closure(PACKAGE, ENCODER_ENTRY_FILES)


@pytest.fixture(params=["jina", "jina_code"])
def saved(make_encoder, tmp_path, request):
    """A saved masked-LM encoder of each `layer_layout` (jina-embeddings-v2's, base-code's)."""
    model = make_encoder(AlibiBertForMaskedLM, qk_layer_norm=True, layer_layout=request.param)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    return model, folder


def test_the_encoder_ships_its_own_files_and_the_shared_attention_core():
    assert set(ENCODER_ENTRY_FILES) | {"alibi_bias.py", "attention_alibi.py", "attention_plan.py"} <= ENCODER_CODE_FILES
    assert "modeling_alibi_gpt2.py" not in ENCODER_CODE_FILES  # the decoder's model is not part of an encoder
    offenders = {name: imports(PACKAGE / name)[1] for name in ENCODER_CODE_FILES if imports(PACKAGE / name)[1]}
    assert not offenders, f"absolute hf_alibi imports break remote-code loading: {offenders}"


def test_save_pretrained_writes_the_code_closure_and_an_auto_map_for_every_head(saved):
    _, folder = saved
    files = {path.name for path in folder.iterdir()}
    assert "model.safetensors" in files
    assert {name for name in files if name.endswith(".py")} == ENCODER_CODE_FILES
    assert code_closure(folder, ENCODER_ENTRY_FILES) == ENCODER_CODE_FILES  # imports resolve inside the folder
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "alibi_bert" and config["auto_map"] == AUTO_MAP
    assert_auto_map_names_classes_in(folder, AUTO_MAP)


LOADER = r"""
import sys
sys.modules["hf_alibi"] = None  # the installed package must not be importable: everything comes from the folder
import torch
from transformers import AutoModel, AutoModelForMaskedLM

torch.set_num_threads(1)
folder, inputs, output = sys.argv[1:]
ids, mask = torch.load(inputs)
mlm = AutoModelForMaskedLM.from_pretrained(folder, trust_remote_code=True).eval()
base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    result = {"logits": mlm(ids, attention_mask=mask).logits, "hidden": base(ids, attention_mask=mask).last_hidden_state}
result |= {"slopes": base.alibi_slopes, "modules": [type(mlm).__module__, type(base).__module__]}
torch.save(result, output)
"""


@pytest.mark.slow
def test_fresh_process_without_hf_alibi_loads_the_encoder_with_trust_remote_code(saved, tmp_path):
    model, folder = saved
    ids = torch.randint(1, 100, (2, 300))  # past the split's first block: the shared core's fast path runs remotely
    mask = torch.ones_like(ids)
    mask[1, 200:] = 0
    torch.save((ids, mask), tmp_path / "inputs.pt")
    run_without_hf_alibi(LOADER, [str(folder), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], tmp_path)
    result = torch.load(tmp_path / "out.pt")
    assert all(module.startswith("transformers_modules") for module in result["modules"]), result["modules"]
    with torch.no_grad():
        expected_logits = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(result["logits"], expected_logits, atol=0, rtol=0)
    assert result["hidden"].shape == (2, 300, 48)  # the bare model: its pooler is new (not in the MLM checkpoint)
    torch.testing.assert_close(result["slopes"], get_alibi_slopes(6), atol=0, rtol=0)
