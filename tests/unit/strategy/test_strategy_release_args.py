"""DynMoStrategy's phase-2 knobs: the on_release hook."""

from __future__ import annotations

import pytest

from lightning_dynmo.strategy import DynMoStrategy


def test_on_release_must_be_callable() -> None:
    with pytest.raises(
        TypeError, match=r"on_release='print' is not callable; pass a function taking one ReleaseEvent"
    ):
        DynMoStrategy(on_release="print")  # type: ignore[arg-type]


def test_a_fresh_strategy_is_not_released() -> None:
    events: list[object] = []
    assert DynMoStrategy(on_release=events.append).is_released is False
