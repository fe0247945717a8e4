"""Every version-dependent transformers name the model folder uses, in one place: this folder ships beside each
checkpoint and must load on every transformers a user may have (4.57 and every 5.x for saved checkpoints; 5.0 and
newer for the installed package).

Each name says which releases it was checked against and what it falls back to; `tests/test_transformers_surface.py`
lists them. Only relative imports, model code only: nothing here changes process-wide state.
"""

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(Version(transformers.__version__).base_version)


def transformers_at_least(minimum: str) -> bool:
    """Whether the installed transformers is `minimum` or newer (pre-releases of `minimum` count as `minimum`)."""
    return Version(minimum) <= TRANSFORMERS_VERSION


__all__ = ["TRANSFORMERS_VERSION", "transformers_at_least"]
