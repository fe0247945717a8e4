"""Packaging: the wheel holds every file of the hf_alibi package (each subpackage, the model card template, the
experiment's configs) and the console script, and nothing else; its core needs torch, transformers and safetensors
only, the rest sits in extras. Installed alone into a fresh venv, it imports, saves, loads, converts and writes model
cards from another folder; with the extras' packages absent, the model still works, `import hf_alibi` loads no other
model family, and each feature that needs an extra fails naming it. Offline: the wheel is built without build
isolation and installed with --no-deps. Slow: it builds a wheel and runs fresh processes."""

import configparser
import email.parser
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hf_alibi._transformers_compat import SERVING_MINIMUM, transformers_at_least
from hf_alibi.import_utils import EXTRAS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
# A sitecustomize in the test venv: the modules named in HF_ALIBI_ABSENT cannot be imported, as if not installed.
ABSENT = """
import os, sys
for name in filter(None, os.environ.get("HF_ALIBI_ABSENT", "").split(",")):
    sys.modules[name] = None
"""
# What a core install (no extras) does: the model, conversion on first use, and a named extra for the rest.
CORE_USE = """
import json, sys
from pathlib import Path
import torch
import hf_alibi
from transformers import AutoModel, AutoModelForCausalLM

out = Path(sys.argv[1])
families = sorted(m for m in sys.modules if m.split(".")[:2] == ["transformers", "models"] and m.count(".") == 2)
model = hf_alibi.AlibiGPT2LMHeadModel(hf_alibi.AlibiGPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50)).eval()
model.save_pretrained(out / "core")
loaded = AutoModelForCausalLM.from_pretrained(out / "core").eval()
ids = torch.randint(0, 50, (1, 8))
generated = loaded.generate(ids, max_new_tokens=4, do_sample=False).shape[1]
encoder_config = hf_alibi.AlibiBertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=16, vocab_size=50)
encoder = hf_alibi.AlibiBertModel(encoder_config).eval()
encoder.save_pretrained(out / "encoder")
encoded = AutoModel.from_pretrained(out / "encoder").eval()(ids).last_hidden_state
errors = {}
from hf_alibi.serving import ServeOptions, build_app
for feature, call in {"experiments": lambda: __import__("hf_alibi.experiments"),
                      "gguf": lambda: hf_alibi.export(model, "gguf", out / "m.gguf", tokenizer=object()),
                      "serve": lambda: build_app(ServeOptions(str(out / "core")))}.items():
    try:
        call()
    except ImportError as exc:
        errors[feature] = str(exc)
print(json.dumps({"families_at_import": families, "convert": hf_alibi.convert.__module__, "generated": generated,
                  "logits_equal": torch.equal(model(ids).logits, loaded(ids).logits), "errors": errors,
                  "encoder_equal": torch.equal(encoder(ids).last_hidden_state, encoded)}))
"""
# What a checkout may hold beside the sources; the build works on a clean copy so its build/ and egg-info stay out.
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv",
    ".venv-compat",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".pytest_cache",
    ".cache",
    "runs",
    "outputs",
)
# Run by the venv's Python from another folder: the installed package only, every user-facing step once.
INSTALLED_USE = """
import json, sys
from pathlib import Path
import torch
import hf_alibi
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from hf_alibi.experiments.length.length_eval import evaluate_model
from hf_alibi.experiments.reporting.model_card import find_template, save_card

out = Path(sys.argv[1])
from hf_alibi.experiments.setup.arguments import resolve_config
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
    "cpu_demo_config": str(resolve_config("cpu_demo")),
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
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        str(tmp / "dist"),
        str(source),
    ]
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
    assert "hf_alibi/experiments/reporting/templates/alibi_gpt2.md" in shipped
    entry_points = configparser.ConfigParser()
    entry_points.read_string(zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode())
    assert entry_points["console_scripts"]["hf-alibi"] == "hf_alibi.cli:main"


def _venv_site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def test_wheel_core_needs_torch_transformers_safetensors_and_the_extras_hold_the_rest(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as archive:
        metadata_name = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(archive.read(metadata_name).decode())
    requirements: dict[str | None, set[str]] = {}
    for line in metadata.get_all("Requires-Dist"):
        requirement, _, marker = line.partition(";")
        extra = marker.split("==")[1].strip().strip("'\"") if marker else None
        # the name with the extras it asks for (`transformers[serving]`), without the version
        name = requirement.strip().split(">")[0].split("<")[0].split("=")[0].strip()
        requirements.setdefault(extra, set()).add(name)
    assert requirements[None] == {"torch", "transformers", "safetensors"}, requirements[None]
    for extra, modules in EXTRAS.items():  # the table behind the ImportErrors says what pyproject installs
        assert requirements[extra] == set(modules.values()), (extra, requirements[extra])
    # dev: every extra, the docs site's tools and the test suite's (no module of the package imports those: not in
    # EXTRAS); test alone is what `make compat` installs beside the extras of a release's own environment
    assert f"hf_alibi[{','.join(sorted({*EXTRAS, 'docs', 'test'}))}]" in requirements["dev"], requirements["dev"]
    assert {"pytest", "hypothesis", "openai"} <= requirements["test"] and "ruff" in requirements["dev"], requirements
    assert "hf_alibi/experiments/configs/cpu_demo.yaml" in zipfile.ZipFile(wheel).namelist()


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh venv holding only the wheel; dependencies come from the running environment (see below)."""
    import site

    wheel, _ = built
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    install = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        str(wheel),
    ]
    done = subprocess.run(install, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Dependencies (torch, transformers, ...) come from the running environment, listed after the venv's own
    # site-packages and without running its .pth files (so an editable hf_alibi there stays invisible).
    site_packages = _venv_site_packages(python)
    (site_packages / "test_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (site_packages / "sitecustomize.py").write_text(ABSENT)
    return venv, python


def _run_elsewhere(venv_python: Path, folder: Path, argv: list[str], absent: tuple[str, ...] = ()):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_ALIBI_ABSENT": ",".join(absent)}
    return subprocess.run([str(venv_python), *argv], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_wheel_installed_alone_in_a_fresh_venv_imports_loads_converts_and_writes_cards(venv, tmp_path):
    venv, python = venv
    done = _run_elsewhere(python, tmp_path, ["-P", "-c", INSTALLED_USE, str(tmp_path)])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["hf_alibi"]).is_relative_to(venv), report["hf_alibi"]
    assert Path(report["template"]).is_relative_to(venv), report["template"]
    assert Path(report["cpu_demo_config"]).is_relative_to(venv), report["cpu_demo_config"]
    assert report["loaded_class"] == "AlibiGPT2LMHeadModel" and report["max_logit_difference"] == 0.0
    assert report["converted_class"] == "AlibiGPT2LMHeadModel" and report["converted_wte_equal"]
    assert "model-index" in report["card"] and "alibi-tiny" in report["card"]

    script = venv / ("Scripts/hf-alibi.exe" if os.name == "nt" else "bin/hf-alibi")
    done = _run_elsewhere(python, tmp_path, [str(script), "convert", str(tmp_path / "gpt2"), str(tmp_path / "out")])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "alibi_gpt2"


def test_core_install_runs_the_model_imports_no_other_family_and_names_each_missing_extra(venv, tmp_path):
    venv, python = venv
    absent = ("datasets", "evaluate", "accelerate", "matplotlib", "gguf", "fastapi", "uvicorn")  # the extras' packages
    done = _run_elsewhere(python, tmp_path, ["-P", "-c", CORE_USE, str(tmp_path)], absent)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["families_at_import"] == ["transformers.models.auto"], report["families_at_import"]
    assert report["logits_equal"] and report["generated"] == 12
    assert report["encoder_equal"]  # the encoder saves and loads through AutoModel on a core install too
    assert report["convert"] == "hf_alibi.conversion.dispatch"  # loaded on first use, with no extra
    assert "pip install 'hf_alibi[experiments]'" in report["errors"]["experiments"], report["errors"]
    assert "pip install 'hf_alibi[gguf]'" in report["errors"]["gguf"], report["errors"]
    if transformers_at_least(SERVING_MINIMUM):  # the venv runs this environment's transformers
        assert "needs transformers[serving]" in report["errors"]["serve"], report["errors"]
        assert "pip install 'hf_alibi[serve]'" in report["errors"]["serve"], report["errors"]
    else:  # no serve extra installs beside an older one: the release it needs is what is missing
        assert f"hf-alibi serve needs transformers>={SERVING_MINIMUM}" in report["errors"]["serve"], report["errors"]
    script = venv / ("Scripts/hf-alibi.exe" if os.name == "nt" else "bin/hf-alibi")
    done = _run_elsewhere(python, tmp_path, [str(script), "train", "--config", "smoke"], absent)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("hf-alibi: error: ") and "hf_alibi[experiments]" in done.stderr, done.stderr
    assert not list(tmp_path.glob("runs*")), "nothing is written"
