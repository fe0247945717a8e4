"""Every version-dependent transformers name the model folder uses, in one place: this folder ships beside each
checkpoint and must load on every transformers a user may have (4.57 and every 5.x for saved checkpoints; 5.0 and
newer for the installed package).

Each section says which releases it was checked against (their sources, 4.57.6 and every 5.x minor to 5.25.0) and
what the older ones get instead; `tests/test_transformers_surface.py` lists the names. The era boundaries:

| release | what changed that the model reads |
|---|---|
| 5.0 | `transformers.initialization` (4.57: `torch.nn.init`, and loading initialises only what it did not load) |
| 5.2 | `merge_with_config_defaults` + `utils.output_capturing.capture_outputs` (before: `check_model_inputs`, both in one) |
| 5.4 | dataclass configs (before: a keyword `__init__`); `Cache.update(k, v, layer)` and `get_mask_sizes(query_length, layer)` (before: both take the new tokens' `cache_position`) |
| 5.24 | the cache argument and output field are `cache` (before: `past_key_values`, which `generate` passes) |

Only relative imports, model code only: nothing here changes process-wide state.
"""

import functools
import inspect
import warnings

import torch
import transformers
from packaging.version import Version
from torch.nn.modules import module as _torch_module
from transformers import Cache, PretrainedConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.masking_utils import find_packed_sequence_indices as _find_packed_sequence_indices
from transformers.modeling_layers import GradientCheckpointingLayer  # building blocks (below)
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.pytorch_utils import Conv1D
from transformers.utils import can_return_tuple

TRANSFORMERS_VERSION = Version(Version(transformers.__version__).base_version)


def installed_version() -> str:
    """transformers' `__version__`, read now: importing `transformers.modeling_layers` makes a new module object of
    the package (5.25), so a reference taken at import time may be a stale one."""
    import transformers as installed

    return installed.__version__


def transformers_at_least(minimum: str) -> bool:
    """Whether the installed transformers is `minimum` or newer (pre-releases of `minimum` count as `minimum`)."""
    return Version(minimum) <= TRANSFORMERS_VERSION


# --- Building blocks -----------------------------------------------------------------------------------------------
# Beyond transformers' top-level API, but the same in 4.57 and every 5.x to 5.25: GPT-2's `Conv1D` ((in, out) weights),
# the layer base that `gradient_checkpointing_enable` checkpoints, and the decorator behind `return_dict=False`.
# (`GradientCheckpointingLayer`, `Conv1D`, `can_return_tuple`: imported at the top)

# --- Configuration -------------------------------------------------------------------------------------------------
# 5.4+: `PreTrainedConfig` makes every subclass a keyword-only dataclass: annotated class attributes are its fields,
# other keyword arguments reach `__post_init__(**kwargs)`, which ends in `PreTrainedConfig.__post_init__`.
# 4.57-5.3: a keyword `__init__`, no fields. `ConfigBase` gives a config written the 5.4 way the same behaviour there.
if transformers_at_least("5.4"):
    ConfigBase = PretrainedConfig
else:

    class ConfigBase(PretrainedConfig):
        """4.57-5.3: sets the subclasses' annotated fields from the keyword arguments (or their defaults), then calls
        `__post_init__` with the others, as 5.4's dataclass configs do; `PretrainedConfig.__init__` runs last, from
        this class's `__post_init__`, with the fields it also knows (token ids, `tie_word_embeddings`)."""

        def __init__(self, **kwargs):
            for name, default in _config_fields(type(self)).items():
                setattr(self, name, kwargs.pop(name, default))
            self.__post_init__(**kwargs)

        def __post_init__(self, **kwargs):
            known = inspect.signature(PretrainedConfig.__init__).parameters
            shared = {name: getattr(self, name) for name in _config_fields(type(self)) if name in known}
            PretrainedConfig.__init__(self, **shared, **kwargs)


def _config_fields(config_class: type) -> dict:
    """The annotated class attributes of `config_class` and its bases below `PretrainedConfig`, with their defaults."""
    fields = {}
    for klass in reversed(config_class.__mro__):
        if issubclass(klass, PretrainedConfig) and klass not in (PretrainedConfig, ConfigBase):
            fields.update({name: getattr(klass, name) for name in vars(klass).get("__annotations__", {})})
    return fields


