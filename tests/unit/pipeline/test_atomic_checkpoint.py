"""Replacing a checkpoint: the target holds the complete old or the complete new one at every instant."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lightning_dynmo.pipeline.checkpoint import atomic
from lightning_dynmo.pipeline.checkpoint.atomic import leftovers, repair, staging_path, swap_in


def _checkpoint_dir(path: Path, content: str) -> Path:
    path.mkdir(parents=True)
    (path / "items").write_text(content)
    return path


def _content(path: Path) -> str:
    return (path / "items").read_text() if path.is_dir() else path.read_text()


def _assert_repaired(target: Path, caplog: pytest.LogCaptureFixture, content: str, warning: str) -> None:
    """``repair`` leaves ``target`` alone in its folder, holding ``content``, and logs ``warning``."""
    with caplog.at_level(logging.WARNING, logger=atomic.__name__):
        repair(target)
    assert _content(target) == content
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert warning in caplog.text


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_swap_in_replaces_a_directory_and_leaves_nothing_behind(tmp_path: Path, exchange: bool) -> None:
    target = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    staged = _checkpoint_dir(staging_path(target, "t1"), "new")
    swap_in(staged, target, exchange=exchange)
    assert _content(target) == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "rename-aside"])
def test_swap_in_replaces_a_file_by_a_directory_and_back(tmp_path: Path, exchange: bool) -> None:
    target = tmp_path / "last.ckpt"
    target.write_text("file")
    swap_in(_checkpoint_dir(staging_path(target, "t1"), "dir"), target, exchange=exchange)
    assert target.is_dir() and _content(target) == "dir"
    staged = staging_path(target, "t2")
    staged.write_text("file again")
    swap_in(staged, target, exchange=exchange)
    assert target.is_file() and _content(target) == "file again"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_first_save_is_a_plain_rename(tmp_path: Path) -> None:
    target = tmp_path / "epoch=0.ckpt"
    swap_in(_checkpoint_dir(staging_path(target, "t"), "first"), target)
    assert _content(target) == "first"


def test_names_of_unfinished_saves_are_never_lightning_checkpoints(tmp_path: Path) -> None:
    # Lightning's ckpt_path="last" takes a path whose stem matches ^last and whose suffix is .ckpt.
    target = tmp_path / "last.ckpt"
    staged = staging_path(target, "abc")
    assert staged.name.startswith(".") and staged.suffix != ".ckpt"
    aside = atomic._aside_path(target, "abc")
    assert re.match(r"^last", aside.stem) and aside.suffix == ".ckpt"  # the complete old one stays findable


def test_repair_after_a_crash_between_the_two_renames_promotes_the_complete_new_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    target = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    staged = _checkpoint_dir(staging_path(target, "t1"), "new")
    real_rename, calls = atomic._rename, []

    def crash_after_first(src: Path, dst: Path) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(atomic, "_rename", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        swap_in(staged, target, exchange=False)
    monkeypatch.undo()
    assert not target.exists()
    assert leftovers(target)[1], "the old checkpoint is set aside, complete"
    _assert_repaired(target, caplog, "new", warning="interrupted while it replaced")


def test_repair_restores_the_old_checkpoint_when_only_it_survived(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    _checkpoint_dir(atomic._aside_path(target, "t1"), "old")
    repair(target)
    assert _content(target) == "old"


def test_repair_removes_an_unfinished_save_and_keeps_the_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    _checkpoint_dir(staging_path(target, "t1"), "half written")
    _assert_repaired(target, caplog, "old", warning="left by an interrupted save")


def test_repair_removes_an_unfinished_first_save(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    _checkpoint_dir(staging_path(target, "t1"), "half written")
    repair(target)
    assert not target.exists() and not any(tmp_path.iterdir())


def test_repair_leaves_other_checkpoints_alone(tmp_path: Path) -> None:
    target = _checkpoint_dir(tmp_path / "last.ckpt", "old")
    other = _checkpoint_dir(tmp_path / "epoch=3.ckpt", "other")
    _checkpoint_dir(staging_path(other, "t1"), "other's unfinished save")
    repair(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["last.ckpt", "epoch=3.ckpt", staging_path(other, "t1").name]
    )
