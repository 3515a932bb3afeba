"""Paired, per-round comparison of step times: held-out ideal, ratios per round, a sign-test verdict.

On a noisy machine two fixed placements measured in separate jobs differ by 15-28% from round to round,
more than most cases' imbalance. Three rules keep a verdict honest there:

- **Pair by round.** Every ratio is taken between runs of the *same* round (interleaved, so a drift of the
  machine hits both), then summarised by its median over rounds, instead of a ratio of two medians.
- **Hold the ideal out.** The best fixed placement found by measurement is biased fast (the winner of
  several noisy candidates was also lucky): for round ``r`` the ideal is the candidate with the lowest
  median over the *other* rounds, and its round-``r`` time is what the others are compared with. With
  one round there is nothing to hold out and the in-sample best is used (said in the report).
- **Count the rounds** (a sign test). A case is *imbalanced* only if the better static split is slower
  than the held-out ideal in every round and by more than ``gap`` at the median; DynMo is *slower than
  static beyond noise* only if it is slower in every round of at least :data:`MIN_SIGN_ROUNDS` (with 4
  rounds, 1 chance in 16 under no difference).

Pure Python: the benchmarks feed it the step times their jobs measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_SIGN_ROUNDS = 4  # fewest rounds for "slower in every round" to mean more than noise


@dataclass(frozen=True)
class PairedComparison:
    """DynMo variants against the better static split and a held-out ideal, round by round.

    Attributes:
        static: Name of the better static run (the lower median of the static runs).
        ideal: Per round, the fixed placement serving as the ideal (held out from that round).
        static_ms: Per round, the better static run's step time.
        ideal_ms: Per round, the ideal's step time.
        imbalance: Per round, better static time / ideal time (> 1: the static split is slower).
        speedup: Per DynMo variant, per round, better static time / variant time.
        of_ideal: Per DynMo variant, per round, ideal time / variant time.
        best: The DynMo variant with the highest median speedup.
        imbalanced: Whether the static split is slower than the ideal in every round, by more than the gap.
        held_out: Whether the ideal was held out (False with one round: the in-sample best).
    """

    static: str
    ideal: tuple[str, ...]
    static_ms: tuple[float, ...]
    ideal_ms: tuple[float, ...]
    imbalance: tuple[float, ...]
    speedup: Mapping[str, tuple[float, ...]]
    of_ideal: Mapping[str, tuple[float, ...]]
    best: str
    imbalanced: bool
    held_out: bool

    @property
    def rounds(self) -> int:
        return len(self.imbalance)

    def median_speedup(self, variant: str | None = None) -> float:
        return statistics.median(self.speedup[variant or self.best])

    def median_of_ideal(self, variant: str | None = None) -> float:
        return statistics.median(self.of_ideal[variant or self.best])

    def slower_beyond_noise(self, variant: str | None = None) -> bool:
        """DynMo slower than the better static split in every round, with enough rounds to mean it."""
        speedup = self.speedup[variant or self.best]
        return len(speedup) >= MIN_SIGN_ROUNDS and all(s < 1.0 for s in speedup)

    def meets_target(self, variant: str | None = None) -> bool:
        """>= 1.0x the better static split and >= 90% of the ideal (medians of the paired ratios)."""
        return self.median_speedup(variant) >= 1.0 and self.median_of_ideal(variant) >= 0.9


def _check_rounds(runs: Mapping[str, Sequence[float]]) -> int:
    lengths = {len(v) for v in runs.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"every run needs the same number (>= 1) of per-round times, got {sorted(lengths)}: "
            "measure each run once per round"
        )
    return lengths.pop()


def held_out_best(candidates: Mapping[str, Sequence[float]]) -> list[str]:
    """Per round ``r``, the candidate with the lowest median over the rounds other than ``r``.

    With a single round, the in-sample best. Ties go to the candidate listed first.
    """
    rounds = _check_rounds(candidates)
    if rounds == 1:
        return [min(candidates, key=lambda p: candidates[p][0])]
    picks = []
    for r in range(rounds):
        others = {p: statistics.median(t for i, t in enumerate(ts) if i != r) for p, ts in candidates.items()}
        picks.append(min(others, key=lambda p: others[p]))
    return picks


def compare(
    statics: Mapping[str, Sequence[float]],
    dynmo: Mapping[str, Sequence[float]],
    candidates: Mapping[str, Sequence[float]],
    gap: float,
    held_out: bool = True,
) -> PairedComparison:
    """Pair every DynMo variant with the better static run and the ideal, round by round.

    Args:
        statics: Per static run (name), its step time in each round.
        dynmo: Per DynMo variant, its step time in each round.
        candidates: Per fixed placement the ideal is chosen among, its step time in each round.
        gap: How much slower than the ideal (at the median) the static split must be to be imbalanced.
        held_out: Choose the ideal without the round it is compared in (``False`` when the ideal was
            not chosen by measurement, such as the exact partition of emulated costs: one candidate).
    """
    if not statics or not dynmo or not candidates:
        raise ValueError("compare needs at least one static run, one DynMo variant and one candidate")
    rounds = _check_rounds({**statics, **dynmo, **candidates})
    static = min(statics, key=lambda k: statistics.median(statics[k]))
    static_ms = statics[static]
    if held_out and rounds > 1:
        ideal = held_out_best(candidates)
    else:
        best = min(candidates, key=lambda p: statistics.median(candidates[p]))
        ideal = [best] * rounds
    ideal_ms = [candidates[p][r] for r, p in enumerate(ideal)]
    imbalance = tuple(s / i for s, i in zip(static_ms, ideal_ms, strict=True))
    speedup = {v: tuple(s / d for s, d in zip(static_ms, ts, strict=True)) for v, ts in dynmo.items()}
    of_ideal = {v: tuple(i / d for i, d in zip(ideal_ms, ts, strict=True)) for v, ts in dynmo.items()}
    return PairedComparison(
        static=static,
        ideal=tuple(ideal),
        static_ms=tuple(static_ms),
        ideal_ms=tuple(ideal_ms),
        imbalance=imbalance,
        speedup=speedup,
        of_ideal=of_ideal,
        best=max(speedup, key=lambda v: statistics.median(speedup[v])),
        imbalanced=statistics.median(imbalance) > 1.0 + gap and all(x > 1.0 for x in imbalance),
        held_out=held_out and rounds > 1,
    )
