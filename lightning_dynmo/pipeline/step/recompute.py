"""Activation checkpointing of pipeline blocks: a block's forward is run again in backward instead of kept.

Read :func:`run_checkpointed` (how a stage calls a block when the strategy's ``activation_checkpointing``
is on), then :func:`recomputing` (what blocks and auxiliary losses see while the forward runs again).

Per block, with ``torch.utils.checkpoint`` (``use_reentrant=False``): only the block's inputs are kept
for backward, and its forward runs again when backward reaches it, under the random-number state of the
first run (dropout draws the same masks), so gradients are exactly those without checkpointing. It is
applied where a stage calls its blocks (:class:`~lightning_dynmo.pipeline.step.stage.StageModule`), not
by wrapping the block modules: a migrated block carries no wrapper and is checkpointed on its new stage
because that stage calls it so.

The second run must not count twice. While it runs, :func:`recomputing` is true, which
:func:`~lightning_dynmo.pipeline.in_shape_inference` reports too (blocks that count what their forwards
do skip it, as for torch's metadata pass), and auxiliary losses go to a record nobody reads (their
gradient already rides on the first run's output).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.utils.checkpoint import checkpoint

from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses

__all__ = ["recomputing", "run_checkpointed"]

T = TypeVar("T")

_local = threading.local()


def recomputing() -> bool:
    """Whether a checkpointed block's forward is running again, in backward, in this thread now."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _second_run() -> Iterator[None]:
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        with collect_aux_losses():  # values recorded nowhere read: the first run logged them
            yield
    finally:
        _local.depth -= 1


def run_checkpointed(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` with activation checkpointing: its forward runs again in backward.

    Args:
        function: Runs one block (its arguments may hold tensors in any structure).
        *args: Its arguments.
    """
    runs = 0

    def run(*inner: Any) -> T:
        nonlocal runs
        runs += 1
        if runs == 1:
            return function(*inner)
        with _second_run():
            return function(*inner)

    out: T = checkpoint(run, *args, use_reentrant=False)
    return out
