"""The application finds its one configuration: the wheel's copy, else the clone's top-level ``conf/``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dynmo.train import CONF_DIR, conf_dir

ROOT = Path(__file__).resolve().parents[2]


def _conf(where: Path) -> Path:
    where.mkdir(parents=True)
    (where / "train.yaml").write_text("defaults: []\n")
    return where


def test_a_clone_reads_the_top_level_conf_and_no_copy_lives_in_the_package() -> None:
    assert CONF_DIR == ROOT / "conf"
    assert not (ROOT / "lightning_dynmo" / "conf").exists()


def test_the_wheels_copy_inside_the_package_comes_first(tmp_path: Path) -> None:
    package = tmp_path / "site" / "lightning_dynmo"
    inside = _conf(package / "conf")
    _conf(tmp_path / "site" / "conf")
    assert conf_dir(package) == inside


def test_the_folder_beside_the_package_serves_a_clone(tmp_path: Path) -> None:
    package = tmp_path / "clone" / "lightning_dynmo"
    package.mkdir(parents=True)
    beside = _conf(tmp_path / "clone" / "conf")
    assert conf_dir(package) == beside


def test_no_configuration_anywhere_says_where_it_looked(tmp_path: Path) -> None:
    package = tmp_path / "lightning_dynmo"
    package.mkdir()
    (tmp_path / "conf").mkdir()  # a folder without train.yaml is not the configuration
    with pytest.raises(FileNotFoundError, match=r"neither in .*lightning_dynmo/conf .*nor in .*reinstall"):
        conf_dir(package)
