"""Loading a saved checkpoint's tokenizer in a fresh process: `AutoTokenizer` reads the folder's config.json first,
whose model type transformers knows only once `import hf_alibi` has registered it (or, without the package, through
the folder's own code with `trust_remote_code=True`). Either way nothing is printed. Before that import, transformers
itself asks whether to run the folder's code, then falls back to a bare config and warns "You are using a model of
type `alibi_gpt2` to instantiate a model of type ``": the behaviour of every checkpoint with custom code, which the
docs report with its fix (import first). These tests guard both, so the docs change when transformers does."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_alibi
from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel

pytestmark = pytest.mark.slow
# transformers' words, which README.md quotes (releases before 5.2 print them without the backticks: "type alibi_gpt2 ... type .")
WARNING = "You are using a model of type `?alibi_gpt2`? to instantiate a model of type (``|\\.)"
LOAD = "from transformers import AutoTokenizer; AutoTokenizer.from_pretrained({folder!r}{extra}).decode([5])"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from hf_alibi.experiments.data.tokenization import train_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer") / "alibi-tiny"
    tokenizer = train_tokenizer(["def add(x, y):\n    return x + y\n"] * 8, vocab_size=300)
    AlibiGPT2LMHeadModel(AlibiGPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=len(tokenizer))).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    return folder


def _stderr(code: str, cwd: Path, with_package: bool) -> str:
    """stderr of `python -P -c code` run in `cwd`, offline, stdin closed; hf_alibi importable or not."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "modules"), TRANSFORMERS_VERBOSITY="warning")
    env.pop("PYTHONPATH", None)
    if with_package:
        env["PYTHONPATH"] = str(Path(hf_alibi.__file__).resolve().parents[1])
    else:
        code = "import sys; sys.modules['hf_alibi'] = None\n" + code
    run = subprocess.run(
        [sys.executable, "-P", "-c", code],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stderr


def test_tokenizer_loads_silently_after_import_hf_alibi(folder, tmp_path):
    assert _stderr("import hf_alibi\n" + LOAD.format(folder=str(folder), extra=""), tmp_path, True) == ""


def test_tokenizer_loads_silently_with_trust_remote_code_and_no_package(folder, tmp_path):
    assert _stderr(LOAD.format(folder=str(folder), extra=", trust_remote_code=True"), tmp_path, False) == ""


def test_before_the_import_transformers_itself_warns_as_the_docs_say(folder, tmp_path):
    """transformers' fallback for a model type it does not know (README.md, below "Without hf_alibi installed")."""
    stderr = _stderr(LOAD.format(folder=str(folder), extra=""), tmp_path, True)
    assert re.search(WARNING, stderr), stderr
