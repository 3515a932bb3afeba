"""The application's logging: DynMo's INFO on rank 0 only; Lightning's tip and the pytree warning dropped."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import pytest

from lightning_dynmo.app import quiet


@pytest.fixture
def restored() -> Iterator[None]:
    ours = logging.getLogger("lightning_dynmo")
    fabric = logging.getLogger("lightning.fabric")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    levels, filters = (ours.level, fabric.level), list(rank_zero.filters)
    with warnings.catch_warnings():
        yield
    ours.setLevel(levels[0])
    fabric.setLevel(levels[1])
    rank_zero.filters[:] = filters


@pytest.mark.parametrize(("rank", "level"), [(0, logging.INFO), (1, logging.WARNING)])
def test_dynmo_lines_show_on_rank_zero_only(restored: None, rank: int, level: int) -> None:
    quiet.configure(rank)
    assert logging.getLogger("lightning_dynmo").level == level
    assert logging.getLogger("lightning_dynmo.callback.dynmo_callback").getEffectiveLevel() == level


def test_lightnings_tip_is_dropped_and_other_lines_kept(restored: None) -> None:
    quiet.configure(0)
    quiet.configure(0)  # twice: one filter
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    assert sum(isinstance(f, quiet._DropChatter) for f in logger.filters) == 1

    def passes(message: str) -> bool:
        record = logging.LogRecord(logger.name, logging.INFO, __file__, 1, message, None, None)
        return bool(logger.filter(record))

    assert not passes("💡 Tip: For seamless cloud logging ...")
    assert not passes("GPU available: False, used: False")
    assert passes("`Trainer.fit` stopped: `max_steps=60` reached.")


def test_only_the_named_warning_is_silenced(restored: None) -> None:
    quiet.configure(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a plain run sees, then ours on top
        quiet.configure(0)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "something else is deprecated",
        "`isinstance(treespec, LeafSpec)` is deprecated",
    ]
