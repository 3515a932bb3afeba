"""Lightning's SIGTERM handling made safe for a pipeline: the handler notes, the ranks agree at batch starts.

Lightning's handler broadcasts inside the signal handler, and its epoch loop stops the signalled rank
alone: both hang a pipeline (see :mod:`lightning_dynmo.pipeline.faults.shutdown`). :func:`install` replaces
both on a :class:`~lightning_dynmo.DynMoStrategy`'s trainer; :func:`agree` is the batch-start agreement.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_dynmo.pipeline import SigtermAgreement
from lightning_dynmo.strategy.collectives import Guard
from lightning_dynmo.strategy.state import RankState

__all__ = ["agree", "install"]


def install(ranks: RankState, guard: Guard, device: torch.device, trainer: pl.Trainer, launcher: Any) -> None:
    """DynMo's handler only notes the signal; the epoch loop's broadcast becomes :func:`agree`.

    ``launcher`` (Lightning's, or ``None``) is told to kill the other local processes on SIGTERM.
    """
    ranks.sigterm = SigtermAgreement(forward=launcher.kill if launcher is not None else None)
    trainer._signal_connector._sigterm_notifier_fn = ranks.sigterm.handle  # type: ignore[method-assign,assignment]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = partial(agree, ranks, guard, device, trainer)  # type: ignore[method-assign]


def agree(ranks: RankState, guard: Guard, device: torch.device, trainer: pl.Trainer | None) -> None:
    """At a batch boundary, on every active rank: stop all of them if any received SIGTERM."""
    if ranks.released or not _distributed_is_initialized():
        return
    with guard("the SIGTERM check at a batch start"):
        stop = ranks.sigterm.agree(ranks.active_group, device)
    if stop and trainer is not None:
        trainer._signal_connector.received_sigterm = True
        raise SIGTERMException()
