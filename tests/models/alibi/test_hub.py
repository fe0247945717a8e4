"""The Hub path: what save_pretrained / push_to_hub ship; loading it with trust_remote_code where hf_alibi is absent."""

import ast
import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers.utils.hub as transformers_hub
from huggingface_hub import CommitInfo, HfApi, RepoUrl

import hf_alibi
from hf_alibi import get_alibi_slopes

PACKAGE = Path(hf_alibi.__file__).parent / "models" / "alibi"  # the one folder a checkpoint's code comes from
AUTO_CLASSES = {
    "AutoConfig",
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
}
ENTRY_FILES = ("configuration_alibi_gpt2.py", "modeling_alibi_gpt2.py")
ENCODER_ENTRY_FILES = ("configuration_alibi_bert.py", "modeling_alibi_bert.py")  # the encoder's (test_hub_alibi_bert)


def imports(path: Path) -> tuple[set[str], set[str]]:
    """(files imported relatively, absolute imports of hf_alibi) in a Python file."""
    relative, absolute = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            relative.add(f"{node.module}.py")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "hf_alibi":
            absolute.add(node.module)
        elif isinstance(node, ast.Import):
            absolute.update(a.name for a in node.names if a.name.split(".")[0] == "hf_alibi")
    return relative, absolute


def code_closure(folder: Path, entry_files=ENTRY_FILES) -> set[str]:
    """The entry files and everything they import relatively, followed recursively inside `folder`."""
    needed, todo = set(), list(entry_files)
    while todo:
        name = todo.pop()
        if name not in needed:
            needed.add(name)
            todo.extend(imports(folder / name)[0])
    return needed


CODE_FILES = code_closure(PACKAGE)


# The default family, and the switches an imported BLOOM/MPT checkpoint carries (they must ship in the remote code).
SWITCHES = {"default": {}, "bloom_and_mpt_switches": dict(embedding_layernorm=True, bias=False, clip_qkv=0.5)}


@pytest.fixture(params=list(SWITCHES))
def saved(make_model, tmp_path, request):
    model = make_model(alibi_max_bias=4.0, **SWITCHES[request.param])
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    return model, folder


def test_the_model_folder_holds_exactly_what_every_checkpoint_carries():
    """One `ls` shows a checkpoint's code: the folder's modules are the decoder's and the encoder's entry files'
    relative-import closures (the attention core they share is in both)."""
    shipped = CODE_FILES | code_closure(PACKAGE, ENCODER_ENTRY_FILES)
    assert {path.name for path in PACKAGE.glob("*.py")} - {"__init__.py"} == shipped


@pytest.mark.parametrize("entry", ENTRY_FILES + ENCODER_ENTRY_FILES)
def test_each_entry_file_imports_its_whole_closure_directly(entry):
    """transformers before 5.10 copies into its module cache only the files a remote-code entry file imports itself:
    a module reached only through another one would be missing there (FileNotFoundError in the module cache)."""
    indirect = code_closure(PACKAGE, (entry,)) - imports(PACKAGE / entry)[0] - {entry}
    assert not indirect, f"{entry} reaches {sorted(indirect)} only through other modules: import each directly"


def test_importing_the_package_aliases_no_module_in_sys_modules():
    """The model's modules live in `hf_alibi.models.alibi` only: importing `hf_alibi` registers no second name
    for them (the old flat `hf_alibi.modeling_alibi_gpt2` and friends are gone, not aliased)."""
    code = "import json, sys, hf_alibi; print(json.dumps(sorted(sys.modules)))"
    loaded = set(
        json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    )
    aliases = {f"hf_alibi.{name[:-3]}" for name in CODE_FILES | set(ENCODER_ENTRY_FILES)} & loaded
    assert not aliases, f"importing hf_alibi registered module aliases: {sorted(aliases)}"


# What code a checkpoint ships must not do: change process-wide state (threads' floating-point modes, the module table,
# function signatures) or store its own state on transformers' objects
PROCESS_WIDE = ("ctypes", "set_flush_denormal", "fesetenv", "sys.modules", "__signature__", "setattr(cache")


def test_shipped_code_changes_no_process_wide_state():
    offenders = {name: [word for word in PROCESS_WIDE if word in (PACKAGE / name).read_text()] for name in CODE_FILES}
    offenders = {name: words for name, words in offenders.items() if words}
    assert not offenders, f"process-wide tricks in the shipped folder: {offenders}"


def test_package_code_files_import_each_other_only_relatively():
    assert {"alibi_bias.py", "attention_alibi.py"} <= CODE_FILES
    offenders = {name: imports(PACKAGE / name)[1] for name in CODE_FILES if imports(PACKAGE / name)[1]}
    assert not offenders, f"absolute hf_alibi imports break remote-code loading: {offenders}"


