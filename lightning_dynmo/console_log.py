"""DynMo's INFO lines on the console of rank 0 when the user configured no logging, as Lightning does.

``lightning.pytorch`` attaches a ``logging.StreamHandler`` to its own logger at import when the root logger
has no handlers, so a plain script shows its lines. :func:`show_info_on_rank_zero` does the same for the
``lightning_dynmo`` logger, called when :class:`~lightning_dynmo.DynMoStrategy` is set up (the rank is
known then): without it a user's ``Trainer(strategy="dynmo")`` would print no placement or rebalance
line unless they configured ``logging`` themselves. Any handler the user set (on ``lightning_dynmo`` or
an ancestor, e.g. ``logging.basicConfig``, Hydra's job logging, pytest's capture) leaves everything as is.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_NAME", "show_info_on_rank_zero"]

#: The logger every module of the package logs under (``logging.getLogger(__name__)``).
LOGGER_NAME = "lightning_dynmo"


def show_info_on_rank_zero(rank: int) -> bool:
    """Attach a stderr handler at INFO to the ``lightning_dynmo`` logger on rank 0, if nothing handles it.

    Args:
        rank: This process's global rank; other ranks keep Python's default (warnings on stderr only),
            so each line is printed once.

    Returns:
        Whether a handler was attached (``False`` on other ranks, when logging was configured, or when
        an earlier call attached it already).
    """
    logger = logging.getLogger(LOGGER_NAME)
    # hasHandlers() looks at the ancestors too: a root handler means the user (or an app) configured logging.
    if rank != 0 or logger.hasHandlers():
        return False
    logger.addHandler(logging.StreamHandler())
    if logger.level == logging.NOTSET:  # a level the user set stays
        logger.setLevel(logging.INFO)
    # As Lightning does: should the user configure the root logger later, lines are not printed twice.
    logger.propagate = False
    return True
