"""Lightning's SIGTERM handling made safe for a pipeline: the handler notes, the ranks agree at batch starts.

Lightning's handler broadcasts inside the signal handler, and its epoch loop stops the signalled rank
alone: both hang a pipeline (see :mod:`lightning_dynmo.pipeline.faults.shutdown`). :func:`install` replaces
both on a :class:`~lightning_dynmo.DynMoStrategy`'s trainer; :func:`agree` is the batch-start agreement.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_dynmo.pipeline import SigtermAgreement

if TYPE_CHECKING:
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["agree", "install"]


def install(strategy: DynMoStrategy, trainer: pl.Trainer) -> None:
    """DynMo's handler only notes the signal; the epoch loop's broadcast becomes :func:`agree`."""
    launcher = strategy.launcher
    strategy._sigterm = SigtermAgreement(forward=launcher.kill if launcher is not None else None)
    trainer._signal_connector._sigterm_notifier_fn = strategy._sigterm.handle  # type: ignore[method-assign,assignment]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = partial(agree, strategy)  # type: ignore[method-assign]


def agree(strategy: DynMoStrategy) -> None:
    """At a batch boundary, on every active rank: stop all of them if any received SIGTERM."""
    if strategy._released or not _distributed_is_initialized():
        return
    with strategy.guard("the SIGTERM check at a batch start"):
        stop = strategy._sigterm.agree(strategy._active_group, strategy.root_device)
    if stop and (trainer := strategy._trainer()) is not None:
        trainer._signal_connector.received_sigterm = True
        raise SIGTERMException()
