"""Every version-dependent transformers name the model folder uses, in one place: this folder ships beside each
checkpoint and must load on every transformers a user may have (4.57 and every 5.x for saved checkpoints; 5.0 and
newer for the installed package).

Each name says which releases it was checked against and what it falls back to; `tests/test_transformers_surface.py`
lists them. Only relative imports, model code only: nothing here changes process-wide state.
"""

import torch
import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(Version(transformers.__version__).base_version)


def transformers_at_least(minimum: str) -> bool:
    """Whether the installed transformers is `minimum` or newer (pre-releases of `minimum` count as `minimum`)."""
    return Version(minimum) <= TRANSFORMERS_VERSION


__all__ = ["TRANSFORMERS_VERSION", "transformers_at_least"]


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
            f"environment has transformers {transformers.__version__}: "
            f"pip install 'transformers>={TENSOR_PARALLEL_TRANSFORMERS},<6'"
        )


__all__ += [
    "ALL_PARALLEL_STYLES",
    "TENSOR_PARALLEL_SUPPORTED",
    "TENSOR_PARALLEL_TRANSFORMERS",
    "TensorParallelLayer",
    "require_tensor_parallel",
]
