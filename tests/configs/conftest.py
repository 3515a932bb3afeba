"""Composing ``conf/`` in tests: Hydra's compose API on the application's own config directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from lightning_dynmo.train import CONF_DIR

Compose = Callable[[Sequence[str]], DictConfig]


@pytest.fixture
def compose_train(tmp_path: Path) -> Iterator[Compose]:
    """``compose_train(overrides)``: the composed ``train`` config, writing into ``tmp_path``."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):

        def _compose(overrides: Sequence[str] = ()) -> DictConfig:
            return compose("train", overrides=[f"run_dir={tmp_path}", *overrides])

        yield _compose
    GlobalHydra.instance().clear()


def group_options(group: str) -> list[str]:
    """Every option of a config group (its YAML files)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
