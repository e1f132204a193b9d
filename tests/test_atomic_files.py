"""specfree.files: atomic writes, cache keys and user paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from specfree.files import atomic_path, fingerprint, user_path, write_atomic


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "a.json"
    write_atomic(path, "old")
    write_atomic(path, [b"n", b"ew"])
    assert path.read_text() == "new"
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "new" and list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_a_folder_is_replaced_whole(tmp_path):
    folder = tmp_path / "model"
    for files in (["a", "b"], ["c"]):
        with atomic_path(folder) as tmp:
            tmp.mkdir()
            for name in files:
                (tmp / name).write_text(name)
    assert sorted(p.name for p in folder.iterdir()) == ["c"] and list(tmp_path.iterdir()) == [folder]


def test_a_fingerprint_follows_every_part():
    assert fingerprint("a", [1, {"b": 2, "c": 3}]) == fingerprint("a", [1, {"c": 3, "b": 2}])
    assert fingerprint("a", 1) != fingerprint("a", 2) != fingerprint("b", 2)
    assert len(fingerprint(Path("x"))) == 16


def test_user_paths_are_relative_to_the_starting_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert user_path("x/y.jsonl") == tmp_path / "x" / "y.jsonl"
    assert user_path("~/z") == Path.home() / "z"
