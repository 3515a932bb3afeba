"""Pure-Python balancing core: layer costs in, placements out.

Nothing in this package imports torch or lightning (a test enforces it), so it can be read, tested
exhaustively and reused on its own. Reading order: ``costs`` and ``placement`` (the contracts),
``baselines`` (static splits), ``partition`` (exact min-max, built on ``stage_model`` and
``feasibility``), ``diffusion`` (iterative, order-preserving), ``repack`` (fewer stages), ``workers``
(several stages per worker: balance the workers), ``hardware`` (pinned first/last-stage parts, slow
workers and links, which every balancer takes), ``moves`` (what migration executes), ``metrics``
(imbalance and the pipeline simulator), ``gain`` (a rebalance's measured gain), ``headroom`` (what any
rebalance could still gain, bounded from measured stage loads).
"""

from lightning_dynmo.balancing.baselines import by_parameters, uniform
from lightning_dynmo.balancing.costs import COST_VIEWS, LayerCost, layer_weights
from lightning_dynmo.balancing.diffusion import DiffusionResult, diffuse
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.metrics import SCHEDULES, PipelineSimulation, imbalance, simulate_pipeline
from lightning_dynmo.balancing.moves import LayerMove, Move, UnitMove, plan_moves
from lightning_dynmo.balancing.partition import PartitionResult, partition, solve_partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.repack import RepackResult, repack
from lightning_dynmo.balancing.workers import WorkerPartitionResult, partition_workers, worker_loads

__all__ = [
    "COST_VIEWS",
    "SCHEDULES",
    "DiffusionResult",
    "Hardware",
    "LayerCost",
    "LayerMove",
    "Move",
    "PartitionResult",
    "PipelineSimulation",
    "Placement",
    "RepackResult",
    "UnitMove",
    "WorkerPartitionResult",
    "by_parameters",
    "diffuse",
    "imbalance",
    "layer_weights",
    "partition",
    "partition_workers",
    "plan_moves",
    "repack",
    "simulate_pipeline",
    "solve_partition",
    "uniform",
    "worker_loads",
]