# --- Weight initialisation -----------------------------------------------------------------------------------------
# 5.0+: `transformers.initialization` (`normal_`, `zeros_`, `ones_`, `copy_`), which leave tensors that loading
# flagged `_is_hf_initialized` alone. 4.57: `torch.nn.init` under no_grad; 4.57's loading calls `_init_weights` only
# on modules it did not load in full.
try:
    from transformers import initialization as init
except ImportError:  # 4.57
    from types import SimpleNamespace

    def _copy_(tensor: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return tensor.copy_(other)

    init = SimpleNamespace(
        normal_=torch.nn.init.normal_, zeros_=torch.nn.init.zeros_, ones_=torch.nn.init.ones_, copy_=_copy_
    )


def was_loaded(tensor: torch.Tensor) -> bool:
    """Whether `from_pretrained` filled `tensor` from the checkpoint: the flag `transformers.initialization` reads (5.0+;
    `PreTrainedModel._init_weights` reads it the same way before zeroing an embedding's padding row, a view that does
    not carry it)."""
    return getattr(tensor, "_is_hf_initialized", False)


# --- Tied heads of a model registered for the Auto classes -----------------------------------------------------------
# 5.3 only: `mark_tied_weights_as_initialized` flags each tied target as loaded, then, for a model whose class has an
# `_auto_class` (ours: `register_for_auto_class`, installed or as remote code), drops every flagged key from the missing
# keys, tied targets included; `tie_weights` then reads the head as present in the checkpoint and leaves it untied, as
# allocated. 5.4 keeps known tied targets missing (the same filter plus `key in self.all_tied_weights_keys`).
class TiedHeadLoading:
    """Mixed in before `PreTrainedModel`: on transformers 5.3, a tied head missing from the checkpoint stays missing,
    so `from_pretrained` ties it to the embeddings as 5.2 and 5.4+ do."""

    if TRANSFORMERS_VERSION.release[:2] == (5, 3):

        def mark_tied_weights_as_initialized(self, loading_info):
            tied_missing = set(loading_info.missing_keys) & self.all_tied_weights_keys.keys()
            super().mark_tied_weights_as_initialized(loading_info)
            loading_info.missing_keys = set(loading_info.missing_keys) | tied_missing


# --- Forward decorators --------------------------------------------------------------------------------------------
# 5.2+: `merge_with_config_defaults` (use_cache from the config) then `capture_outputs` (hidden states and attention
# weights recorded by hooks from `_can_record_outputs`, `return_dict`). 4.57-5.1: `check_model_inputs` did both.
try:
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import OutputRecorder, capture_outputs

    def model_inputs(forward):
        """transformers' decorators of a base model's forward: config defaults, recorded outputs, `return_dict`."""
        return merge_with_config_defaults(capture_outputs(forward))

except ImportError:  # 4.57-5.1
    from transformers.utils.generic import OutputRecorder
    from transformers.utils.generic import check_model_inputs as model_inputs


# --- Switching attention at runtime --------------------------------------------------------------------------------
# `set_attn_implementation` asks `PreTrainedModel._can_set_attn_implementation()` (a classmethod in every release),
# which guesses from the model file's source: an `*Attention(nn.Module)` class must index `ALL_ATTENTION_FUNCTIONS`.
# 5.14+ read a cached answer first; 4.57-5.13 only guess, and refuse our file.
class SwitchableAttention:
    """Mixed in before `PreTrainedModel`: every forward reads `config._attn_implementation` (the model plans its
    own attention), so `set_attn_implementation` may switch the backend at any time."""

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True


# --- The cache's name ----------------------------------------------------------------------------------------------
# 5.24+: forwards take `cache=` and outputs carry `.cache` (`past_key_values` is the deprecated name until 5.40, and
# warns). Before 5.24 both are `past_key_values`, the name `generate` passes and reads back.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def takes_past_key_values(forward):
    """Decorate a forward whose cache argument is `cache`: on 5.24+ `past_key_values=` is renamed with transformers'
    FutureWarning, as its own models do; before 5.24 it is the current name, renamed silently. `cache` wins when
    both are given, with a warning."""
    if CACHE_FIELD == "cache":
        from transformers.utils.deprecation import deprecate_kwarg

        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def renamed(*args, **kwargs):
        if "past_key_values" in kwargs:
            past_key_values = kwargs.pop("past_key_values")
            if kwargs.get("cache") is not None and past_key_values is not None:
                warnings.warn("Both `past_key_values` and `cache` are set: using `cache`", UserWarning, stacklevel=2)
            else:
                kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return renamed


def with_cache(cache: Cache | None) -> dict:
    """The keyword that puts `cache` into a transformers model output of the installed release."""
    return {CACHE_FIELD: cache}


def output_cache(outputs) -> Cache | None:
    """The cache a transformers model output holds (`.cache`, or `.past_key_values` before 5.24)."""
    return getattr(outputs, CACHE_FIELD)


def generate_mask_arguments(cache, inputs_embeds, kwargs: dict) -> tuple:
    """(cache, inputs_embeds) of a `create_masks_for_generate` call: 5.24+ passes them as `cache=` and
    `inputs_embeds=`, earlier releases as `past_key_values=` and `input_embeds=` (in `kwargs`)."""
    return kwargs.get("past_key_values", cache), kwargs.get("input_embeds", inputs_embeds)


# --- The cache API -------------------------------------------------------------------------------------------------
# 5.4+: `Cache.update(key, value, layer_idx)` appends (a static cache at its own count) and
# `get_mask_sizes(query_length, layer_idx)`. 4.57-5.3: both take the new tokens' `cache_position`: a static cache
# writes its slots at those positions (without them, from slot 0) and a dynamic cache counts their number.
POSITIONAL_CACHE = "cache_position" in inspect.signature(Cache.get_mask_sizes).parameters


def _cache_positions(query_offset: int | torch.Tensor, query_length: int, device) -> torch.Tensor:
    return torch.arange(query_length, device=device) + query_offset  # (q,) absolute positions of the new tokens


def update_cache(cache: Cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, query_offset):
    """`cache.update` with the new keys and values (B, H, q, D) of the tokens at `query_offset`...: every key and
    value the layer reads, (B, H, kv, D)."""
    if POSITIONAL_CACHE:
        positions = _cache_positions(query_offset, key.shape[-2], key.device)
        return cache.update(key, value, layer_idx, {"cache_position": positions})
    return cache.update(key, value, layer_idx)


def cache_key_length(cache: Cache, query_length: int, query_offset) -> int:
    """How many keys the layers read once `query_length` new tokens join `cache` (a static cache: its buffer)."""
    if POSITIONAL_CACHE:
        device = query_offset.device if isinstance(query_offset, torch.Tensor) else None
        return cache.get_mask_sizes(_cache_positions(query_offset, query_length, device), 0)[0]
    return cache.get_mask_sizes(query_length, 0)[0]


# --- Packed rows ---------------------------------------------------------------------------------------------------
# 5.0+: `masking_utils.find_packed_sequence_indices` gives None for unpacked rows outside tracing; 4.57 gives all-zero
# indices, which would send every row down the packed path: None there too.
if transformers_at_least("5.0"):
    find_packed_sequence_indices = _find_packed_sequence_indices
else:

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        """4.57: transformers' document index of each token, None for rows that do not restart (outside tracing)."""
        documents = _find_packed_sequence_indices(position_ids)
        if torch.compiler.is_compiling() or bool(documents[:, -1].any()):
            return documents
        return None


# --- Continuous batching -------------------------------------------------------------------------------------------
# `PagedAttentionCache` (`generation.continuous_batching`) exists in every supported release; the model reads the
# batch description of 5.24+ (`attention_paged.PAGED_KWARGS`).
CONTINUOUS_BATCHING_MINIMUM = "5.24"


def check_continuous_batching() -> None:
    """`ImportError` in one line when the installed transformers predates the continuous batching the model reads."""
    if not transformers_at_least(CONTINUOUS_BATCHING_MINIMUM):
        raise ImportError(
            f"continuous batching (generate_batch, a paged cache) needs transformers>={CONTINUOUS_BATCHING_MINIMUM}; "
            f"this environment has {installed_version()}: pip install 'transformers>={CONTINUOUS_BATCHING_MINIMUM},<6'"
        )


# --- Hooks (torch) -------------------------------------------------------------------------------------------------
# torch.nn.Module keeps a module's hooks, and every module's global ones, in these private dicts, the names its own
# `Module._call_impl` reads to call `forward` and nothing else when all are empty: the same in torch 2.0 to 2.14.
_GLOBAL_HOOKS = (
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
)
_MODULE_HOOKS = ("_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_pre_hooks")


def runs_unobserved(module: torch.nn.Module) -> bool:
    """Whether calling `module` runs its class's `forward` and nothing else: no hook on it or on every module (torch's
    own no-hook test), and no wrapper set on the instance (accelerate's `add_hook_to_module` replaces `forward`
    there). Then nothing outside the caller sees its inputs or its output. Missing names (another torch) count as
    observed."""
    if "forward" in vars(module):
        return False
    try:
        hooks = [getattr(module, name) for name in _MODULE_HOOKS]
        hooks += [getattr(_torch_module, name) for name in _GLOBAL_HOOKS]
    except AttributeError:
        return False
    return not any(hooks)


__all__ = [
    "CACHE_FIELD",
    "Conv1D",
    "GradientCheckpointingLayer",
    "can_return_tuple",
    "ConfigBase",
    "OutputRecorder",
    "PagedAttentionCache",
    "SwitchableAttention",
    "TiedHeadLoading",
    "TRANSFORMERS_VERSION",
    "cache_key_length",
    "check_continuous_batching",
    "find_packed_sequence_indices",
    "generate_mask_arguments",
    "init",
    "model_inputs",
    "output_cache",
    "runs_unobserved",
    "takes_past_key_values",
    "transformers_at_least",
    "update_cache",
    "was_loaded",
    "with_cache",
]


# ---------------------------------------------------------------------------------------------------------------------
# Tensor parallel (`tensor_parallel_alibi_gpt2.py`; FSDP2 rides on the same engine)
# ---------------------------------------------------------------------------------------------------------------------
# Our Conv1D styles subclass transformers' style base and register by name in its table of styles, as 5.24 and 5.25
# define them in `transformers.distributed.tensor_parallel`: hooks `shard_param(module, param, mesh)`,
# `install_forward(module, mesh)`, `transform_inputs_pre_forward`, `context_around_forward`,
# `transform_output_post_forward(module, output, mesh)`; 5.25 adds keywords (`config=`, `mesh_manager=` to the first
# two, `config=` to the last), which the styles accept and 5.24 never passes. Older: 5.16-5.23 have that module, with
# an engine around it the styles were never run on (5.23's tensor_parallel.py is 5.24's; untested all the same), and
# 4.57-5.15 only `transformers.integrations.tensor_parallel`, whose styles are another API. There nothing is
# registered, the model runs on one device, and `require_tensor_parallel` refuses a request to shard it.

TENSOR_PARALLEL_TRANSFORMERS = "5.24"  # the oldest release the styles, TP and FSDP2 are tested on (5.24.0, 5.25.0)
TENSOR_PARALLEL_SUPPORTED = transformers_at_least(TENSOR_PARALLEL_TRANSFORMERS) and torch.distributed.is_available()

if TENSOR_PARALLEL_SUPPORTED:
    # 5.24-5.25: the table plans are validated against and applied from (`ALL_PARALLEL_STYLES.register(name, style)`),
    # and the base class whose `install_forward` wraps a module's forward in our pre / around / post hooks
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
else:  # 4.57-5.23, or a torch without torch.distributed: no table to register in, a base with no behaviour
    ALL_PARALLEL_STYLES = None
    TensorParallelLayer = object


def require_tensor_parallel(feature: str) -> None:
    """`ImportError` with one line saying that `feature` needs transformers >= `TENSOR_PARALLEL_TRANSFORMERS`, on a
    transformers (or torch) where the model's parallel styles are not registered."""
    if not TENSOR_PARALLEL_SUPPORTED:
        raise ImportError(
            f"{feature} needs transformers>={TENSOR_PARALLEL_TRANSFORMERS} and a torch with torch.distributed; this "
            f"environment has transformers {installed_version()}: "
            f"pip install 'transformers>={TENSOR_PARALLEL_TRANSFORMERS},<6'"
        )


__all__ += [
    "ALL_PARALLEL_STYLES",
    "TENSOR_PARALLEL_SUPPORTED",
    "TENSOR_PARALLEL_TRANSFORMERS",
    "TensorParallelLayer",
    "require_tensor_parallel",
]
