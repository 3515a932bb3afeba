"""``show_info_on_rank_zero``: a console handler for DynMo's lines on rank 0, where none is configured."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from lightning_dynmo.console_log import LOGGER_NAME, show_info_on_rank_zero


@pytest.fixture
def package_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The package logger with no handler, its handlers, level and propagation restored after the test."""
    logger = logging.getLogger(LOGGER_NAME)
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    level = logger.level
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.setLevel(level)


@contextmanager
def bare_root() -> Iterator[None]:
    """No handler on the root logger: pytest's capture handlers (added per phase) set aside, then back."""
    root = logging.getLogger()
    saved = root.handlers[:]
    for handler in saved:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in saved:
            root.addHandler(handler)


def test_rank_zero_gets_one_stderr_handler_at_info(package_logger: logging.Logger) -> None:
    with bare_root():
        assert show_info_on_rank_zero(0)
        assert not show_info_on_rank_zero(0)  # once
    (handler,) = package_logger.handlers
    assert type(handler) is logging.StreamHandler
    assert package_logger.level == logging.INFO and not package_logger.propagate


def test_other_ranks_keep_pythons_default(package_logger: logging.Logger) -> None:
    with bare_root():
        assert not show_info_on_rank_zero(1)
    assert package_logger.handlers == [] and package_logger.propagate
    assert package_logger.level == logging.NOTSET


def test_a_level_the_user_set_stays(package_logger: logging.Logger) -> None:
    package_logger.setLevel(logging.WARNING)
    with bare_root():
        assert show_info_on_rank_zero(0)
    assert package_logger.level == logging.WARNING


def test_configured_logging_is_left_alone(package_logger: logging.Logger) -> None:
    with bare_root():
        logging.getLogger().addHandler(user := logging.NullHandler())  # e.g. basicConfig
        try:
            assert not show_info_on_rank_zero(0)
        finally:
            logging.getLogger().removeHandler(user)
    assert package_logger.handlers == [] and package_logger.propagate
