"""Zhu & Gupta's gradual pruning schedule: which sparsity the model must reach at which optimizer step.

Read :class:`PruningSchedule` (the knobs and the formula), then :meth:`PruningSchedule.target_at` (what a
driver asks at every step) and :meth:`PruningSchedule.from_range` (the same schedule given by its first
and last step, as TF-MOT's ``PolynomialDecay`` takes it).

The formula (Zhu & Gupta 2017, arXiv:1710.01878; DynMo paper appendix C.2), with ``s_i`` the initial
and ``s_f`` the final sparsity, ``t0`` the start step, ``dt`` the frequency and ``n`` the number of
pruning steps::

    s(t) = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt)) ** 3     for t in {t0, t0 + dt, ..., t0 + n*dt}

So there are ``n + 1`` documented steps: ``t0`` prunes to ``s_i`` (nothing when ``s_i = 0``), each next
one to the level of the formula, and ``t0 + n*dt`` to exactly ``s_f`` (the last factor is ``0 ** 3``).
The reference code of the paper applies the level of ``t - dt`` at ``t`` and stops one step early, which
ends at 0.7875 instead of 0.9 with its defaults; here step ``t`` gets ``s(t)`` and the last one ``s_f``
(``tests/unit/dynamism/test_pruning_schedule.py`` checks both against the formula).

Torch-free: plain numbers in and out.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_dynmo.balancing.fields import check_fields, check_int, fraction_field, int_field

__all__ = ["PruningSchedule"]

_SPARSITY = "the share of prunable weights set to zero (1 would remove every weight), e.g. 0.9"
_FREQUENCY = "the optimizer steps between two pruning steps, e.g. 10"


@dataclass(frozen=True, kw_only=True)
class PruningSchedule:
    """When to prune and to which global sparsity (fraction of prunable weights that are zero).

    Steps are optimizer steps (Lightning's ``trainer.global_step``): pruning "at step ``t``" happens
    after ``t`` optimizer steps, before the forward of step ``t + 1``. The defaults are the paper's
    weak-scaling runs: from step 30 to step 70, every 10 steps, up to 90%.

    Attributes:
        final_sparsity: ``s_f``, the sparsity after the last pruning step, in ``[0, 1)``.
        initial_sparsity: ``s_i``, the sparsity the first pruning step prunes to, in ``[0, s_f]``.
        start_step: ``t0``, the first pruning step (>= 0).
        frequency: ``dt``, optimizer steps between two pruning steps (>= 1).
        num_steps: ``n``, the number of pruning intervals (>= 1): the schedule prunes at ``n + 1`` steps,
            ``t0`` to ``t0 + n * dt``.
    """

    final_sparsity: float = fraction_field(0.9, _SPARSITY)
    initial_sparsity: float = fraction_field(0.0, _SPARSITY)
    start_step: int = int_field(30, minimum=0, hint="the first pruning step, e.g. 0 or 30")
    frequency: int = int_field(10, minimum=1, hint=_FREQUENCY)
    num_steps: int = 4  # checked below: a count under 1 gets its own message

    def __post_init__(self) -> None:
        check_fields(self)
        if self.initial_sparsity > self.final_sparsity:
            raise ValueError(
                f"PruningSchedule.initial_sparsity={self.initial_sparsity} is above final_sparsity="
                f"{self.final_sparsity}; pruned weights never come back, so the sparsity can only grow: "
                "give an initial_sparsity <= final_sparsity."
            )
        if isinstance(self.num_steps, int) and not isinstance(self.num_steps, bool) and self.num_steps < 1:
            raise ValueError(
                f"PruningSchedule.num_steps={self.num_steps} makes the schedule end at step {self.end_step} "
                f"(start_step + num_steps * frequency), not after its start at step {self.start_step}: it "
                "would end before it starts. Give num_steps >= 1 (the number of pruning intervals)."
            )
        check_int(self.num_steps, "PruningSchedule.num_steps", 1, "the number of pruning intervals, e.g. 4")

    @classmethod
    def from_range(
        cls,
        *,
        start_step: int,
        end_step: int,
        frequency: int,
        final_sparsity: float,
        initial_sparsity: float = 0.0,
    ) -> PruningSchedule:
        """The schedule pruning every ``frequency`` steps from ``start_step`` to ``end_step`` (both included).

        Raises:
            ValueError: ``end_step <= start_step`` (the schedule would end before it starts), or
                ``end_step - start_step`` not a multiple of ``frequency`` (the last step would not be a
                pruning step, so the final sparsity would never be reached), or a bad value of a field.
        """
        check_int(frequency, "PruningSchedule.frequency", 1, _FREQUENCY)
        if end_step <= start_step:
            raise ValueError(
                f"PruningSchedule.from_range(start_step={start_step}, end_step={end_step}): the schedule "
                "ends before it starts; give an end_step after start_step."
            )
        if (end_step - start_step) % frequency:
            raise ValueError(
                f"PruningSchedule.from_range(start_step={start_step}, end_step={end_step}, frequency="
                f"{frequency}): end_step - start_step = {end_step - start_step} is not a multiple of the "
                "frequency, so the last pruning step would miss end_step and the final sparsity; move "
                "end_step or pick a frequency that divides the range."
            )
        return cls(
            final_sparsity=final_sparsity,
            initial_sparsity=initial_sparsity,
            start_step=start_step,
            frequency=frequency,
            num_steps=(end_step - start_step) // frequency,
        )

    @property
    def end_step(self) -> int:
        """The last pruning step, ``t0 + n * dt`` (it prunes to exactly ``final_sparsity``)."""
        return self.start_step + self.num_steps * self.frequency

    @property
    def steps(self) -> tuple[int, ...]:
        """Every pruning step, ``t0, t0 + dt, ..., t0 + n * dt``."""
        return tuple(self.start_step + j * self.frequency for j in range(self.num_steps + 1))

    def level(self, j: int) -> float:
        """The sparsity of pruning step ``j`` (``0 <= j <= num_steps``); ``level(num_steps)`` is ``s_f``."""
        if not 0 <= j <= self.num_steps:
            raise ValueError(f"PruningSchedule.level(j={j}): j must be in [0, num_steps={self.num_steps}].")
        remaining = 1.0 - j / self.num_steps
        return self.final_sparsity + (self.initial_sparsity - self.final_sparsity) * remaining**3

    def target_at(self, step: int) -> float | None:
        """The sparsity to prune to at ``step``, or ``None`` when ``step`` is not a pruning step."""
        offset = step - self.start_step
        if offset < 0 or offset % self.frequency or offset // self.frequency > self.num_steps:
            return None
        return self.level(offset // self.frequency)

    def sparsity_after(self, step: int) -> float:
        """The sparsity the model has once the pruning of ``step`` (if any) is done; 0 before ``t0``."""
        if step < self.start_step:
            return 0.0
        j = min((step - self.start_step) // self.frequency, self.num_steps)
        return self.level(j)
