"""Every transformers name hf_alibi uses beyond transformers' public API, with the releases it covers: the two compat
modules hold them all (`hf_alibi/_transformers_compat.py` for the package, `hf_alibi/models/alibi/transformers_compat.py`
for the folder that ships beside each checkpoint), and nothing else in `hf_alibi/` imports one.

Supported: transformers >= 5.0, < 6 for the installed package; 4.57 and every 5.x for a saved checkpoint's code. The
hooks' behaviour is tested one test each in `tests/surface/` (model, tensor parallel, serving), on whichever release
is installed; `make compat` runs them on the lowest and the newest. Also here: pyproject's warning filters, under which
a deprecation warning pointing into hf_alibi fails the test.
"""

import ast
import warnings
from pathlib import Path

import pytest
from transformers.utils.deprecation import deprecate_kwarg

import hf_alibi
from hf_alibi import _transformers_compat as package_compat
from hf_alibi.models.alibi import transformers_compat as model_compat
from surface.surface_helpers import call_from

PACKAGE = Path(hf_alibi.__file__).parent
COMPAT_FILES = {PACKAGE / "_transformers_compat.py", PACKAGE / "models" / "alibi" / "transformers_compat.py"}
# What any module may import from transformers: the top-level API and the modules every model file uses as public
PUBLIC_MODULES = {
    "transformers",
    "transformers.activations",
    "transformers.modeling_outputs",
    "transformers.trainer_utils",
}
PUBLIC_NAMES = {("transformers.utils", "logging")}

# name -> the releases it was checked against, and what the others get (the compat modules' sections say more)
MODEL_SURFACE = {
    "TRANSFORMERS_VERSION": "every release; transformers_at_least compares with it",
    "transformers_at_least": "every release",
    "Conv1D": "transformers.pytorch_utils, 4.57-5.25",
    "GradientCheckpointingLayer": "transformers.modeling_layers, 4.57-5.25",
    "can_return_tuple": "transformers.utils, 4.57-5.25",
    "ConfigBase": "5.4+: PretrainedConfig (dataclass configs); 4.57-5.3: a keyword __init__ setting the same fields",
    "init": "5.0+: transformers.initialization; 4.57: torch.nn.init under no_grad",
    "was_loaded": "the `_is_hf_initialized` flag loading sets, 5.0-5.25 (4.57: absent, never loaded twice)",
    "model_inputs": "5.2+: merge_with_config_defaults + capture_outputs; 4.57-5.1: check_model_inputs",
    "OutputRecorder": "5.2+: utils.output_capturing; 4.57-5.1: utils.generic",
    "SwitchableAttention": "PreTrainedModel._can_set_attn_implementation, a classmethod in 4.57-5.25",
    "TiedHeadLoading": "PreTrainedModel.mark_tied_weights_as_initialized, overridden on 5.3 only (it left a tied head untied)",
    "CACHE_FIELD": "5.24+: `cache`; 4.57-5.23: `past_key_values`",
    "takes_past_key_values": "5.24+: deprecate_kwarg (warns); 4.57-5.23: renamed silently",
    "with_cache": "the output field of CACHE_FIELD",
    "output_cache": "the output field of CACHE_FIELD",
    "generate_mask_arguments": "create_masks_for_generate's arguments: 5.24+ cache=/inputs_embeds=, before past_key_values=/input_embeds=",
    "update_cache": "5.4+: Cache.update(k, v, layer); 4.57-5.3: with the new tokens' cache_position",
    "cache_key_length": "5.4+: get_mask_sizes(query_length, layer); 4.57-5.3: get_mask_sizes(cache_position, layer)",
    "find_packed_sequence_indices": "masking_utils, 5.0-5.25; 4.57: its all-zero answer for plain rows made None",
    "PagedAttentionCache": "generation.continuous_batching, 4.57-5.25",
    "check_continuous_batching": "continuous batching from 5.24 (tested: 5.24, 5.25); refused in one line before",
    "ALL_PARALLEL_STYLES": "transformers.distributed.tensor_parallel, 5.24-5.25; None before",
    "TensorParallelLayer": "transformers.distributed.tensor_parallel, 5.24-5.25; object before",
    "TENSOR_PARALLEL_SUPPORTED": "5.24+ with torch.distributed",
    "TENSOR_PARALLEL_TRANSFORMERS": "5.24: the oldest release tensor parallelism and FSDP2 are tested on",
    "require_tensor_parallel": "refuses sharding in one line before 5.24",
    "runs_unobserved": "torch.nn.Module's hook dicts and torch.nn.modules.module's global ones, torch 2.0-2.14 (any release)",
}
PACKAGE_SURFACE = {
    "TRANSFORMERS_VERSION": "every release",
    "MINIMUM_TRANSFORMERS": "pyproject's lower bound, 5.0",
    "transformers_at_least": "every release",
    "require_transformers": "every release: a feature newer than 5.0 refuses older ones in one line",
    "bloom_alibi_tensor": "models.bloom.modeling_bloom.build_alibi_tensor, 4.57-5.25",
    "falcon_alibi_tensor": "models.falcon.modeling_falcon.build_alibi_tensor, 4.57-5.25",
    "mpt_alibi_tensor": "models.mpt.modeling_mpt.build_mpt_alibi_tensor, 4.57-5.25",
    "special_token_ids": "4.57, 5.1-5.25: on every config; 5.0: absent from MptConfig unless given (read as None)",
    "config_from_dict": "GPT-NeoX's rotary share: 5.5-5.25 rope_parameters'; 5.0-5.4 rotary_pct's (0.25 unless given)",
    "TOKENIZER_ERRORS_UNMASKED": "5.6: the first release whose tokenizer errors reach the caller without protobuf",
    "auto_tokenizer": "5.6-5.25: AutoTokenizer's own error; 5.0-5.5 without protobuf: the ImportError's context",
    "named_tokenizer_inputs": "5.3-5.25: AutoTokenizer builds the class named; 5.0-5.2: TokenizersBackend's inputs",
    "distributed_config": "transformers.distributed.DistributedConfig, tp_size / fsdp_size from 5.13; used from 5.24",
    "SERVING_MINIMUM": "5.24: the oldest release hf-alibi serve builds on (tested: 5.24, 5.25)",
    "SERVING_MODEL_PROCESS": "5.25: the server runs its model in a process of its own",
    "serving_model_in_own_process": "5.25+",
    "serving_handler_classes": "cli.serving's handlers, 5.24-5.25",
    "serving_generation_state": "cli.serving.utils.GenerationState, 5.24-5.25",
    "serving_model_manager_class": "5.24: ModelManager loading through _load_model; 5.25+: ModelManager(loader=...)",
    "serving_model_loader_class": "5.25+: cli.serving.model_manager.ModelLoader",
    "serving_model_id_parts": "5.24: utils.split_revision; 5.25+: its replacement",
    "serving_processor": "the served model's tokenizer, 5.24-5.25",
    "serving_transcription_handler": "5.24: (manager, state); 5.25+: (manager)",
    "serving_build_server": "5.24: with the generation state; 5.25+: without",
    "serving_model_processes": "5.25+: the model's process",
    "serving_loading_error": "5.25+: the model process's errors as text, made the builtin error again",
    "serving_stop_generation": "5.24-5.25",
}


