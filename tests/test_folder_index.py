"""A data set folder's scan remembered (`qie.data.folder_index`): a warm scan equals a fresh one and lists no
folder and reads no caption; any change that could change the scan (a caption written in place, an image
added, removed or renamed, a folder created, a damaged index) scans again."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

import qie.data.samples as samples
from qie.data.samples import Dataset
from qie.data.scan import scan_dataset


def _touch(path: Path) -> None:
    """An image file: the scan goes by names, it opens no image."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _edit_set(root: Path) -> Path:
    """Samples with a mask, a rejected result, two controls, a caption beside its control; and problems: an
    empty caption, a missing control, a missing caption."""
    for stem in ("a", "b", "c", "empty", "nocontrol", "nocaption"):
        _touch(root / "training_images" / f"{stem}.png")
        if stem != "nocontrol":
            _touch(root / "control_images" / f"{stem}.png")
    _touch(root / "control_images" / "a_control_1.png")
    _touch(root / "masks" / "a.png")
    _touch(root / "rejected_images" / "c.png")
    _write(root / "training_images" / "a.txt", "edit a\n")
    _write(root / "control_images" / "b.txt", "edit b, captioned beside its control")
    _write(root / "training_images" / "c.txt", "edit c")
    _write(root / "training_images" / "empty.txt", "  \n")
    _write(root / "training_images" / "nocontrol.txt", "no control")
    return root


def _scan(root: Path, cache: Path, **settings) -> Dataset:
    return scan_dataset(root, "folder", index_dir=cache / "manifests", **settings)


def _indexes(cache: Path) -> list[Path]:
    return sorted((cache / "manifests").glob("*.safetensors"))


def _same(got: Dataset, fresh: Dataset) -> None:
    """Equal, and each path spelled the same."""
    assert got == fresh

    def texts(samples):
        return [[str(p) for p in (s.target, *s.controls, s.mask, *s.layers, s.field_images)] for s in samples]

    assert texts(got.samples) == texts(fresh.samples)


