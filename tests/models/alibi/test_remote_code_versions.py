"""A saved checkpoint opens without hf_alibi on every transformers its users may have: the code `save_pretrained`
writes loads with `trust_remote_code=True`, from a local folder and from a Hub snapshot, and gives the installed
model's logits (within 1e-5) and greedy tokens, for the decoder and the encoder, on eager and sdpa.

The interpreters are this one and those named (space-separated) in `HF_ALIBI_REMOTE_CODE_PYTHONS`: `make compat`
names virtual environments of transformers 4.57, 5.0 and the newest release, each without hf_alibi installed.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_config_kwargs, tiny_encoder_kwargs
from hf_alibi import AlibiBertConfig, AlibiBertModel, AlibiGPT2Config, AlibiGPT2LMHeadModel

pytestmark = pytest.mark.slow

PYTHONS = [sys.executable, *os.environ.get("HF_ALIBI_REMOTE_CODE_PYTHONS", "").split()]
REPO_ID = "hf-alibi-tests/tiny"  # the Hub id of the snapshot laid out in a Hub cache below
COMMIT = "0123456789abcdef0123456789abcdef01234567"
NEW_TOKENS = 8

LOADER = r"""
import json, sys
sys.modules["hf_alibi"] = None  # the installed package must not be importable: everything comes from the folder
import torch, transformers
from transformers import AutoModel, AutoModelForCausalLM

torch.set_num_threads(1)
kind, source, inputs, output, new_tokens = sys.argv[1:]
ids, mask = torch.load(inputs)
result = {"transformers": transformers.__version__}
for backend in ("eager", "sdpa"):
    auto = AutoModelForCausalLM if kind == "decoder" else AutoModel
    model = auto.from_pretrained(source, trust_remote_code=True, attn_implementation=backend).eval()
    result["module"] = type(model).__module__
    if kind == "decoder":  # the head the checkpoint leaves out is the embeddings (5.3 left it as allocated)
        result[backend + "_tied"] = model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        if kind == "decoder":
            result[backend] = model(ids, attention_mask=mask).logits
            result[backend + "_tokens"] = model.generate(
                ids, attention_mask=mask, max_new_tokens=int(new_tokens), do_sample=False, pad_token_id=0
            )
        else:
            result[backend] = model(ids, attention_mask=mask).last_hidden_state
torch.save(result, output)
"""


def transformers_version(python: str) -> str:
    code = "import transformers; print(transformers.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def as_hub_snapshot(folder: Path, cache: Path) -> None:
    """Lay `folder` out as the Hub cache holds a download of `REPO_ID` (refs/main -> snapshots/<commit>), so an
    offline `from_pretrained(REPO_ID)` reads it the way it reads any Hub model: through the Hub branch of transformers'
    remote-code loader, which fetches each code file it needs by name."""
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(folder, repo / "snapshots" / COMMIT)


def saved_models(tmp_path: Path) -> dict:
    """The tiny decoder and encoder of the suite (weights drawn with std 0.3, so attention is not the bias alone),
    saved with their code."""
    torch.manual_seed(0)
    models = {
        "decoder": AlibiGPT2LMHeadModel(AlibiGPT2Config(**tiny_config_kwargs(vocab_size=128))).eval(),
        "encoder": AlibiBertModel(AlibiBertConfig(**tiny_encoder_kwargs(vocab_size=128))).eval(),
    }
    for kind, model in models.items():
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.normal_(0.0, 0.3)
        model.save_pretrained(tmp_path / kind)
    return models


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("remote_code")
    models = saved_models(tmp_path)
    ids = torch.randint(3, 128, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[0, :7], mask[0, :7] = 0, 0  # a left-padded row beside a full one
    torch.save((ids, mask), tmp_path / "inputs.pt")
    expected = {}
    with torch.no_grad():
        decoder, encoder = models["decoder"], models["encoder"]
        expected["decoder"] = decoder(ids, attention_mask=mask).logits
        expected["decoder_tokens"] = decoder.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        expected["encoder"] = encoder(ids, attention_mask=mask).last_hidden_state
    return tmp_path, expected


@pytest.mark.parametrize("python", PYTHONS, ids=lambda python: f"transformers-{transformers_version(python)}")
@pytest.mark.parametrize("source", ["folder", "hub_snapshot"])
@pytest.mark.parametrize("kind", ["decoder", "encoder"])
def test_a_saved_checkpoint_loads_without_hf_alibi_to_the_installed_models_outputs(checkpoints, python, source, kind):
    folder, expected = checkpoints
    work = Path(folder) / f"{kind}-{source}-{PYTHONS.index(python)}"
    work.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(work / "modules"), HF_HUB_CACHE=str(work / "hub"))
    env.pop("PYTHONPATH", None)
    location = str(folder / kind)
    if source == "hub_snapshot":
        as_hub_snapshot(folder / kind, work / "hub")
        location = REPO_ID
    command = [
        python,
        "-P",
        "-c",
        LOADER,
        kind,
        location,
        str(folder / "inputs.pt"),
        str(work / "out.pt"),
        str(NEW_TOKENS),
    ]
    run = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = torch.load(work / "out.pt")
    assert result["module"].startswith("transformers_modules"), result["module"]
    _, mask = torch.load(folder / "inputs.pt")
    real = mask.bool()  # the outputs at padding positions are nobody's
    scale = expected[kind][real].abs().max().item()
    for backend in ("eager", "sdpa"):
        difference = (result[backend][real] - expected[kind][real]).abs().max().item()
        assert difference <= 1e-5 * max(scale, 1.0), (
            f"transformers {result['transformers']}, {backend}: largest difference {difference:.3g} at scale {scale:.3g}"
        )
        if kind == "decoder":
            assert result[backend + "_tied"], f"transformers {result['transformers']}, {backend}: lm_head not tied"
            assert torch.equal(result[backend + "_tokens"], expected["decoder_tokens"]), (
                f"transformers {result['transformers']}, {backend}: greedy tokens differ"
            )
    assert json.loads((folder / kind / "config.json").read_text())["auto_map"]
