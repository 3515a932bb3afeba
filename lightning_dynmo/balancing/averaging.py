"""Moving averages of noisy measurements whose first sample does not outweigh the rest.

The callback averages each layer's measured times over its windows
(:func:`~lightning_dynmo.balancing.policy.smooth_costs`) and the stages' busy times over steps
(:class:`~lightning_dynmo.balancing.headroom.StageLoadAverage`), both by the recursion
``a = h a + (1 - h) x``. :class:`HistoryWeight` gives ``h`` for each new sample ``x``.

Started from its first sample with a fixed ``h = w``, that recursion keeps ``w ** (n - 1)`` of the first
sample for ever after: with ``w = 0.8``, 41% after five samples, so a first window unlike the rest (the
routing at the start of a run, a placement's first step) steers the decisions long after it. Weighing
the sample taken ``k`` steps ago by ``(1 - w) w ** k`` and dividing by the weights' sum (the correction
Adam applies to its moments) gives it 12% there. Counting ``k`` in steps rather than samples ages a
window's costs by the steps its successors skipped (an every-step callback skips the windows a balanced
pipeline does not need).
"""

from __future__ import annotations

__all__ = ["HistoryWeight"]


class HistoryWeight:
    """The history's weight ``h`` in each update ``a = h a + (1 - h) x`` of a bias-corrected moving
    average over steps.

    The average is ``sum_i (1 - w) w ** (t - t_i) x_i / sum_i (1 - w) w ** (t - t_i)`` over the samples
    ``x_i`` taken at steps ``t_i``, ``t`` the newest: ``h`` is 0 for the first sample, ``w / (1 + w)``
    for a second one a step later, and tends to ``w`` on consecutive steps; a sample ``d`` steps after the
    last one finds the history aged by ``w ** d``.

    Args:
        weight: ``w`` in ``[0, 1)``: 0 keeps only the newest sample.

    Raises:
        ValueError: if ``weight`` is outside ``[0, 1)``.
    """

    def __init__(self, weight: float) -> None:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight < 1.0:
            raise ValueError(f"weight={weight!r} must be in [0, 1): the weight of the history.")
        self.weight = float(weight)
        self._mass = 0.0  # sum of the samples' weights (1 - w) w ** age
        self._step: int | None = None

    def restart(self) -> None:
        """Forget the samples: the next one is the whole average."""
        self._mass, self._step = 0.0, None

    def next(self, step: int | None = None) -> float:
        """``h`` for a sample taken at ``step``; ``None``: one step after the last sample.

        Raises:
            ValueError: if ``step`` is not after the last sample's.
        """
        if step is None:
            step = 0 if self._step is None else self._step + 1
        elapsed = 1 if self._step is None else step - self._step
        if elapsed < 1:
            raise ValueError(f"step={step} must come after the last sample's step {self._step}.")
        history = self.weight**elapsed * self._mass
        self._mass, self._step = history + (1.0 - self.weight), step
        return history / self._mass
