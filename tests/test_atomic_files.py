"""hf_alibi.atomic_files: a failed write leaves no file and no staging copy; a finished one replaces the old whole."""

import os

import pytest

from hf_alibi.atomic_files import (
    check_destination,
    replace_folder,
    staged_file,
    write_file_atomically,
    write_folder_atomically,
    write_text_atomically,
)


class Boom(Exception):
    pass


def half_then_fail(handle):
    handle.write(b"half")
    raise Boom


def test_failed_file_write_leaves_no_file_and_no_staging_copy(tmp_path):
    with pytest.raises(Boom):
        write_file_atomically(tmp_path / "out.json", half_then_fail)
    assert list(tmp_path.iterdir()) == [], f"left behind: {list(tmp_path.iterdir())}"


def test_interrupted_file_write_keeps_the_old_file_whole(tmp_path):
    target = tmp_path / "out.md"
    write_text_atomically(target, "old")

    def interrupted(handle):
        handle.write(b"new, half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_file_atomically(target, interrupted)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.md"]


def test_an_existing_file_is_replaced_whole(tmp_path):
    target = tmp_path / "out.txt"
    write_text_atomically(target, "a much longer old text than the new one\n" * 100)
    assert write_text_atomically(target, "néw\n") == target
    assert target.read_bytes() == "néw\n".encode() and [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_missing_parent_folders_are_created_and_permissions_follow_the_umask(tmp_path):
    target = tmp_path / "a" / "b" / "out.txt"
    write_text_atomically(target, "x")
    umask = os.umask(0)
    os.umask(umask)
    assert target.read_text() == "x" and target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_staged_file_is_beside_the_destination_and_named_tmp(tmp_path):
    target = tmp_path / "model.gguf"
    with staged_file(target) as staging:
        assert staging.parent == tmp_path and staging.name.endswith(".tmp") and staging.is_file()
        staging.write_bytes(b"GGUF")  # a writer that opens the path itself
        assert not target.exists()
    assert target.read_bytes() == b"GGUF" and not staging.exists()
    with pytest.raises(Boom), staged_file(tmp_path / "other.gguf") as staging:
        staging.write_bytes(b"half")
        raise Boom
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


def test_failed_folder_write_leaves_nothing_beside_the_destination(tmp_path):
    def write(folder):
        (folder / "config.json").write_text("{")
        raise Boom

    with pytest.raises(Boom):
        write_folder_atomically(tmp_path / "model", write)
    assert list(tmp_path.iterdir()) == [], f"left behind: {list(tmp_path.iterdir())}"


def test_folder_write_fills_an_absent_or_empty_destination_and_refuses_a_full_one(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("absent", "empty"):
        write_folder_atomically(tmp_path / name, lambda folder: (folder / "weights").write_bytes(b"w"))
        assert [p.name for p in (tmp_path / name).iterdir()] == ["weights"]
    with pytest.raises(ValueError, match="exists and is not empty"):
        write_folder_atomically(tmp_path / "absent", lambda folder: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["absent", "empty"]


def test_check_destination_names_what_it_refuses(tmp_path):
    (tmp_path / "file.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file"):
        check_destination(tmp_path / "file.gguf")
    with pytest.raises(ValueError, match="exists"):
        check_destination(tmp_path / "file.gguf", file_suffix=".gguf")
    with pytest.raises(ValueError, match="should end in .gguf"):
        check_destination(tmp_path / "model.bin", file_suffix=".gguf")
    assert check_destination(str(tmp_path / "new.gguf"), file_suffix=".gguf") == tmp_path / "new.gguf"


def test_replace_folder_puts_the_staged_folder_in_place_of_the_old(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "old").write_text("old")
    (tmp_path / ".final.tmp").mkdir()
    (tmp_path / ".final.tmp" / "new").write_text("new")
    replace_folder(tmp_path / ".final.tmp", tmp_path / "final")
    assert [p.name for p in tmp_path.iterdir()] == ["final"]
    assert [p.name for p in (tmp_path / "final").iterdir()] == ["new"]
