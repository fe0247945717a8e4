"""Packaging: the wheel holds every file of the hf_alibi package (each subpackage, the model card template) and the
console script, and nothing else; installed alone into a fresh venv, it imports, saves, loads, converts and writes
model cards from another folder. Offline: the wheel is built without build isolation and installed with --no-deps."""

import configparser
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# What a checkout may hold beside the sources; the build works on a clean copy so its build/ and egg-info stay out.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".cache", "runs", "outputs"
)
# Run by the venv's Python from another folder: the installed package only, every user-facing step once.
INSTALLED_USE = """
import json, sys
from pathlib import Path
import torch
import hf_alibi
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from hf_alibi.experiments.length_eval import evaluate_model
from hf_alibi.experiments.model_card import find_template, save_card

out = Path(sys.argv[1])
torch.manual_seed(0)
model = hf_alibi.AlibiGPT2LMHeadModel(hf_alibi.AlibiGPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)).eval()
model.save_pretrained(out / "alibi")
loaded = AutoModelForCausalLM.from_pretrained(out / "alibi").eval()
ids = torch.randint(0, 50, (1, 12))
gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)).eval()
gpt2.save_pretrained(out / "gpt2")
converted = hf_alibi.convert_gpt2(gpt2)
evaluation = evaluate_model(loaded, [torch.randint(0, 50, (70,))], [8, 16], name="alibi-tiny", train_length=8)
readme = save_card(out / "alibi", evaluation, model_name="alibi-tiny")
print(json.dumps({
    "hf_alibi": hf_alibi.__file__,
    "template": str(find_template()),
    "loaded_class": type(loaded).__name__,
    "max_logit_difference": (model(ids).logits - loaded(ids).logits).abs().max().item(),
    "converted_class": type(converted).__name__,
    "converted_wte_equal": torch.equal(converted.transformer.wte.weight, gpt2.transformer.wte.weight),
    "card": readme.read_text(),
}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(wheel path, the source copy it was built from)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (the dev extra has it): no offline wheel build without isolation")
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", str(tmp / "dist"), str(source)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("hf_alibi-*.whl")
    return wheel, source


def test_wheel_holds_every_package_file_the_template_and_the_console_script_and_nothing_else(built):
    from setuptools import find_namespace_packages

    wheel, source = built
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = next(name.split("/")[0] for name in names if name.endswith(".dist-info/METADATA"))
    assert {name.split("/")[0] for name in names} == {"hf_alibi", dist_info}, "only the package ships (no tests/, ...)"
    sources = {p.relative_to(source).as_posix() for p in (source / "hf_alibi").rglob("*") if p.is_file()}
    shipped = {name for name in names if not name.startswith(dist_info)}
    assert shipped == sources, f"missing: {sorted(sources - shipped)}, extra: {sorted(shipped - sources)}"
    packages = find_namespace_packages(str(source), include=["hf_alibi", "hf_alibi.*"], exclude=["*.__pycache__"])
    assert {"hf_alibi", "hf_alibi.experiments", "hf_alibi.conversion"} <= set(packages)
    for package in packages:  # each subpackage setuptools finds has its files in the wheel
        assert any(name.startswith(package.replace(".", "/") + "/") for name in shipped), package
    assert "hf_alibi/experiments/templates/alibi_gpt2.md" in shipped
    entry_points = configparser.ConfigParser()
    entry_points.read_string(zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["hf-alibi"] == "hf_alibi.cli:main"


def _venv_site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip())


@pytest.mark.slow
def test_wheel_installed_alone_in_a_fresh_venv_imports_loads_converts_and_writes_cards(built, tmp_path):
    import site

    wheel, _ = built
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
               str(wheel)]  # fmt: skip
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Dependencies (torch, transformers, ...) come from the running environment, listed after the venv's own
    # site-packages and without running its .pth files (so an editable hf_alibi there stays invisible).
    (_venv_site_packages(python) / "test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")} | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run([str(python), "-P", "-c", INSTALLED_USE, str(elsewhere)], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["hf_alibi"]).is_relative_to(venv), report["hf_alibi"]
    assert Path(report["template"]).is_relative_to(venv), report["template"]
    assert report["loaded_class"] == "AlibiGPT2LMHeadModel" and report["max_logit_difference"] == 0.0
    assert report["converted_class"] == "AlibiGPT2LMHeadModel" and report["converted_wte_equal"]
    assert "model-index" in report["card"] and "alibi-tiny" in report["card"]

    script = venv / ("Scripts/hf-alibi.exe" if os.name == "nt" else "bin/hf-alibi")
    done = subprocess.run([str(script), "convert", str(elsewhere / "gpt2"), str(elsewhere / "converted")],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((elsewhere / "converted" / "config.json").read_text())["model_type"] == "alibi_gpt2"