def test_save_pretrained_writes_safetensors_config_with_auto_map_and_all_code(saved):
    _, folder = saved
    files = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in files and not any(f.endswith(".bin") for f in files), files
    assert files >= CODE_FILES, f"missing code files: {CODE_FILES - files}"
    assert code_closure(folder) == CODE_FILES  # the saved copies resolve their relative imports inside the folder
    offenders = {name: imports(folder / name)[1] for name in CODE_FILES if imports(folder / name)[1]}
    assert not offenders, f"absolute hf_alibi imports in saved code: {offenders}"
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert set(auto_map) >= AUTO_CLASSES, f"auto_map lacks {AUTO_CLASSES - set(auto_map)}"
    assert_auto_map_names_classes_in(folder, auto_map)


def assert_auto_map_names_classes_in(folder: Path, auto_map: dict) -> None:
    """Every `auto_map` target ("module.Class") is a class defined in that module's file of the saved folder."""
    for target in auto_map.values():
        module, _, class_name = target.rpartition(".")
        assert f"class {class_name}(" in (folder / f"{module}.py").read_text(), target


def run_without_hf_alibi(loader: str, arguments: list[str], tmp_path: Path) -> None:
    """Run the Python source `loader` with `arguments` in a fresh process that cannot import hf_alibi (the loader
    blocks it), offline, from another folder and with `-P`: the checkpoint folder is not on sys.path, so only
    correct relative imports resolve."""
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir(exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env.pop("PYTHONPATH", None)
    command = [sys.executable, "-P", "-c", loader, *arguments]
    run = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]


LOADER = r"""
import sys
sys.modules["hf_alibi"] = None  # the installed package must not be importable: everything comes from the folder
import torch
from transformers import AutoModel, AutoModelForCausalLM

torch.set_num_threads(1)
folder, inputs, output = sys.argv[1:]
ids = torch.load(inputs)
lm = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
with torch.no_grad():
    result = {"logits": lm(ids).logits, "hidden": base(ids).last_hidden_state}
result |= {"lm_slopes": lm.transformer.alibi_slopes, "base_slopes": base.alibi_slopes}
result |= {"modules": [type(lm).__module__, type(base).__module__]}
torch.save(result, output)
"""


@pytest.mark.slow
def test_fresh_process_without_hf_alibi_loads_with_trust_remote_code(saved, tmp_path, random_ids):
    model, folder = saved
    ids = random_ids(2, 30)
    torch.save(ids, tmp_path / "ids.pt")
    run_without_hf_alibi(LOADER, [str(folder), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], tmp_path)
    result = torch.load(tmp_path / "out.pt")
    assert all(m.startswith("transformers_modules") for m in result["modules"]), result["modules"]
    with torch.no_grad():
        expected_logits = model(ids).logits
        expected_hidden = model.transformer(ids).last_hidden_state
    torch.testing.assert_close(result["logits"], expected_logits, atol=0, rtol=0)
    torch.testing.assert_close(result["hidden"], expected_hidden, atol=0, rtol=0)
    for key in ("lm_slopes", "base_slopes"):
        torch.testing.assert_close(result[key], get_alibi_slopes(12, 4.0), atol=0, rtol=0)


def test_push_to_hub_uploads_exactly_what_a_hub_user_needs_without_network(saved, monkeypatch):
    model, folder = saved
    calls, uploaded = [], {}

    def no_network(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    for name in ("connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, repo_id, operations, **kwargs):
        calls.append(("create_commit", repo_id))
        for operation in operations:  # read now: push_to_hub deletes its temporary folder afterwards
            uploaded[operation.path_in_repo] = Path(operation.path_or_fileobj).read_bytes()
        return CommitInfo(f"https://huggingface.co/{repo_id}/commit/0", "Upload model", "", "0" * 40)

    def unexpected(self, *args, **kwargs):
        raise AssertionError("push_to_hub took an upload path this test does not record")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    for name, method in (("create_repo", create_repo), ("create_commit", create_commit)):
        if hasattr(transformers_hub, name):  # transformers before 5.10 calls huggingface_hub's module-level functions
            monkeypatch.setattr(transformers_hub, name, functools.partial(method, None))
    for name in ("upload_folder", "upload_file", "create_branch", "preupload_lfs_files"):
        monkeypatch.setattr(HfApi, name, unexpected)

    model.push_to_hub("user/repo")

    assert calls == [("create_repo", "user/repo"), ("create_commit", "user/repo")]
    expected = {"config.json", "model.safetensors", "generation_config.json", "README.md"} | CODE_FILES
    assert set(uploaded) == expected, f"extra: {set(uploaded) - expected}; missing: {expected - set(uploaded)}"
    assert set(json.loads(uploaded["config.json"])["auto_map"]) >= AUTO_CLASSES
    # the upload is byte for byte what save_pretrained writes, which the remote-code test loads without hf_alibi
    differing = [name for name in expected - {"README.md"} if uploaded[name] != (folder / name).read_bytes()]
    assert not differing, f"uploaded files differ from save_pretrained's: {differing}"
    assert b"library_name: transformers" in uploaded["README.md"]
