"""The tensor-parallel styles on a transformers they were not written for (before 5.24; faked here, so no old release
is installed): the shipped folder's compat and styles modules import and register nothing, and a request to shard the
model fails in one line naming the release it needs, before transformers sets up anything."""

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from hf_alibi import AlibiGPT2Config, AlibiGPT2LMHeadModel
from hf_alibi.models.alibi import transformers_compat
from hf_alibi.models.alibi.tensor_parallel_alibi_gpt2 import check_sharding_request

FOLDER = Path(transformers_compat.__file__).parent
OLD_RELEASES = ["4.57.6", "5.0.0", "5.16.1", "5.23.0"]  # none of the parallel-style API, then its older engine
NEEDS = r"needs transformers>=5\.24 .*this environment has transformers 5\.23\.0: pip install 'transformers>=5\.24,<6'"


@pytest.fixture
def load_as_shipped(monkeypatch):
    """`load(version)`: the folder's styles module imported afresh as remote code imports it (a package of its own,
    relative imports) under a faked `transformers.__version__`; returns it and the style names it registered."""
    registered, packages = [], []
    if transformers_compat.TENSOR_PARALLEL_SUPPORTED:  # record registrations instead of making them
        table = type(transformers_compat.ALL_PARALLEL_STYLES)
        monkeypatch.setattr(table, "register", classmethod(lambda cls, name, style: registered.append(name)))

    def load(version: str):
        monkeypatch.setattr(transformers, "__version__", version)
        package = types.ModuleType(f"shipped_alibi_{len(packages)}")
        package.__path__ = [str(FOLDER)]
        monkeypatch.setitem(sys.modules, package.__name__, package)
        packages.append(package.__name__)
        return importlib.import_module(f"{package.__name__}.tensor_parallel_alibi_gpt2"), registered

    yield load
    for name in [name for name in sys.modules if name.split(".")[0] in packages]:
        del sys.modules[name]


@pytest.mark.parametrize("version", OLD_RELEASES)
def test_the_styles_module_imports_on_an_old_transformers_and_registers_nothing(load_as_shipped, version):
    styles, registered = load_as_shipped(version)
    assert not styles.TENSOR_PARALLEL_SUPPORTED and styles.TensorParallelLayer is object
    assert registered == []
    with pytest.raises(ImportError, match=NEEDS.replace("5\\.23\\.0", version.replace(".", "\\."))):
        styles.check_sharding_request({"tp_plan": "auto"})
    styles.check_sharding_request({"tp_size": 1, "torch_dtype": None})  # one rank: nothing to refuse


@pytest.mark.skipif(not transformers_compat.TENSOR_PARALLEL_SUPPORTED, reason="the installed transformers is old")
def test_the_styles_module_registers_the_plans_four_styles_on_a_supported_transformers(load_as_shipped):
    _, registered = load_as_shipped(transformers.__version__)
    assert sorted(registered) == ["alibi_heads", "conv1d_colwise", "conv1d_qkv_colwise", "conv1d_rowwise"]


@pytest.mark.parametrize(
    "arguments",
    [{"tp_plan": "auto"}, {"tp_size": 2}, {"device_mesh": object()}, {"distributed_config": {"fsdp_size": 2}}],
    ids=["tp_plan", "tp_size", "device_mesh", "distributed_config"],
)
def test_every_sharding_argument_of_from_pretrained_is_refused_by_name_on_an_old_transformers(monkeypatch, arguments):
    monkeypatch.setattr(transformers_compat, "TENSOR_PARALLEL_SUPPORTED", False)
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    with pytest.raises(ImportError, match=rf"Sharding ALiBi GPT-2 \({next(iter(arguments))}=\) {NEEDS}"):
        check_sharding_request(arguments)


def test_from_pretrained_refuses_tensor_parallelism_in_one_line_before_any_process_group(monkeypatch, tmp_path):
    config = AlibiGPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2, n_positions=8)
    AlibiGPT2LMHeadModel(config).save_pretrained(tmp_path)
    monkeypatch.setattr(transformers_compat, "TENSOR_PARALLEL_SUPPORTED", False)
    monkeypatch.setattr(transformers, "__version__", "5.23.0")
    for load in (AlibiGPT2LMHeadModel.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ImportError, match=NEEDS) as refused:
            load(tmp_path, tp_plan="auto")
        assert "\n" not in str(refused.value)
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    assert isinstance(AlibiGPT2LMHeadModel.from_pretrained(tmp_path), AlibiGPT2LMHeadModel)  # one device: unchanged
