"""Pure-Python balancing core: one problem (layer costs + hardware) in, placements out.

Nothing in this package imports torch or lightning (a test enforces it), so it can be read, tested
exhaustively and reused on its own. Reading order, one line each:

- ``costs``: per-layer cost records and their two views (time, parameters).
- ``fields``: config fields that declare their rule (integer >= k, number >= 0, fraction), checked once.
- ``placement``: an ordered, contiguous assignment of layers to stages.
- ``hardware``: pinned first/last-stage parts, worker slowdowns, links and memory caps.
- ``problem``: :class:`BalanceProblem`, costs + view + hardware validated once, what every balancer takes.
- ``baselines``: the static splits (equal layers, equal parameters).
- ``stage_model``: what a stage costs (load and memory), defined once for the balancers.
- ``feasibility``: the probes of the exact search ("is there a placement under this bound?").
- ``partition``: the exact min-max contiguous partition.
- ``diffusion``: the iterative, order-preserving balancer.
- ``workers``: several stages per worker: balance the workers.
- ``repack``: consolidate onto fewer stages and release the rest.
- ``moves``: the layer moves migration executes.
- ``metrics``: imbalance and the event-driven pipeline simulator.
- ``schedule_model``: a step model that follows each rank's real action list (F, B, I, W), with a critical
  path.
- ``compiled_schedule``: that step compiled once per action lists, one pass per placement (for searches).
- ``placement_search``: the placement a schedule's step predicts fastest, from the balancer's proposal.
- ``step_prediction``: a placement's step under a schedule's action lists (re-exports the search).
- ``trace``: recorded dynamism as costs: a statistic trace, a cost curve, per-step costs and their mean.
- ``microbatches``: the micro-batch count a re-packed pipeline should run.
- ``trigger``: *when* to rebalance (periodic, events, every step, auto).
- ``policy``: *what* to rebalance to, and whether it is worth applying.
- ``gain``: a rebalance's measured gain.
- ``trust``: how far to trust the step model, from the gains moves delivered against their predictions.
- ``background``: one pure call at a time in a helper process (the decision's search while training goes on).
- ``headroom``: what any rebalance could still gain, bounded from measured stage loads.
- ``averaging``: the weights of a bias-corrected moving average over steps (smoothed costs and loads).
- ``spread``: how far each layer's averaged cost strays, and the margin a decision plans it with.
"""

from lightning_dynmo.balancing.baselines import by_parameters, uniform
from lightning_dynmo.balancing.costs import COST_VIEWS, LayerCost, layer_weights
from lightning_dynmo.balancing.diffusion import DiffusionResult, diffuse
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.metrics import SCHEDULES, PipelineSimulation, imbalance, simulate_pipeline
from lightning_dynmo.balancing.moves import LayerMove, Move, UnitMove, plan_moves
from lightning_dynmo.balancing.partition import PartitionResult, partition, solve_partition
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.balancing.problem import BalanceProblem
from lightning_dynmo.balancing.repack import RepackResult, repack
from lightning_dynmo.balancing.schedule_model import LinkTime, StageTimes, StepSimulation, simulate_step
from lightning_dynmo.balancing.workers import WorkerPartitionResult, partition_workers, worker_loads

__all__ = [
    "COST_VIEWS",
    "SCHEDULES",
    "BalanceProblem",
    "DiffusionResult",
    "Hardware",
    "LayerCost",
    "LayerMove",
    "LinkTime",
    "Move",
    "PartitionResult",
    "PipelineSimulation",
    "Placement",
    "RepackResult",
    "StageTimes",
    "StepSimulation",
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
    "simulate_step",
    "solve_partition",
    "uniform",
    "worker_loads",
]
