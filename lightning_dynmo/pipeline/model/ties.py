"""Parameters the first-stage and last-stage parts share (a tied embedding and head) across two ranks.

Read :class:`TiedCopies`: :meth:`~TiedCopies.pair` finds, after every (re)build, whether this rank holds
one of two copies of the tied parameters and who holds the other; :meth:`~TiedCopies.sync_grads` sums
the copies' gradients so both take the single-process step; :meth:`~TiedCopies.second_copies` tells
gradient clipping which copy not to count twice.

The first stage runs on the pipeline's first rank; the last stage on its last rank (loop layouts) or
on the first one too (V layouts, or a single stage). When the two parts sit on different ranks each
keeps its own copy, and the copies' gradients are exchanged point to point over the pipeline group (no
process group is created, so every rank keeps the same set of groups and later re-packs still pair up).
When one rank runs both, the tie is one local parameter again: a last-stage copy that arrived there by
a re-pack is merged back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dynmo.pipeline.model.contract import TiedParameter

log = logging.getLogger(__name__)

__all__ = ["TiedCopies"]


class TiedCopies:
    """This rank's side of the first/last-part parameter ties.

    Args:
        ties: The tied parameters (:func:`~lightning_dynmo.pipeline.find_tied_parameters`).
    """

    def __init__(self, ties: tuple[TiedParameter, ...] = ()) -> None:
        self.ties = ties
        self.peer: int | None = None  # the global rank holding the other copy, if the tie spans two ranks
        self.side: str | None = None  # "first" or "last": which copy this rank holds

    @property
    def aliases(self) -> dict[str, str]:
        """Last-part name -> first-part name (a single-process checkpoint keeps the first one only)."""
        return {t.last_name: t.first_name for t in self.ties}

    def clear(self) -> None:
        """Forget the pairing (a released rank holds no copy)."""
        self.peer = self.side = None

    def pair(
        self,
        module: nn.Module,
        optimizers: Sequence[Any],
        *,
        rank: int,
        pipeline_ranks: Sequence[int],
        last_position: int,
    ) -> None:
        """Find the rank holding the other copy, or merge the copies when this rank runs both parts.

        Args:
            module: The model (holding this rank's units).
            optimizers: Its optimizers (a merged copy leaves them).
            rank: This rank's global rank.
            pipeline_ranks: Global ranks of this rank's pipeline, by pipeline position.
            last_position: The pipeline position of the rank running the last stage.
        """
        self.clear()
        if not self.ties:
            return
        if last_position == 0:
            if rank == pipeline_ranks[0]:
                self._merge(module, optimizers)
            return
        first, last = pipeline_ranks[0], pipeline_ranks[last_position]
        if rank in (first, last):
            self.peer, self.side = (last, "first") if rank == first else (first, "last")
            log.info(
                "rank %d: %s shared with rank %d; the two copies' gradients are summed every step",
                rank,
                ", ".join(f"{t.first_name} = {t.last_name}" for t in self.ties),
                self.peer,
            )

    def _merge(self, module: nn.Module, optimizers: Sequence[Any]) -> None:
        # The two copies have taken the same steps, so nothing changes in value; a gradient the dropped
        # copy held (inside an accumulation window) is added to the kept one.
        for tie in self.ties:
            kept, arrived = module.get_parameter(tie.first_name), module.get_parameter(tie.last_name)
            if kept is arrived:
                continue
            if arrived.grad is not None:
                kept.grad = arrived.grad if kept.grad is None else kept.grad + arrived.grad
            owner, _, attr = tie.last_name.rpartition(".")
            setattr(module.get_submodule(owner), attr, kept)
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["params"][:] = [p for p in group["params"] if p is not arrived]
                optimizer.state.pop(arrived, None)

    def local_params(self, module: nn.Module) -> list[nn.Parameter]:
        """This rank's copies of the tied parameters, when the tie spans two ranks (else empty)."""
        if self.peer is None:
            return []
        first = self.side == "first"
        return [module.get_parameter(t.first_name if first else t.last_name) for t in self.ties]

    def second_copies(self, module: nn.Module) -> set[int]:
        """The ``id`` of each parameter a global gradient norm must not count (the last stage's copies)."""
        return {id(p) for p in self.local_params(module)} if self.side == "last" else set()

    def sync_grads(
        self,
        module: nn.Module,
        group: dist.ProcessGroup | None,
        guard: Callable[[], AbstractContextManager[Any]],
    ) -> None:
        """Sum the gradients of the two copies of each tied parameter, so both take the same step.

        Args:
            module: The model.
            group: The pipeline's process group.
            guard: A context manager factory that wraps the exchange (names lost peers).
        """
        params = self.local_params(module)
        if not params:
            return
        received, ops = [], []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            buffer = torch.empty_like(param.grad)
            received.append(buffer)
            ops.append(dist.P2POp(dist.isend, param.grad, self.peer, group))
            ops.append(dist.P2POp(dist.irecv, buffer, self.peer, group))
        with guard():
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for param, buffer in zip(params, received, strict=True):
            assert param.grad is not None
            param.grad.add_(buffer)  # a + b on one rank, b + a on the other: the same in floating point
