"""Session fixtures of the serving tests: the tiny ALiBi checkpoint folder and its offline reference."""

from pathlib import Path

import pytest
from tiny_checkpoint import Reference, save_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serving") / "alibi-tiny")


@pytest.fixture(scope="session")
def reference(checkpoint) -> Reference:
    return Reference(checkpoint)
