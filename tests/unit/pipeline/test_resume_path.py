"""Choosing the checkpoint to resume from: an incomplete ``last*.ckpt`` is skipped with a warning naming
it, for the newest complete checkpoint beside it; a set-aside or missing one is repaired first; any other
path is read as given."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from lightning_dynmo.pipeline.checkpoint.atomic import set_aside_from
from lightning_dynmo.pipeline.checkpoint.checksums import MANIFEST_FILENAME, ItemChecksum, write_manifest
from lightning_dynmo.pipeline.checkpoint.resume import incompleteness, is_last_checkpoint, resume_path


def _directory(path: Path, mtime: float) -> Path:
    """A complete sharded-like checkpoint directory: one data file and its manifest."""
    path.mkdir()
    (path / "meta.pt").write_bytes(b"m" * 10)
    (path / "__0_0.distcp").write_bytes(b"x" * 100)
    write_manifest(path, [ItemChecksum("__0_0.distcp", 0, 100, 0, "state_dict.w")], ["meta.pt"])
    os.utime(path, (mtime, mtime))
    return path


def _file(path: Path, mtime: float) -> Path:
    torch.save({"w": torch.zeros(3)}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_complete_checkpoints_and_why_others_are_not(tmp_path: Path) -> None:
    directory = _directory(tmp_path / "a.ckpt", 1.0)
    file = _file(tmp_path / "b.ckpt", 1.0)
    assert incompleteness(directory) is None and incompleteness(file) is None

    (directory / "__0_0.distcp").write_bytes(b"x" * 50)  # cut short after the manifest was written
    assert re.search(
        r"__0_0.distcp is missing or shorter than the manifest records \(100 bytes\)",
        str(incompleteness(directory)),
    )
    (directory / MANIFEST_FILENAME).unlink()
    assert f"has no {MANIFEST_FILENAME}: the save did not finish" in str(incompleteness(directory))
    file.write_bytes(file.read_bytes()[:-30])
    assert incompleteness(file) == "not a whole torch checkpoint file (truncated?)"
    assert incompleteness(tmp_path / "nothing.ckpt") == "it does not exist"


def test_an_incomplete_last_checkpoint_is_skipped_for_the_newest_complete_one(tmp_path: Path) -> None:
    _directory(tmp_path / "epoch=0.ckpt", 100.0)
    newest = _file(tmp_path / "epoch=1.ckpt", 200.0)
    _file(tmp_path / "epoch=2.ckpt", 300.0).write_bytes(b"cut")  # newer, but incomplete
    last = _directory(tmp_path / "last.ckpt", 400.0)
    (last / MANIFEST_FILENAME).unlink()
    with pytest.warns(
        UserWarning,
        match=r"skipping checkpoint '.*last.ckpt': it is incomplete \(checkpoint directory .* has no "
        r"dynmo_checksums.json.*\); resuming from '.*epoch=1.ckpt', the newest complete checkpoint beside it",
    ):
        assert resume_path(last) == newest


def test_a_complete_last_checkpoint_and_any_explicit_path_are_read_as_given(tmp_path: Path) -> None:
    last = _file(tmp_path / "last-v1.ckpt", 100.0)
    _file(tmp_path / "epoch=9.ckpt", 900.0)
    assert resume_path(last) == last  # complete: Lightning's choice stands
    broken = _file(tmp_path / "epoch=1.ckpt", 100.0)
    broken.write_bytes(b"cut")
    assert resume_path(broken) == broken  # named explicitly: its loader fails on it, naming it


def test_an_incomplete_last_checkpoint_with_nothing_beside_it_fails_naming_it(tmp_path: Path) -> None:
    last = _file(tmp_path / "last.ckpt", 100.0)
    last.write_bytes(b"cut")
    with pytest.raises(
        FileNotFoundError, match=r"'.*last.ckpt' is incomplete \(not a whole torch .*\) and .* holds no "
    ):
        resume_path(last)


def test_a_save_interrupted_between_its_renames_resumes_from_the_repaired_checkpoint(tmp_path: Path) -> None:
    # last.ckpt renamed aside, the new one still staged: Lightning's "last" may pick the aside name.
    aside = _directory(tmp_path / "last.dynmo-aside-abc123.ckpt", 100.0)
    staged = _directory(tmp_path / ".last.ckpt.dynmo-staged-abc123", 200.0)
    assert set_aside_from(aside) == tmp_path / "last.ckpt"
    assert resume_path(aside) == tmp_path / "last.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the new one promoted, the old gone
    assert not staged.exists()


def test_a_missing_last_checkpoint_is_repaired_before_it_is_read(tmp_path: Path) -> None:
    _directory(tmp_path / "last.dynmo-aside-abc123.ckpt", 100.0)
    assert resume_path(tmp_path / "last.ckpt") == tmp_path / "last.ckpt"
    assert incompleteness(tmp_path / "last.ckpt") is None


@pytest.mark.parametrize(
    ("name", "last"),
    [("last.ckpt", True), ("last-v2.ckpt", True), ("epoch=3-step=9.ckpt", False), ("last", False)],
)
def test_which_names_ckpt_path_last_resolves_to(name: str, last: bool) -> None:
    assert is_last_checkpoint(name) is last
