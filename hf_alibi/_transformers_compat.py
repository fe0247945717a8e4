"""Every private or version-dependent transformers name that hf_alibi uses outside the model folder, in one place.

hf_alibi supports transformers >= 5.0, < 6 (pyproject). A name that a release added, moved or changed is imported here
and nowhere else, with the releases it was checked against; `tests/test_transformers_surface.py` lists them. The model
folder that ships beside a checkpoint (`hf_alibi/models/alibi/`) has its own copy of this module
(`transformers_compat.py`), since remote code cannot import from the package.

A feature whose upstream piece is newer than the oldest supported release calls `require_transformers` once, at its
entry, and fails with one line naming the release it needs (never with a traceback from an import).
"""

import transformers
from packaging.version import Version

TRANSFORMERS_VERSION = Version(transformers.__version__)
MINIMUM_TRANSFORMERS = "5.0"  # pyproject's lower bound


def transformers_at_least(minimum: str) -> bool:
    """Whether the installed transformers is `minimum` or newer (pre-releases of `minimum` count as `minimum`)."""
    return Version(TRANSFORMERS_VERSION.base_version) >= Version(minimum)


def require_transformers(minimum: str, feature: str) -> None:
    """`ImportError` with one line saying that `feature` needs transformers >= `minimum`, when it is older."""
    if not transformers_at_least(minimum):
        raise ImportError(
            f"{feature} needs transformers>={minimum}; this environment has {transformers.__version__}: "
            f"pip install 'transformers>={minimum},<6'"
        )


__all__ = ["MINIMUM_TRANSFORMERS", "TRANSFORMERS_VERSION", "require_transformers", "transformers_at_least"]
