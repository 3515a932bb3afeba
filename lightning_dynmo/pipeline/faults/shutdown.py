"""SIGTERM on any one rank stops every rank at the same batch boundary: noted in the handler, agreed later.

Lightning's SIGTERM handler broadcasts a flag from inside the signal handler. Under pipeline
parallelism that deadlocks: the handler runs at whatever point the signalled rank's main thread is,
while its peer waits for it in a pipeline receive, and the broadcast waits for the peer in turn. Its
per-batch check is also one-sided: the signalled rank raises at the end of its batch, while the others
go on into the next batch and wait for it until the timeout.

:class:`SigtermAgreement` splits the two: :meth:`~SigtermAgreement.note` only sets a flag (safe in a
signal handler, at any point of a step), and :meth:`~SigtermAgreement.agree` is a one-element
all-reduce (maximum) over the active ranks that every rank runs at the same batch boundary. Every rank
then learns that *some* rank was signalled at the same moment, and all stop together (the strategy
raises Lightning's ``SIGTERMException`` there, so ``trainer.received_sigterm`` and checkpoint-on-exception
work as Lightning documents them, collective checkpoint saving included).

A collective at every boundary is a barrier the pipeline pays on every step. A caller that exchanges a
row at every batch end on the same ranks anyway (:class:`~lightning_dynmo.DynMoCallback`) carries the
flag in it (:attr:`~SigtermAgreement.flag`) and hands whether any gathered flag was set to
:meth:`~SigtermAgreement.settle`; the next :meth:`~SigtermAgreement.agree` then decides from them without
communicating, so the boundary costs one collective, not two.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["SigtermAgreement"]


class SigtermAgreement:
    """A SIGTERM flag set by the signal handler and agreed over the active ranks at a batch boundary.

    Args:
        forward: Called with the signal number at the first SIGTERM (Lightning's launchers pass it on to
            the processes they started: ``launcher.kill``).
    """

    def __init__(self, forward: Callable[[int], Any] | None = None) -> None:
        self._noted = False
        self._forward = forward
        self._settled: bool | None = None  # this boundary's agreement, when a batch-end exchange carried it

    @property
    def noted(self) -> bool:
        """Whether this rank received SIGTERM."""
        return self._noted

    def handle(self, signum: int | signal.Signals, frame: FrameType | None = None) -> None:
        """The signal handler: record the SIGTERM (and forward the first one). Never communicates."""
        first = not self._noted
        self._noted = True
        if first and self._forward is not None:
            self._forward(signum)

    @property
    def flag(self) -> float:
        """This rank's flag as a number (1.0: signalled), for a row gathered at a batch end."""
        return float(self._noted)

    def settle(self, signalled: bool) -> None:
        """Record this boundary's agreement: whether any rank's :attr:`flag`, gathered, was set.

        Call on every rank, with the same value, between the last collective of a step and the next
        :meth:`agree`, which then returns it without communicating (once).
        """
        self._settled = bool(signalled)

    def agree(self, group: dist.ProcessGroup | None, device: torch.device) -> bool:
        """Whether any rank of ``group`` received SIGTERM; call on every rank at one boundary.

        A collective (an all-reduce of one flag), unless :meth:`settle` recorded this boundary already.
        """
        if self._settled is not None:
            stop, self._settled = self._settled, None
        else:
            flag = torch.tensor([int(self._noted)], dtype=torch.int32, device=device)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            stop = bool(flag.item())
        if stop:
            log.info(
                "SIGTERM received by some rank (this one: %s); every rank stops at this batch", self._noted
            )
        return stop
