"""The micro-batch count a pipeline runs: the configured one, or the one a re-pack re-tuned it to.

Read :class:`MicrobatchCount` first, then :func:`retune_candidates` (the counts a re-pack may choose from).

Changing the count changes nothing the model learns as long as the micro-batches of a step are equal in
size: the loss of a step is the mean of the micro-batches' mean losses and its gradients their mean, which
is the batch's mean either way. So a re-tuned count is used only for batches it divides; any other batch
(e.g. a smaller last batch) runs with the configured count, which the user made fit. The strategy
rebuilds its pipeline whenever the count or the batch shapes change (torch's stages fix both when built).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.pipeline.placement.release import schedule_runs
from lightning_dynmo.pipeline.step.schedule import ScheduleSpec

__all__ = ["MicrobatchCount", "retune_candidates"]

log = logging.getLogger(__name__)


class MicrobatchCount:
    """The configured micro-batch count, an optional re-tuned one, and the one the built pipeline runs.

    Args:
        configured: ``DynMoStrategy(num_microbatches=...)``.

    Attributes:
        configured: The configured count.
        retuned: The count a re-pack set (``None``: never re-tuned).
        current: The count the built pipeline runs.
        batch_shape: The count and tensor shapes of the last batch the built pipeline ran (``None`` once
            the strategy rebuilds it).
    """

    def __init__(self, configured: int) -> None:
        self.configured = configured
        self.retuned: int | None = None
        self.current = configured
        self.batch_shape: tuple[Any, ...] | None = None

    def for_batch(self, batch_size: int) -> int:
        """The count for a batch of ``batch_size`` samples (the re-tuned one if it divides the batch).

        Raises:
            ValueError: if the configured count does not divide the batch either.
        """
        if self.retuned is not None and batch_size % self.retuned == 0:
            return self.retuned
        if batch_size % self.configured != 0:
            raise ValueError(
                f"a batch of {batch_size} samples cannot be cut into num_microbatches={self.configured} "
                f"equal micro-batches; use a batch size that is a multiple of {self.configured} and "
                "drop_last=True in the DataLoader."
            )
        return self.configured

    def new_pipeline_needed(self, inputs: Tensor, target: Tensor, side: Mapping[str, Tensor]) -> bool:
        """Record a batch; True when the built pipeline cannot run it (another count or other shapes).

        The count it needs becomes :attr:`current`, so the pipeline the caller then builds runs it.
        """
        count = self.for_batch(int(inputs.shape[0]))
        shape = (
            count,
            tuple(inputs.shape),
            tuple(target.shape),
            *((k, tuple(v.shape)) for k, v in sorted(side.items())),
        )
        changed = count != self.current or self.batch_shape not in (None, shape)
        if changed:
            log.info("batch (micro-batches, shapes) %s -> %s: rebuilding stages", self.batch_shape, shape)
            self.current = count
        self.batch_shape = shape
        return changed

    def check_retune(
        self, count: int | None, schedule: ScheduleSpec, target: Placement, current: Placement
    ) -> None:
        """Raise unless re-tuning to ``count`` with the move ``current`` -> ``target`` is allowed.

        Args:
            count: The new count (``None``: no re-tune, nothing to check).
            schedule: The strategy's schedule (it must accept ``count`` on the target pipeline).
            target: The placement to apply; it must re-pack (fewer stages than ``current``).
            current: The placement in use.

        Raises:
            ValueError: naming the count, the rule and the fix.
        """
        if count is None:
            return
        if target.num_stages >= current.num_stages:
            raise ValueError(
                f"num_microbatches={count!r} was passed with placement {target}, which keeps the stage "
                f"count ({current.num_stages}); the micro-batch count is re-tuned only with a re-pack "
                "(fewer stages). Drop num_microbatches."
            )
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"num_microbatches={count!r} must be an integer >= 1.")
        batch = self.batch_shape[1][0] if self.batch_shape is not None else None
        if batch is not None and batch % count != 0:
            raise ValueError(
                f"num_microbatches={count} does not divide the batch of {batch} samples: micro-batches "
                f"must be equal for training to stay exact; pick one of {_divisors(batch)}."
            )
        ranks = target.num_stages // schedule.stages_per_rank
        if not schedule_runs(schedule.name, ranks, schedule.stages_per_rank, count):
            raise ValueError(
                f"num_microbatches={count} is rejected by schedule {schedule.name!r} on {ranks} ranks "
                "(1F1B and DualPipeV need at least one per stage; the interleaved schedules a multiple of "
                "their rounds); pick a count it accepts."
            )

    def retune(self, count: int | None) -> None:
        """Run ``count`` micro-batches from the next pipeline build on (checked by :meth:`check_retune`)."""
        if count is not None:
            self.retuned = self.current = count


def retune_candidates(schedule: ScheduleSpec, pipeline_size: int, batch_size: int) -> list[int]:
    """The counts a pipeline of ``pipeline_size`` ranks may run on batches of ``batch_size`` samples."""
    spr = schedule.stages_per_rank
    return [m for m in _divisors(batch_size) if schedule_runs(schedule.name, pipeline_size, spr, m)]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