@contextmanager
def _no_listing_or_caption_read(monkeypatch: pytest.MonkeyPatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a folder was listed or a caption read")

    with monkeypatch.context() as mp:
        mp.setattr(samples, "read_caption", refuse)
        mp.setattr(os, "scandir", refuse)
        yield


def _next_tick() -> None:
    """Lets the file system's clock move on (timestamps may advance by ticks of a few ms): a change made next
    shows in the timestamps of what it touches."""
    time.sleep(0.02)


def test_a_remembered_folder_scan_equals_the_scan_and_lists_and_reads_nothing(tmp_path: Path, monkeypatch) -> None:
    root, cache = _edit_set(tmp_path / "ds"), tmp_path / "cache"
    assert _scan(root, cache).samples and not (cache / "manifests").exists()  # no cache folder: nothing written
    cache.mkdir()
    first = _scan(root, cache)
    assert len(_indexes(cache)) == 1
    with _no_listing_or_caption_read(monkeypatch):
        warm = _scan(root, cache)
    fresh = scan_dataset(root, "folder")
    _same(warm, fresh)
    _same(first, fresh)
    assert [s.id for s in warm.samples] == ["a", "b", "c"]
    a, b, c = warm.samples
    assert a.controls == (root / "control_images" / "a.png", root / "control_images" / "a_control_1.png")
    assert (a.prompt, a.mask, b.prompt, c.fields["rejected"]) == ("edit a", root / "masks" / "a.png",
                                                        "edit b, captioned beside its control",
                                                        root / "rejected_images" / "c.png")  # fmt: skip
    # The problems are remembered too.
    assert [p.id for p in warm.problems] == ["empty", "nocaption", "nocontrol"]
    assert "is empty" in warm.problems[0].reason and "is missing" in warm.problems[1].reason
    assert warm.problems[2].reason == "control image is missing"

    # Other settings are another scan, remembered apart: without require_prompt a missing caption is "".
    loose = _scan(root, cache, require_prompt=False, require_target=False)
    assert len(_indexes(cache)) == 2
    with _no_listing_or_caption_read(monkeypatch):
        warm = _scan(root, cache, require_prompt=False, require_target=False)
    _same(warm, loose)
    _same(warm, scan_dataset(root, "folder", require_prompt=False, require_target=False))
    assert {s.id: s.prompt for s in warm.samples}["nocaption"] == ""


def test_a_relative_data_set_path_is_remembered_as_written(tmp_path: Path, monkeypatch) -> None:
    _edit_set(tmp_path / "ds")
    (tmp_path / "cache").mkdir()
    monkeypatch.chdir(tmp_path)
    _scan(Path("ds"), Path("cache"))
    absolute = _scan(tmp_path / "ds", Path("cache"))
    with _no_listing_or_caption_read(monkeypatch):
        warm = _scan(Path("ds"), Path("cache"))
    _same(warm, scan_dataset("ds", "folder"))
    assert str(warm.samples[0].target) == "ds/training_images/a.png" and "ds/" in warm.problems[0].path
    _same(absolute, scan_dataset(tmp_path / "ds", "folder"))


def test_a_caption_rewritten_in_place_with_its_size_and_mtime_kept_is_read_again(tmp_path: Path) -> None:
    root, cache = _edit_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    _scan(root, cache)
    caption = root / "training_images" / "a.txt"
    before = caption.stat()
    _next_tick()
    with open(caption, "r+b") as f:
        f.write(b"EDIT")  # "edit a\n" -> "EDIT a\n": the same size
    os.utime(caption, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = caption.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
    assert _scan(root, cache).samples[0].prompt == "EDIT a"
    assert _scan(root, cache).samples[0].prompt == "EDIT a"  # and remembered so

    _next_tick()
    _write(root / "training_images" / "empty.txt", "now captioned")  # a problem that goes away
    data = _scan(root, cache)
    assert [s.id for s in data.samples] == ["a", "b", "c", "empty"] and data.samples[3].prompt == "now captioned"


def test_an_image_added_removed_or_renamed_scans_again(tmp_path: Path) -> None:
    root, cache = _edit_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    _scan(root, cache)
    _next_tick()
    _touch(root / "training_images" / "d.png")
    _touch(root / "control_images" / "d.png")
    _write(root / "training_images" / "d.txt", "edit d")
    assert [s.id for s in _scan(root, cache).samples] == ["a", "b", "c", "d"]

    _next_tick()
    (root / "control_images" / "a_control_1.png").unlink()  # a second control gone
    assert _scan(root, cache).samples[0].controls == (root / "control_images" / "a.png",)

    _next_tick()
    (root / "masks" / "a.png").rename(root / "masks" / "b.png")  # a mask renamed: another sample's
    data = _scan(root, cache)
    assert (data.samples[0].mask, data.samples[1].mask) == (None, root / "masks" / "b.png")

    _next_tick()
    (root / "training_images" / "d.png").unlink()
    data = _scan(root, cache)
    assert [s.id for s in data.samples] == ["a", "b", "c"]
    assert [p.reason for p in data.problems if p.id == "d"] == ["target image is missing (control image found)"]
    _same(data, scan_dataset(root, "folder"))


def test_a_control_folder_created_scans_again(tmp_path: Path) -> None:
    root, cache = tmp_path / "ds", tmp_path / "cache"
    cache.mkdir()
    _touch(root / "training_images" / "a.png")
    _write(root / "training_images" / "a.txt", "a cat")
    assert _scan(root, cache).samples[0].controls == ()  # text to image
    _next_tick()
    _touch(root / "control_images" / "a.png")
    assert _scan(root, cache).samples[0].controls == (root / "control_images" / "a.png",)
    assert len(_indexes(cache)) == 1


def test_a_damaged_index_is_named_and_the_folder_scanned(tmp_path: Path, caplog) -> None:
    root, cache = _edit_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    _scan(root, cache)
    for index in _indexes(cache):
        index.write_bytes(b"not a safetensors file")
    with caplog.at_level(logging.WARNING):
        data = _scan(root, cache)
    assert "folder index" in caplog.text and "unreadable" in caplog.text
    _same(data, scan_dataset(root, "folder"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        _same(_scan(root, cache), data)  # saved again
    assert caplog.text == ""


def test_a_folder_changing_during_the_scan_is_not_remembered(tmp_path: Path, monkeypatch) -> None:
    root, cache = _edit_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    read = samples.read_caption

    def read_and_add(path):
        _touch(root / "training_images" / "late.png")
        return read(path)

    monkeypatch.setattr(samples, "read_caption", read_and_add)
    _scan(root, cache)
    assert _indexes(cache) == []


def _layered_set(root: Path) -> Path:
    """Two layered samples (one without a caption) and a problem: an image without layers."""
    for stem, layers in (("p", 2), ("q", 3), ("r", 0)):
        _touch(root / "images" / f"{stem}.png")
        for n in range(layers):
            _touch(root / "layers" / f"{stem}_{n}.png")
    _write(root / "images" / "p.txt", "a poster")
    return root


def test_a_layered_folder_is_remembered(tmp_path: Path, monkeypatch) -> None:
    root, cache = _layered_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    for settings in ({}, {"require_prompt": False}):
        _scan(root, cache, **settings)
        with _no_listing_or_caption_read(monkeypatch):
            warm = _scan(root, cache, **settings)
        _same(warm, scan_dataset(root, "folder", **settings))
        p = warm.samples[0]
        assert p.target is p.controls[0] == root / "images" / "p.png"
        assert p.layers == (root / "layers" / "p_0.png", root / "layers" / "p_1.png")
    assert [(s.id, s.prompt, len(s.layers)) for s in warm.samples] == [("p", "a poster", 2), ("q", "", 3)]
    assert [p.id for p in warm.problems] == ["r"]

    _next_tick()
    _write(root / "images" / "q.txt", "a flyer")  # a caption that was no file now is one
    assert [s.prompt for s in _scan(root, cache, require_prompt=False).samples] == ["a poster", "a flyer"]
    _next_tick()
    _touch(root / "layers" / "q_3.png")
    assert len(_scan(root, cache).samples[1].layers) == 4


def test_a_caption_link_whose_file_appears_is_read(tmp_path: Path) -> None:
    """A caption that is a link to no file (so no caption) is seen once its file appears, though no name in
    the data set's folders changed."""
    root, cache = _layered_set(tmp_path / "ds"), tmp_path / "cache"
    cache.mkdir()
    elsewhere = tmp_path / "captions"
    elsewhere.mkdir()
    (root / "images" / "q.txt").symlink_to(elsewhere / "q.txt")
    assert [s.prompt for s in _scan(root, cache, require_prompt=False).samples] == ["a poster", ""]
    _next_tick()
    _write(elsewhere / "q.txt", "a flyer")
    assert [s.prompt for s in _scan(root, cache, require_prompt=False).samples] == ["a poster", "a flyer"]

    edit = _edit_set(tmp_path / "edit")
    (edit / "training_images" / "nocaption.txt").symlink_to(elsewhere / "nocaption.txt")
    assert "nocaption" in [p.id for p in _scan(edit, cache).problems]
    _next_tick()
    _write(elsewhere / "nocaption.txt", "found")
    assert {s.id: s.prompt for s in _scan(edit, cache).samples}["nocaption"] == "found"


ODD_NAMES = [None, "/abs/x.png", "a//b.png", "./c.png", "a/./d.png", "a/../e.png", ".f.png", "g/", ""]


@pytest.mark.parametrize("odd", ODD_NAMES)
def test_index_paths_equal_pathlib_joins(tmp_path: Path, odd: str | None) -> None:
    """The remembered names made paths again: what `folder / name` gives, text included, for plain names (built
    by the child constructor) and for any odd one among them (every name then checked on its own)."""
    from qie.data.index_file import paths

    names = ["targets/0.png", "controls/a/1.png", "2.png", "targets/3.png.png"] + ([odd] if odd is not None else [])
    got = paths(tmp_path, names)
    assert got == [tmp_path / n for n in names]
    assert [str(p) for p in got] == [str(tmp_path / n) for n in names]
