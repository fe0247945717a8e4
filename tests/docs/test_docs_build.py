"""The docs site builds with `mkdocs build --strict`: a broken link between pages, a missing plot, a missing included
file or an API reference that does not resolve fails the suite (mkdocs.yml; the `docs` extra installs mkdocs)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs")


def test_docs_site_builds_strict(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),  # Material's banner about MkDocs 2.0: not this build's news
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
