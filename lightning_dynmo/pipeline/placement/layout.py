"""Where things live: the data x pipeline rank grid, stage -> rank maps and unit ownership.

Read in this order: :class:`RankGrid` (which global ranks form each pipeline and each data-parallel
group), :func:`stage_to_pipeline_rank` (how placement stages map onto pipeline ranks, including the
virtual stages of multi-stage schedules), :func:`unit_owners` and :func:`unit_moves` (which rank owns
each migratable unit under a placement, and what must move between two placements).

Pure Python on purpose: every rank computes the same answers from the same inputs, so decisions agree
without communication, and the whole module is unit-tested without process groups.

Units are the pieces a placement moves: ``"layers.<i>"`` for block ``i`` plus the names of the model's
first-stage parts (always with stage 0) and last-stage parts (always with the last stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_dynmo.balancing.baselines import by_parameters, uniform
from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.moves import UnitMove
from lightning_dynmo.balancing.placement import Placement

#: The old name of :data:`~lightning_dynmo.balancing.moves.UnitMove` (docs/guides/balancing.md).
PlannedMove = UnitMove

StageStyle = Literal["loop", "v"]


@dataclass(frozen=True)
class RankGrid:
    """A ``data_parallel_size x pipeline_size`` grid of global ranks.

    Global rank ``g`` is pipeline rank ``g % pipeline_size`` of data-parallel replica
    ``g // pipeline_size``: the ranks of one pipeline are contiguous, so on a multi-GPU node a
    pipeline's point-to-point traffic stays on neighbouring devices.

    Args:
        world_size: Number of processes taking part.
        pipeline_size: Ranks per pipeline; must divide ``world_size``.
    """

    world_size: int
    pipeline_size: int

    def __post_init__(self) -> None:
        if self.pipeline_size < 1 or self.world_size % self.pipeline_size != 0:
            raise ValueError(
                f"pipeline_size={self.pipeline_size} does not divide the world size {self.world_size}: "
                "the world is split into data-parallel replicas of pipeline_size ranks each. Choose a "
                f"pipeline_size among the divisors {_divisors(self.world_size)} or change the number of "
                "devices."
            )

    @property
    def data_parallel_size(self) -> int:
        """Number of pipeline replicas."""
        return self.world_size // self.pipeline_size

    @property
    def replica_stride(self) -> int:
        """Global ranks from one replica's first rank to the next one's (``pipeline_size`` at launch)."""
        return self.pipeline_size

    def pipeline_rank(self, global_rank: int) -> int:
        """Position of ``global_rank`` inside its replica."""
        return global_rank % self.replica_stride

    def data_parallel_rank(self, global_rank: int) -> int:
        """Index of the replica ``global_rank`` belongs to."""
        return global_rank // self.replica_stride

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """Global ranks of replica ``replica``'s pipeline, in pipeline order."""
        start = replica * self.replica_stride
        return tuple(range(start, start + self.pipeline_size))

    def data_parallel_ranks(self, pipeline_rank: int) -> tuple[int, ...]:
        """Global ranks holding pipeline position ``pipeline_rank`` in every replica."""
        return tuple(d * self.replica_stride + pipeline_rank for d in range(self.data_parallel_size))

    def global_rank(self, replica: int, pipeline_rank: int) -> int:
        """Inverse of (:meth:`data_parallel_rank`, :meth:`pipeline_rank`)."""
        return replica * self.replica_stride + pipeline_rank


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stage_to_pipeline_rank(stage: int, num_stages: int, pipeline_size: int, style: StageStyle) -> int:
    """The pipeline rank that runs placement stage ``stage``.

    With one stage per rank this is the identity. Multi-stage schedules give each rank
    ``num_stages / pipeline_size`` virtual stages: the ``"loop"`` style (interleaved schedules) puts
    stage ``s`` on rank ``s % pipeline_size``; the ``"v"`` style (ZBV, DualPipeV; two stages per rank)
    puts stages ``r`` and ``2 * pipeline_size - 1 - r`` on rank ``r``, so rank 0 holds both the first
    and the last stage. These match torch's ``generate_stage_to_rank_mapping``.
    """
    if not 0 <= stage < num_stages or num_stages % pipeline_size != 0:
        raise ValueError(
            f"stage={stage} with num_stages={num_stages} and pipeline_size={pipeline_size}: the stage must "
            "be in range and num_stages a multiple of pipeline_size."
        )
    if style == "loop":
        return stage % pipeline_size
    if num_stages != 2 * pipeline_size:
        raise ValueError(
            f"the 'v' style needs exactly 2 stages per rank, got {num_stages} over {pipeline_size}."
        )
    return stage if stage < pipeline_size else 2 * pipeline_size - 1 - stage


def stages_of_pipeline_rank(
    pipeline_rank: int, num_stages: int, pipeline_size: int, style: StageStyle
) -> tuple[int, ...]:
    """The placement stages pipeline rank ``pipeline_rank`` runs, in increasing stage order."""
    return tuple(
        s
        for s in range(num_stages)
        if stage_to_pipeline_rank(s, num_stages, pipeline_size, style) == pipeline_rank
    )


def unit_names(num_layers: int, first_parts: Sequence[str], last_parts: Sequence[str]) -> tuple[str, ...]:
    """Every migratable unit in model order: first-stage parts, blocks, last-stage parts."""
    return (*first_parts, *(f"layers.{i}" for i in range(num_layers)), *last_parts)


