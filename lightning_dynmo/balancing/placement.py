"""Placement: which contiguous run of layers each pipeline stage owns.

Read in this order: :class:`Placement` (the contract), then ``from_string`` / ``from_sizes`` (ways to
build one). A placement is always ordered, contiguous and has no empty stage, so a stage runs its
layers in global index order and layer order is never permuted. Its canonical text form is
``"0-3|4-6|7-9"`` (inclusive ranges, stages separated by ``|``), used in logs, errors and tests.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dynmo.balancing.costs import LayerCost, check_view, layer_weights


@dataclass(frozen=True)
class Placement:
    """An ordered, contiguous, non-empty split of layers ``0..n-1`` over pipeline stages.

    Args:
        boundaries: ``num_stages + 1`` strictly increasing integers starting at 0; stage ``s`` owns
            layers ``boundaries[s] .. boundaries[s+1] - 1``. Most code builds placements with
            :meth:`from_string` or :meth:`from_sizes` instead.

    Raises:
        ValueError: if the boundaries describe gaps, overlaps, empty stages or layers out of order.
    """

    boundaries: tuple[int, ...]

    def __post_init__(self) -> None:
        b = tuple(self.boundaries)
        object.__setattr__(self, "boundaries", b)
        if len(b) < 2:
            raise ValueError(
                f"Placement needs at least one stage (2 boundaries), got boundaries={b!r}. "
                "Build it with Placement.from_sizes([...]) or Placement.from_string('0-3|4-7')."
            )
        if any(not isinstance(x, int) or isinstance(x, bool) for x in b):
            raise ValueError(f"Placement boundaries must be integers, got {b!r}.")
        if b[0] != 0:
            raise ValueError(f"Placement must start at layer 0, got boundaries={b!r}.")
        for s in range(len(b) - 1):
            if b[s + 1] <= b[s]:
                raise ValueError(
                    f"Placement stage {s} is empty or out of order (boundaries={b!r}): every stage "
                    "needs at least one layer and stages must follow layer order."
                )

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> Placement:
        """Build a placement from the number of layers of each stage, e.g. ``[4, 3, 3]``."""
        if len(sizes) == 0:
            raise ValueError("sizes is empty; a placement needs at least one stage.")
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1]
        if bad:
            raise ValueError(
                f"sizes={list(sizes)!r} has stage sizes {bad!r}; every stage needs an integer number "
                "of layers >= 1."
            )
        bounds = [0]
        for s in sizes:
            bounds.append(bounds[-1] + s)
        return cls(tuple(bounds))

    @classmethod
    def from_string(cls, text: str, num_layers: int | None = None) -> Placement:
        """Parse the canonical text form ``"0-3|4-6|7-9"`` (a stage of one layer may be ``"5"``).

        Args:
            text: The placement string.
            num_layers: If given, the placement must cover exactly this many layers.

        Raises:
            ValueError: naming the offending stage if the string is malformed, has gaps or overlaps,
                is out of order, or does not cover ``num_layers`` layers.
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"placement={text!r} is not a placement string; write stages as inclusive layer "
                "ranges separated by '|', e.g. '0-3|4-6|7-9'."
            )
        bounds = [0]
        for s, part in enumerate(text.strip().split("|")):
            first, last = _parse_range(part.strip(), s, text)
            if first != bounds[-1]:
                what = "a gap before" if first > bounds[-1] else "an overlap at"
                raise ValueError(
                    f"placement={text!r}: stage {s} ({part.strip()!r}) starts at layer {first} but the "
                    f"previous stage ended at layer {bounds[-1] - 1}, {what} layer {min(first, bounds[-1])}. "
                    f"Stage {s} must start at layer {bounds[-1]}."
                )
            bounds.append(last + 1)
        placement = cls(tuple(bounds))
        if num_layers is not None and placement.num_layers != num_layers:
            raise ValueError(
                f"placement={text!r} covers {placement.num_layers} layers but the model has "
                f"{num_layers}; the last stage must end at layer {num_layers - 1}."
            )
        return placement

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        """Number of layers covered (layers are ``0 .. num_layers - 1``)."""
        return self.boundaries[-1]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of layers of each stage."""
        b = self.boundaries
        return tuple(b[s + 1] - b[s] for s in range(self.num_stages))

    def layers_of(self, stage: int) -> range:
        """The global layer indices owned by ``stage``, in order."""
        self._check_stage(stage)
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_of(self, layer: int) -> int:
        """The stage that owns global layer index ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is outside this placement's layers 0..{self.num_layers - 1}.")
        return bisect.bisect_right(self.boundaries, layer) - 1

    def layer_to_stage(self) -> tuple[int, ...]:
        """The owning stage of every layer, indexed by layer."""
        return tuple(s for s in range(self.num_stages) for _ in self.layers_of(s))

    def stage_loads(self, costs: Sequence[LayerCost], by: str = "time") -> tuple[float, ...]:
        """Sum of the layers' weights on each stage under a cost view (``"time"`` or ``"params"``)."""
        check_view(by)
        if len(costs) != self.num_layers:
            raise ValueError(
                f"costs has {len(costs)} records but the placement {self} covers {self.num_layers} layers; "
                "pass exactly one LayerCost per layer."
            )
        weights = layer_weights(costs, by)
        return tuple(sum(weights[i] for i in self.layers_of(s)) for s in range(self.num_stages))

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage={stage} is outside this placement's stages 0..{self.num_stages - 1}.")

    def __str__(self) -> str:
        return "|".join(f"{r.start}-{r.stop - 1}" for r in map(self.layers_of, range(self.num_stages)))

    def __repr__(self) -> str:
        return f"Placement('{self}')"


def _parse_range(part: str, stage: int, text: str) -> tuple[int, int]:
    pieces = part.split("-")
    try:
        if len(pieces) == 1:
            first = last = int(pieces[0])
        elif len(pieces) == 2:
            first, last = int(pieces[0]), int(pieces[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"placement={text!r}: stage {stage} is {part!r}, not an inclusive layer range like '4-6' "
            "(or a single layer like '5')."
        ) from None
    if first < 0 or last < first:
        raise ValueError(
            f"placement={text!r}: stage {stage} is {part!r}; a range 'a-b' needs 0 <= a <= b "
            "(an empty or reversed stage is not allowed)."
        )
    return first, last
