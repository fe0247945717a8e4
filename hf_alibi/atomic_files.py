"""Atomic writes: a reader, or a run that crashes half-way, sees the old file or folder or the new one, never half.

Every writer here stages its output beside the destination (the same folder, so the final rename stays on one file
system, where `os.replace` is atomic), and a failure, an interrupt included, removes the staging copy:

    write_text_atomically(path, text)            # results, cards, benchmark reports
    write_file_atomically(path, write)           # `write(handle)` streams bytes: figures, copies
    with staged_file(path) as staging: ...       # a writer that opens a path itself (gguf's)
    write_folder_atomically(destination, write)  # `write(folder)` fills a whole folder: converted checkpoints

One place for this, so that a fix reaches every writer: each copy of it used to differ in what it left behind when it
failed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def check_destination(destination: str | os.PathLike, *, file_suffix: str | None = None) -> Path:
    """`destination` as a `Path` if it can be written: a folder that is absent or empty (or, with `file_suffix`, an
    absent file of that suffix); else `ValueError` naming it. Checked before any work, and again by the writers."""
    destination = Path(destination)
    if file_suffix is not None:
        if destination.suffix != file_suffix:
            raise ValueError(f"destination {str(destination)!r} should end in {file_suffix}")
        if destination.exists():
            raise ValueError(f"destination {str(destination)!r} exists")
    elif destination.is_file():
        raise ValueError(f"destination {str(destination)!r} is a file; give a folder that is absent or empty")
    elif destination.exists() and any(destination.iterdir()):
        raise ValueError(f"destination {str(destination)!r} exists and is not empty")
    return destination


@contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging file beside `path` (`.<name>.<random>.tmp`); when the block ends it is synced to disk
    and renamed over `path`, or removed if the block raised. Its permissions are those `open` gives (the umask's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(staging, "xb"):  # claims the name: no other writer's staging file
            pass
        yield staging
        with open(staging, "rb+") as handle:  # whoever wrote it may not have synced it
            os.fsync(handle.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)


def write_file_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Call `write(handle)` on a binary handle to a staging file, then put it in place of `path`; returns `path`."""
    with staged_file(path) as staging, open(staging, "wb") as handle:
        write(handle)
    return Path(path)


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; returns `path`."""
    return write_file_atomically(path, lambda handle: handle.write(text.encode("utf-8")))


def write_folder_atomically(destination: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call `write(staging_folder)`, then rename the folder to `destination` (absent or empty); nothing half-written.

    The staging folder sits beside `destination`, so the rename stays on one file system. A `destination` that is not
    absent or empty, checked before and again at the rename, is refused (`check_destination`), never overwritten.
    """
    destination = check_destination(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    try:
        write(staging)
        if destination.exists():
            destination.rmdir()  # empty, or this raises: a folder filled meanwhile is not replaced
        os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


def replace_folder(staging: str | os.PathLike, destination: str | os.PathLike) -> Path:
    """Put the finished folder `staging` (beside `destination`) in place of `destination`, removing what it held.

    For folders whose staging name must be known in advance, e.g. one that several processes write into.
    """
    destination = Path(destination)
    shutil.rmtree(destination, ignore_errors=True)
    os.replace(staging, destination)
    return destination


__all__ = [
    "check_destination",
    "replace_folder",
    "staged_file",
    "write_file_atomically",
    "write_folder_atomically",
    "write_text_atomically",
]