def unit_stage(unit: str, placement: Placement, first_parts: Sequence[str], last_parts: Sequence[str]) -> int:
    """The placement stage that owns ``unit``."""
    if unit in first_parts:
        return 0
    if unit in last_parts:
        return placement.num_stages - 1
    prefix, _, index = unit.partition(".")
    if prefix != "layers" or not index.isdigit():
        raise ValueError(f"unit={unit!r} is neither 'layers.<i>' nor a first/last-stage part name.")
    return placement.stage_of(int(index))


def unit_owners(
    placement: Placement,
    grid: RankGrid,
    style: StageStyle,
    first_parts: Sequence[str] = (),
    last_parts: Sequence[str] = (),
) -> dict[tuple[int, str], int]:
    """The global rank owning each unit of each replica under ``placement``.

    Returns:
        ``{(replica, unit): global_rank}`` for every replica and every unit.
    """
    owners: dict[tuple[int, str], int] = {}
    for unit in unit_names(placement.num_layers, first_parts, last_parts):
        stage = unit_stage(unit, placement, first_parts, last_parts)
        prank = stage_to_pipeline_rank(stage, placement.num_stages, grid.pipeline_size, style)
        for replica in range(grid.data_parallel_size):
            owners[(replica, unit)] = grid.global_rank(replica, prank)
    return owners


def unit_moves(
    old: Placement,
    new: Placement,
    grid: RankGrid,
    style: StageStyle,
    first_parts: Sequence[str] = (),
    last_parts: Sequence[str] = (),
    *,
    new_grid: RankGrid | None = None,
) -> list[UnitMove]:
    """The units that change owner when ``old`` on ``grid`` becomes ``new`` on ``new_grid``.

    Replica by replica, in model order: every rank computes the same list in the same order, which is what
    lets point-to-point transfers pair up without negotiation. A migration keeps the grid (``new_grid``
    ``None``); a re-pack passes the smaller grid :func:`~.release.plan_repack` worked out.

    Raises:
        ValueError: the placements cover different layers, or the grids have different replica counts.
    """
    new_grid = grid if new_grid is None else new_grid
    rule = "the layers and the replica count must stay the same"
    if old.num_layers != new.num_layers:
        raise ValueError(
            f"placement {new} covers {new.num_layers} layers but the current placement {old} covers "
            f"{old.num_layers}; {rule}."
        )
    if grid.data_parallel_size != new_grid.data_parallel_size:
        raise ValueError(
            f"placement {new} on {new_grid.data_parallel_size} replicas cannot follow {old} on "
            f"{grid.data_parallel_size}; {rule}."
        )
    before = unit_owners(old, grid, style, first_parts, last_parts)
    after = unit_owners(new, new_grid, style, first_parts, last_parts)
    return [
        UnitMove(unit, before[(replica, unit)], after[(replica, unit)])
        for replica in range(grid.data_parallel_size)
        for unit in unit_names(old.num_layers, first_parts, last_parts)
        if before[(replica, unit)] != after[(replica, unit)]
    ]


def initial_placement(
    policy: str | Placement, num_layers: int, num_stages: int, layer_num_params: Sequence[int] = ()
) -> Placement:
    """Resolve the strategy's ``placement`` argument into a placement with ``num_stages`` stages.

    Args:
        policy: ``"uniform"`` (equal layer counts), ``"parameters"`` (balanced parameter counts, needs
            ``layer_num_params``), a placement string like ``"0-2|3-5"`` or a :class:`Placement`.
        num_layers: Blocks in the model.
        num_stages: Stages of this run (pipeline size times stages per rank).
        layer_num_params: Parameter count of each block (for ``"parameters"``).

    Raises:
        ValueError: if there are more stages than layers, or the placement does not cover the model
            or has the wrong number of stages.
    """
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages but the model has only {num_layers} layers; every stage needs "
            "at least one layer. Use a smaller pipeline_size, a single-stage schedule (GPipe, 1F1B) or a "
            "deeper model."
        )
    if policy == "uniform":
        placement = uniform(num_layers, num_stages)
    elif policy == "parameters":
        costs = [LayerCost(num_params=n) for n in layer_num_params]
        placement = by_parameters(costs, num_stages)
    elif isinstance(policy, Placement):
        placement = policy
    else:
        placement = Placement.from_string(policy, num_layers=num_layers)
    check_placement(placement, num_layers, num_stages)
    return placement


def check_placement(placement: Placement, num_layers: int, num_stages: int) -> None:
    """Raise a ``ValueError`` unless ``placement`` covers ``num_layers`` layers with ``num_stages`` stages."""
    if placement.num_layers != num_layers:
        raise ValueError(
            f"placement {placement} covers {placement.num_layers} layers but the model has {num_layers}; "
            f"the last stage must end at layer {num_layers - 1}."
        )
    if placement.num_stages != num_stages:
        raise ValueError(
            f"placement {placement} has {placement.num_stages} stages but this run has {num_stages} "
            "(pipeline_size "
            "times the stages each rank runs: 1 for GPipe/1F1B, 2 for multi-stage schedules); give one "
            "'|'-separated range per stage."
        )