@pytest.mark.parametrize(
    "module, surface", [(model_compat, MODEL_SURFACE), (package_compat, PACKAGE_SURFACE)], ids=["model", "package"]
)
def test_every_name_of_a_compat_module_is_listed_here_with_the_releases_it_covers(module, surface):
    assert set(module.__all__) == set(surface), (
        f"{module.__name__}: unlisted {sorted(set(module.__all__) - set(surface))}, "
        f"gone {sorted(set(surface) - set(module.__all__))}"
    )


def private_transformers_imports(path: Path) -> list[str]:
    """The imports of transformers names in `path` outside the public API (`PUBLIC_MODULES`, `PUBLIC_NAMES`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "transformers":
            if node.module not in PUBLIC_MODULES:
                names = [a.name for a in node.names if (node.module, a.name) not in PUBLIC_NAMES]
                found += [f"{node.module}.{name}" for name in names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("transformers.")]
    return found


def test_no_module_but_the_compat_modules_imports_a_private_transformers_name():
    offenders = {
        str(path.relative_to(PACKAGE)): names
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in COMPAT_FILES and (names := private_transformers_imports(path))
    }
    assert not offenders, f"import these through a compat module (and list them here): {offenders}"


def test_the_private_import_check_finds_what_it_must(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from transformers.models.bloom.modeling_bloom import build_alibi_tensor\nimport transformers.cli.serving\n"
        "from transformers import AutoModel\nfrom transformers.utils import logging\n"
    )
    assert private_transformers_imports(probe) == [
        "transformers.models.bloom.modeling_bloom.build_alibi_tensor",
        "transformers.cli.serving",
    ]


@deprecate_kwarg("old_name", "99.0.0", new_name="new_name")
def renamed_argument(new_name=None):
    return new_name


def test_transformers_deprecation_warning_from_our_code_fails_the_test_and_from_third_party_code_does_not():
    with pytest.raises(FutureWarning, match="old_name"):  # pyproject: error::FutureWarning:hf_alibi...
        call_from("hf_alibi.models.alibi.modeling_alibi_gpt2", renamed_argument, old_name=1)
    with pytest.raises(FutureWarning, match="old_name"):  # the remote-code copy saved beside a checkpoint
        call_from("transformers_modules.out.modeling_alibi_gpt2", renamed_argument, old_name=1)
    with warnings.catch_warnings(record=True) as caught:  # keeps pytest's filters; only records what they show
        assert call_from("datasets.builder", renamed_argument, old_name=1) == 1
        warnings.warn_explicit("old thing", DeprecationWarning, "third_party.py", 1, module="torch.serialization")
    assert [w.category for w in caught] in ([FutureWarning], [])  # shown or deduplicated, never raised
    with pytest.raises(DeprecationWarning):
        warnings.warn_explicit(
            "old thing",
            DeprecationWarning,
            "hf_alibi/models/alibi/alibi_bias.py",
            1,
            module="hf_alibi.models.alibi.alibi_bias",
        )
