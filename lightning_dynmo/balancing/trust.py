"""How far to trust the step model: moves that did not deliver their predicted gain raise the bar, then stop.

Read :class:`TrustConfig` first, then :class:`PredictionTrust`. Every applied move is predicted to save a
share of the step time; the callback then measures what it saved (:mod:`.gain`). A move *misses* when it
measured less than ``delivered_share`` of its prediction (a re-pack, which promises no gain, is not
judged). After ``misses_to_widen`` misses in a row the step model is trusted less: a move must be
predicted faster by ``min_gain`` plus the mean shortfall of those misses (what the model over-promised).
After ``misses_to_stop`` in a row, DynMo stops moving for the rest of the job and says so once:
predictions that keep missing would only move layers back and forth. A move that delivers resets the
count. The state is plain numbers, the same on every rank (it is fed the agreed measurements), and it is
saved in the callback's checkpoint state.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_dynmo.balancing._checks import check_int, check_positive

__all__ = ["PredictionTrust", "TrustConfig"]


@dataclass(frozen=True, kw_only=True)
class TrustConfig:
    """When predictions count as missing, and what follows.

    Attributes:
        delivered_share: A move misses when its measured gain is below this share of its predicted gain,
            in ``(0, 1]``.
        misses_to_widen: Misses in a row after which the required predicted gain grows by their mean
            shortfall (>= 1; ``None``: never).
        misses_to_stop: Misses in a row after which DynMo stops moving (>= 1; ``None``: never).
    """

    delivered_share: float = 0.5
    misses_to_widen: int | None = 2
    misses_to_stop: int | None = 3

    def __post_init__(self) -> None:
        check_positive(self.delivered_share, "delivered_share", allow_zero=False)
        if self.delivered_share > 1:
            raise ValueError(
                f"delivered_share={self.delivered_share} must be at most 1 (a share of the gain)."
            )
        for name in ("misses_to_widen", "misses_to_stop"):
            value = getattr(self, name)
            if value is not None:
                check_int(value, name, 1, "use None to switch it off")


class PredictionTrust:
    """The run of predictions that missed, the margin it asks for, and whether moving has stopped.

    Args:
        config: The rules.
    """

    def __init__(self, config: TrustConfig = TrustConfig()) -> None:  # frozen: safe to share
        self.config = config
        self._shortfalls: list[float] = []  # predicted - measured of the misses in a row
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether DynMo stopped moving (for the rest of the job)."""
        return self._stopped

    @property
    def misses_in_a_row(self) -> int:
        return len(self._shortfalls)

    def required_gain(self, min_gain: float) -> float:
        """The predicted gain a move needs now: ``min_gain``, plus the mean shortfall once widened."""
        widen = self.config.misses_to_widen
        if widen is None or len(self._shortfalls) < widen:
            return min_gain
        return min_gain + statistics.mean(self._shortfalls)

    def delivered(self, predicted_gain: float, measured_gain: float) -> bool:
        """Whether a move that promised a gain measured at least ``delivered_share`` of it (not a miss).

        A move that promised no gain (a re-pack onto fewer ranks accepts a slowdown) is not judged: ``False``.
        """
        return predicted_gain > 0 and measured_gain >= self.config.delivered_share * predicted_gain

    def observe(self, predicted_gain: float, measured_gain: float) -> str | None:
        """Feed one move's predicted and measured gain (fractions); a line to log when trust changes.

        A move that promised no gain (a re-pack onto fewer ranks accepts a slowdown) is not judged.
        """
        if predicted_gain <= 0:
            return None
        if self.delivered(predicted_gain, measured_gain):
            self._shortfalls.clear()
            return None
        self._shortfalls.append(predicted_gain - measured_gain)
        misses, stop, widen = len(self._shortfalls), self.config.misses_to_stop, self.config.misses_to_widen
        if stop is not None and misses >= stop and not self._stopped:
            self._stopped = True
            return (
                f"DynMo stops moving layers: {misses} moves in a row measured less than "
                f"{self.config.delivered_share:.0%} of their predicted gain (last: predicted "
                f"{predicted_gain:+.1%}, measured {measured_gain:+.1%}); the placement stays as it is."
            )
        if widen is not None and misses >= widen:
            return (
                f"DynMo trusts its step model less: {misses} moves in a row missed their prediction (last: "
                f"predicted {predicted_gain:+.1%}, measured {measured_gain:+.1%}); a move now needs a "
                f"predicted gain {statistics.mean(self._shortfalls):.1%} above min_gain."
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"shortfalls": list(self._shortfalls), "stopped": self._stopped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._shortfalls = [float(x) for x in state["shortfalls"]]
        self._stopped = bool(state["stopped"])
