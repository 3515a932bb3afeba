"""The six traces at the paper's setup, projected: its model shape, 32 micro-batches, 1F1B and ZBV.

The paper's appendix: GPT models of 24-48 layers, hidden 1024, 32 heads, sequence 2048, micro-batch 2,
32 micro-batches per pipeline, a near-zero-bubble schedule. Pure simulation with the policy's step model
(:func:`~lightning_dynmo.balancing.step_prediction.predict_step`, the schedule's own action lists), as
:mod:`benchmarks.projection`, whose policies it reuses. **Projected from GPU costs (scaled)**:

- **A dense block**: the median trained block of the first GPU check (one H200, bf16, d_model 1024,
  16 heads, seq 1024, 2 sequences per micro-batch; ``results/gpu/2026-11-27/gpu_check.json``, the
  freezing part's trained blocks), forward and backward, scaled to seq 2048 by multiply-adds per token:
  the linear parts (12 d^2 per token) x2 (twice the tokens), the causal attention scores (d x seq per
  token) x4 (twice the tokens, each seeing twice as many): x(2 (1 - a) + 4 a) with a the scores' share
  at seq 1024. Heads 16 -> 32 changes no multiply-add.
- **Each case's block**: its measured CPU cost curve (SmolLM2 shape, ``cost_curves-*.json``) relative to
  that file's dense block (forward over forward, backward over backward), times the GPU dense block.
- **The head + loss** (GPT-2's 50,257 tokens, untied): the ratio head + loss / block measured on this
  CPU at the paper's shape (``paper_head-<date>.json``, :mod:`benchmarks._lib.paper_head`), times the GPU
  block. **The embedding**: a lookup, 1% / 2% of a block's forward / backward (not measured).
- **Depth**: each trace (SmolLM2: 30 layers) mapped onto 24, 32 and 48 layers by depth fraction: layer
  ``i`` of ``L`` takes the recorded layer whose span holds the depth ``(i + 0.5) / L``; MoD maps its
  routed layers onto the odd layers and keeps the even ones dense. Rows: at most ``--rows`` of each
  trace, evenly spaced (all rows of shorter traces).

Placements per case and shape: **uniform** (Megatron), **params** (DeepSpeed: exact min-max of the
parameters; pruning counts the non-zeros), **head-aware static** (partitioned once from row 0's costs,
refined by the step model, then fixed), **best fixed** in hindsight (the faster of two searches over the
whole trace: the policy's, i.e. the mean costs' partition, per worker under ZBV, refined by the library's
search (:func:`~lightning_dynmo.balancing.placement_search.refine`) with the step summed over the trace's
rows as its cost; and :mod:`benchmarks._lib.independent_search`, its own evaluator and search, no shared
code; table (c) compares them under that evaluator), **DynMo** (:func:`dynmo_placements`: the library's
own ``decide`` with its default ``min_gain``, run through every recorded step; MoE and MoD on each
layer's moving average as their every-step recipe, the others on a fresh window), and the **dense
model** (the same depth, no dynamism) static uniform -> balanced. Table (d) times the policy's decision
(:func:`~lightning_dynmo.balancing.policy.decide`) at the largest depth and stage counts. Table (e) sets
DynMo beside the paper's per-case references where the project has one (:data:`REFERENCES`): the model
without its dynamism for sparse attention and early exit, parameter counts rebalanced every row for
pruning, freezing on a static split for freezing (Egeria's placement; Egeria's own freezing rule is not
in the project, the trace's freezing is used).

    python -m benchmarks.paper_setup             # the full projection (~10 minutes on 2 cores)
    python -m benchmarks.paper_setup --quick     # synthetic trace, tiny shapes: not figures
    python -m benchmarks.paper_setup --kernels benchmarks/results/gpu/<date>/kernels.json

With ``--kernels PATH`` (a ``kernels.json`` of ``python -m lightning_dynmo.gpu_check.kernels``) every
cost instead comes from that GPU check's cost curves at the paper's shape (no scaling, no CPU ratio):
each block at its trace statistic through the case's curve, the head + loss and the embedding as
measured, each total split forward : backward = 1 : 2 (the curves record totals only); the statistic
mapping, the freezing and the no-curve cases (MoE, pruning) are in :mod:`benchmarks._lib.gpu_curves`.
A value outside a curve's measured range is refused unless ``--clamp-curves`` (then counted in the label).
``--padded-vocab-head`` takes the head + loss timed with the vocabulary padded to a multiple of 128, as
Megatron-LM pads it (GPT-2's odd 50,257 columns keep the head's GEMM off its aligned paths: 13.3 ms
against 4.5 ms padded on one H200, ``results/gpu/2026-11-30/README.md``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._lib import independent_search, paired
from benchmarks._lib.common import command_line, results_path, write_report
from benchmarks._lib.gpu_curves import KernelCosts, add_kernel_arguments, gpu_cost_trace, kernels_from_args
from benchmarks._lib.trace_cases import (
    CASES,
    RESULTS,
    case_curve,
    dense_trace,
    load_traces,
    newest_cost_curves,
    synthetic_trace,
    trace_parser,
)
from benchmarks.projection import Run, Shape, simulate, step_s
from lightning_dynmo.balancing import LayerCost, Placement, by_parameters, partition, uniform
from lightning_dynmo.balancing.averaging import HistoryWeight
from lightning_dynmo.balancing.placement_search import SEARCH_BUDGET, refine
from lightning_dynmo.balancing.policy import BalanceConfig, decide, smooth_costs
from lightning_dynmo.balancing.spread import squared_times, with_margin
from lightning_dynmo.balancing.trace import CostTrace, StatisticTrace, StepCosts
from lightning_dynmo.balancing.workers import partition_workers
from lightning_dynmo.callback.config import COST_MARGIN, EVERY_STEP_COST_SMOOTHING
from lightning_dynmo.pipeline.step.actions import schedule_actions

MICROBATCHES = 32
D_MODEL, SEQ_GPU, SEQ_PAPER = 1024, 1024, 2048
GPU_FILE = RESULTS / "gpu" / "2026-11-27" / "gpu_check.json"
DEPTHS = (24, 32, 48)
#: (ranks, schedule): 8-32 stages under 1F1B and ZBVZeroBubble (two stages per rank, V-shaped).
SHAPES: tuple[tuple[int, str], ...] = (
    (8, "1F1B"),
    (16, "1F1B"),
    (32, "1F1B"),
    (4, "ZBVZeroBubble"),
    (8, "ZBVZeroBubble"),
    (16, "ZBVZeroBubble"),
)
QUICK_SHAPES: tuple[tuple[int, str], ...] = ((2, "1F1B"), (2, "ZBVZeroBubble"))
BLOCK_PARAMS = 12 * D_MODEL * D_MODEL
PARAMS_REBALANCED = "params, rebalanced every row"
#: The paper's reference per case, where the project has one (see :func:`reference`).
REFERENCES = {
    "sparse_attention": "dense attention (the model without its dynamism), balanced",
    "early_exit": "no exit (the model without its dynamism), balanced",
    "pruning": "parameter counts rebalanced every row (the non-zeros)",
    "freezing": "freezing on a static split (Egeria's placement: head-aware, from step 0)",
}


def seq_scale(d_model: int = D_MODEL, seq_from: int = SEQ_GPU, seq_to: int = SEQ_PAPER) -> float:
    """A block's cost from ``seq_from`` to ``seq_to`` (same sequences per micro-batch), by multiply-adds."""
    linear, scores = 12 * d_model * d_model, d_model * seq_from  # causal: half of 2 d seq
    a = scores / (linear + scores)
    r = seq_to / seq_from
    return (1 - a) * r + a * r * r


def gpu_dense_block(path: Path = GPU_FILE) -> tuple[float, float, str]:
    """The median trained block's forward and backward (seconds per micro-batch) of the GPU check."""
    data = json.loads(path.read_text())
    part = data["parts"]["costs_freezing"]
    trained = [c for c in part["layer_costs"] if c["bwd_time_s"] > 0]
    fwd = sorted(c["fwd_time_s"] for c in trained)
    bwd = sorted(c["bwd_time_s"] for c in trained)
    k = len(trained) // 2

    def med(v: list[float]) -> float:
        return v[k] if len(v) % 2 else (v[k - 1] + v[k]) / 2

    device = data["hardware"]["devices"][0]["name"]
    return med(fwd), med(bwd), f"{path.relative_to(RESULTS.parent)} ({device}, {len(trained)} trained blocks)"


def newest_head(folder: Path = RESULTS) -> dict[str, Any]:
    """The newest ``paper_head-<date>.json``: the head + loss / block ratios measured on the CPU."""
    paths = sorted(folder.glob("paper_head-*.json"))
    if not paths:
        raise FileNotFoundError(f"no paper_head-<date>.json in {folder}: measure it first (see the module).")
    data: dict[str, Any] = json.loads(paths[-1].read_text())
    data["file"] = paths[-1].name
    return data


def map_depth(values: Sequence[float], layers: int) -> tuple[float, ...]:
    """``values`` (one per recorded layer) onto ``layers`` layers by depth fraction."""
    n = len(values)
    return tuple(values[min(n - 1, int((i + 0.5) * n / layers))] for i in range(layers))


def kept_rows(num_rows: int, rows: int) -> list[int]:
    """At most ``rows`` of ``num_rows`` rows, evenly spaced, the first and the last included."""
    k = min(rows, num_rows)
    return sorted({round(i * (num_rows - 1) / max(1, k - 1)) for i in range(k)})


def mapped(stats: StatisticTrace, layers: int, rows: int) -> StatisticTrace:
    """``stats`` on ``layers`` layers, at most ``rows`` rows (:func:`kept_rows`)."""
    keep = kept_rows(stats.num_rows, rows)
    values = []
    for r in keep:
        row = stats.values[r]
        if CASES[stats.case].odd_layers_only:  # routed layers onto the odd ones, the even ones dense
            routed = map_depth(row[1::2], layers // 2)
            values.append(tuple(v for x in routed for v in (1.0, x)))
        else:
            values.append(map_depth(row, layers))
    steps = tuple(stats.steps[r] for r in keep)
    return dataclasses.replace(stats, values=tuple(values), steps=steps)


@dataclasses.dataclass(frozen=True)
class Costs:
    """The GPU block (per micro-batch, seq 2048), the head ratios and where each came from."""

    block: tuple[float, float]
    head: tuple[float, float]
    label: str


def paper_costs(quick: bool) -> Costs:
    """The block and head + loss costs at the paper's shape (``quick``: unit stand-ins)."""
    if quick:
        return Costs((1.0, 2.0), (3.0, 6.0), "quick: unit stand-ins, not figures")
    f, b, where = gpu_dense_block()
    k = seq_scale()
    head = newest_head()
    hf, hb = head["ratio_fwd"], head["ratio_bwd"]
    label = (
        f"dense block {f * 1e3:.3f} + {b * 1e3:.3f} ms at seq 1024 ({where}) x{k:.3f} (seq 2048) = "
        f"{f * k * 1e3:.3f} + {b * k * 1e3:.3f} ms per micro-batch; head + loss {hf:.2f} / {hb:.2f} blocks "
        f"(forward / backward, measured on the CPU: {head['file']})"
    )
    return Costs((f * k, b * k), (hf * f * k, hb * b * k), label)


def _params(stats: StatisticTrace, dense: bool) -> list[int]:
    if stats.case == "pruning" and not dense:  # DeepSpeed counts the parameters it keeps: the non-zeros
        return [max(1, round(BLOCK_PARAMS * v)) for v in stats.layer_means()]
    return [BLOCK_PARAMS] * stats.num_layers


def gpu_trace(
    stats: StatisticTrace,
    kernels: KernelCosts,
    dense: bool = False,
    clamp: bool = False,
    microbatches: int = MICROBATCHES,
) -> CostTrace:
    """Per-step costs (``microbatches`` per step) of ``stats`` from a GPU check's cost curves
    (:func:`benchmarks._lib.gpu_curves.gpu_cost_trace`; ``clamp``: clamp out-of-range statistics)."""
    params = _params(stats, dense)
    if dense:
        case = CASES[stats.case]
        stats = stats.uniform(case.dense_statistic if case.dense_statistic is not None else 1.0)
    return gpu_cost_trace(stats, kernels, microbatches, clamp=clamp, num_params=params)


def cost_trace(stats: StatisticTrace, costs: Costs, dense: bool = False) -> CostTrace:
    """Per-step costs (32 micro-batches) of ``stats`` at the paper's shape."""
    case = CASES[stats.case]
    params = _params(stats, dense)
    if dense:
        stats = stats.uniform(case.dense_statistic if case.dense_statistic is not None else 1.0)
    measured = newest_cost_curves()
    curve = case_curve(CASES[stats.case.split(" ")[0]].name, measured)
    found = (measured or {}).get("cases", {}).get(case.name)
    bwd_unit = found["dense_block_s"][1] / found["dense_block_s"][0] if found else 2.0
    m, (gf, gb), (hf, hb) = MICROBATCHES, costs.block, costs.head
    first = LayerCost(fwd_time_s=0.01 * gf * m, bwd_time_s=0.02 * gb * m)
    last = LayerCost(fwd_time_s=hf * m, bwd_time_s=hb * m)
    raw = CostTrace.build(stats, curve, first, last, num_params=params)
    rows = tuple(
        StepCosts(
            tuple(
                dataclasses.replace(
                    c, fwd_time_s=c.fwd_time_s * gf * m, bwd_time_s=c.bwd_time_s / bwd_unit * gb * m
                )
                for c in r.layers
            ),
            r.first,
            r.last,
        )
        for r in raw.rows
    )
    return dataclasses.replace(raw, rows=rows)


@dataclasses.dataclass(frozen=True)
class Row:
    """One case on one depth and shape: every placement's run."""

    case: str
    layers: int
    shape: Shape
    runs: dict[str, Run]
    fixed: dict[str, Placement]
    dense_gain: float
    check: tuple[float, float]  # independent evaluator: projection's best fixed, independent best (s)
    reference: tuple[str, float] | None = None  # the paper's per-case reference: what, total step (s)

    @property
    def static(self) -> str:
        return min(("uniform", "params"), key=lambda k: self.runs[k].total_s)

    def ratio(self, over: str, to: str = "DynMo") -> float:
        return self.runs[over].total_s / self.runs[to].total_s

    def per_row(self, over: str, to: str = "DynMo") -> list[float]:
        """``over``'s step / ``to``'s, row by row (each row a recorded step: the projection's spread)."""
        return [a / b for a, b in zip(self.runs[over].steps_s, self.runs[to].steps_s, strict=True)]


def stage_workers(shape: Shape) -> list[int]:
    """The rank of each stage under ``shape``'s schedule (its action lists say which rank runs it)."""
    workers = [0] * shape.stages
    for rank, acts in enumerate(schedule_actions(shape.schedule, shape.stages, shape.microbatches)):
        for stage, _, _ in acts:
            workers[stage] = rank
    return workers


def best_placement(
    costs: StepCosts, shape: Shape, budget: int, over: Sequence[StepCosts] | None = None
) -> Placement:
    """What DynMo's policy picks (:func:`lightning_dynmo.balancing.policy.decide`): the exact partition of
    ``costs`` (per worker under a schedule of several stages per rank: :func:`partition_workers` with the
    schedule's stage-to-rank map), refined by the step model
    (:func:`~lightning_dynmo.balancing.placement_search.refine`, ``budget`` simulations). With ``over``,
    the refinement minimises the step summed over those rows instead (the best fixed placement in
    hindsight of a trace)."""
    problem = costs.problem()
    workers = stage_workers(shape) if shape.stages > shape.ranks else None
    if workers is not None:
        proposal = partition_workers(problem, workers).placement
    else:
        proposal = partition(problem, shape.stages)
    rows = [costs] if over is None else list(over)

    def step_of(placement: Placement) -> float:
        return sum(step_s(row, placement, shape) for row in rows)

    return refine(problem, proposal, step_of, budget=budget, stage_workers=workers).placement


def dynmo_placements(
    trace: CostTrace,
    shape: Shape,
    phases: bool,
    every_step: bool = True,
    config: BalanceConfig | None = None,
    smoothing: float = EVERY_STEP_COST_SMOOTHING,
    bias_corrected: bool = True,
    margin: float = COST_MARGIN,
) -> list[Placement]:
    """DynMo's placement at every row of ``trace`` (every recorded step), from the uniform split: after
    each row the library's own decision (:func:`~lightning_dynmo.balancing.policy.decide` with ``config``:
    the search of :func:`best_placement`, applied only when predicted ``min_gain`` faster), in force from
    the next row, on what the callback would have measured. With ``every_step`` (the recipe of MoE and
    MoD) that is each layer's moving average of the rows so far, as the callback keeps it
    (:func:`~lightning_dynmo.balancing.policy.smooth_costs`, bias-corrected by
    :class:`~lightning_dynmo.balancing.averaging.HistoryWeight` of the every-step default
    :data:`~lightning_dynmo.callback.config.EVERY_STEP_COST_SMOOTHING`, one sample a row; ``smoothing``
    another weight, ``bias_corrected=False`` the average started from its first row as the callback kept
    it before :class:`~lightning_dynmo.balancing.averaging.HistoryWeight`), each layer planned at that
    average plus ``margin`` standard deviations of the averaged rows
    (:func:`~lightning_dynmo.balancing.spread.with_margin`, the callback's default
    :data:`~lightning_dynmo.callback.config.COST_MARGIN`);
    otherwise the fresh measurement of the row just run. Row 0 runs at the placement decided from its
    own costs (DynMo's first window runs in the warm-up before the first recorded step). With ``phases``
    every row is a phase announced by an event, which opens a fresh window: it runs at the placement
    decided from its own costs (``config``: ``BalanceConfig()``, the callback's defaults)."""
    config = config or BalanceConfig()
    workers = stage_workers(shape) if shape.stages > shape.ranks else None
    placement, out = uniform(trace.num_layers, shape.stages), []
    smoothed: list[LayerCost] | None = None
    squares: list[LayerCost] | None = None
    weight = smoothing if every_step else 0.0
    history = HistoryWeight(weight)

    def decided(costs: StepCosts) -> Placement:
        made = decide(costs.problem(), placement, config, shape.microbatches, shape.order, workers)
        return made.proposed if made.apply else placement

    for r, row in enumerate(trace.rows):
        if phases or r == 0:
            placement = decided(row)
        out.append(placement)  # the row runs, then DynMo decides for the next one
        if not phases:
            h = history.next() if bias_corrected or smoothed is None else weight
            smoothed = smooth_costs(smoothed, row.layers, h)
            squares = smooth_costs(squares, squared_times(row.layers), h)
            planned = with_margin(smoothed, squares, margin)
            placement = decided(dataclasses.replace(row, layers=tuple(planned)))
    return out


def rebalanced_by_parameters(stats: StatisticTrace, shape: Shape) -> list[Placement]:
    """Pruning's reference (the paper's): every row split by the parameters its layers keep (the
    non-zeros, known exactly at every step), i.e. parameter counts rebalanced as the model is pruned."""
    return [
        by_parameters([LayerCost(num_params=max(1, round(BLOCK_PARAMS * v))) for v in row], shape.stages)
        for row in stats.values
    ]


def _rows(trace: CostTrace) -> list[independent_search.Row]:
    return [
        (
            [(c.fwd_time_s, c.bwd_time_s) for c in r.layers],
            (r.first.fwd_time_s, r.first.bwd_time_s),
            (r.last.fwd_time_s, r.last.bwd_time_s),
        )
        for r in trace.rows
    ]


def run_case(
    trace: CostTrace,
    dense: CostTrace,
    shape: Shape,
    budget: int,
    phases: bool,
    stats: StatisticTrace | None = None,
    every: tuple[CostTrace, Sequence[int]] | None = None,
) -> Row:
    """Every placement of ``trace`` on ``shape``, the dense model's gain and the independent check (with
    ``stats`` of pruning: also the paper's reference, parameter counts rebalanced every row). ``every``:
    the trace at every recorded step and which of its rows ``trace`` keeps; DynMo then runs through every
    step (its moving average sees them all) and is judged on the kept rows like the rest."""
    rows, layers, stages = trace.num_rows, trace.num_layers, shape.stages
    mean = trace.mean_costs()
    fixed = {
        "uniform": uniform(layers, stages),
        "params": by_parameters(list(mean.layers), stages),
        "head-aware static": best_placement(trace.rows[0], shape, budget),
        "best fixed, policy's search": best_placement(mean, shape, budget, over=trace.rows),
    }
    runs = {name: simulate(trace, [p] * rows, shape) for name, p in fixed.items()}
    every_step = CASES[trace.case].every_step if trace.case in CASES else True
    if every is None:
        dynmo = dynmo_placements(trace, shape, phases, every_step)
    else:
        full, kept = every
        at_every_step = dynmo_placements(full, shape, phases, every_step)
        dynmo = [at_every_step[i] for i in kept]
    runs["DynMo"] = simulate(trace, dynmo, shape)
    if stats is not None and stats.case == "pruning":
        runs[PARAMS_REBALANCED] = simulate(trace, rebalanced_by_parameters(stats, shape), shape)
    d_uniform = simulate(dense, [uniform(layers, stages)] * dense.num_rows, shape).total_s
    d_best = simulate(dense, [best_placement(dense.rows[0], shape, budget)] * dense.num_rows, shape).total_s
    actions = schedule_actions(shape.schedule, stages, shape.microbatches)
    plain = _rows(trace)
    sizes = independent_search.search(plain, stages, actions, shape.microbatches)
    ours = [b - a for a, b in itertools.pairwise(fixed["best fixed, policy's search"].boundaries)]
    check = (
        independent_search.total(plain, ours, actions, shape.microbatches),
        independent_search.total(plain, sizes, actions, shape.microbatches),
    )
    runs["independent search"] = simulate(trace, [Placement.from_sizes(sizes)] * rows, shape)
    reference = None
    if trace.case in REFERENCES:
        total = {
            "sparse_attention": d_best,
            "early_exit": d_best,
            "pruning": runs[PARAMS_REBALANCED].total_s if PARAMS_REBALANCED in runs else None,
            "freezing": runs["head-aware static"].total_s,
        }[trace.case]
        reference = None if total is None else (REFERENCES[trace.case], total)
    # The best fixed placement in hindsight: the better of the two searches (by the step model's sum).
    runs["best fixed"] = min(
        runs["best fixed, policy's search"], runs["independent search"], key=lambda run: run.total_s
    )
    return Row(trace.case, layers, shape, runs, fixed, d_uniform / d_best, check, reference)


#: Where the decision is timed: the most stages at the most layers, under each schedule.
DECISION_SHAPES: tuple[tuple[int, str], ...] = ((16, "ZBVZeroBubble"), (32, "1F1B"))


def decision_times(traces: Sequence[CostTrace], shapes: Sequence[Shape], repeats: int = 3) -> list[str]:
    """(d) The policy's decision (:func:`lightning_dynmo.balancing.policy.decide` with the schedule's
    action lists, from the uniform split, on each trace's first row): its wall and CPU time on this
    machine (medians of ``repeats``), the simulations its search ran and the predicted gain."""
    lines = [
        "**(d) The policy's decision time** (`decide` with the schedule's action lists, from the uniform "
        f"split, on each trace's first row; medians of {repeats} on the shared 2-core VM, every wall time "
        "printed; CPU: this process's own seconds, what a busy machine's queueing leaves out):",
        "",
        "| case | layers | shape | wall (s, median) | CPU (s, median) | every wall (s) | search | predicted "
        "step (s): before -> after |",
        "|---|---:|---|---:|---:|---|---|---|",
    ]
    for trace in traces:
        for shape in shapes:
            row = trace.rows[0]
            workers = stage_workers(shape) if shape.stages > shape.ranks else None
            current = uniform(trace.num_layers, shape.stages)
            wall, cpu = [], []
            for _ in range(repeats):
                start, start_cpu = time.perf_counter(), time.process_time()
                made = decide(
                    row.problem(), current, BalanceConfig(), shape.microbatches, shape.order, workers
                )
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            how = made.reason.split("refined by ")
            search = how[-1].split(";")[0] if len(how) > 1 else "-"
            lines.append(
                f"| {trace.case} | {trace.num_layers} | {shape} | {statistics.median(wall):.3f} | "
                f"{statistics.median(cpu):.3f} | {', '.join(f'{t:.3f}' for t in wall)} | {search} | "
                f"{made.predicted_step_before:.3f} -> {made.predicted_step_after:.3f} |"
            )
    return [*lines, ""]


def tables(results: Sequence[Row]) -> list[str]:
    """(a) placements and ratios, (b) bubbles beside the paper's Figure 1, (c) the independent check."""
    a = [
        "**(a) Mean step (s) per placement and the ratios** (steps summed over the trace's rows):",
        "",
        "| case | layers | shape | uniform | params | head-aware static | best fixed | DynMo | better static "
        "/ DynMo | head-aware / DynMo | head-aware / DynMo per row (min-max) | DynMo of best fixed | dense "
        "model: static / balanced |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    b = [
        "**(b) Bubble (idle share per step), better static -> DynMo**, beside the paper's Figure 1:",
        "",
        "| case | layers | shape | better static | head-aware static | DynMo | paper (static -> DynMo) |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    c = [
        "**(c) Best fixed, re-derived independently**: the policy's search (its partition, refined by the "
        "step model) and the independent search, both placements' mean step under the independent "
        "evaluator; agreement = policy's / independent's (above 1: the independent search found faster):",
        "",
        "| case | layers | shape | policy's search, step model (s) | policy's search, independent evaluator "
        "(s) | independent search (s) | agreement |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    e = [
        "**(e) The paper's per-case references** (where the project has one; MoE and MoD are compared with "
        "static splits in the paper): the reference's mean step, DynMo's, and reference / DynMo (above 1: "
        "DynMo faster):",
        "",
        "| case | layers | shape | reference | reference (s) | DynMo (s) | reference / DynMo |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in results:
        n, runs = r.runs["DynMo"].steps_s.__len__(), r.runs
        if r.reference is not None:
            what, total = r.reference
            e.append(
                f"| {r.case} | {r.layers} | {r.shape} | {what} | {total / n:.3f} | "
                f"{runs['DynMo'].total_s / n:.3f} | {total / runs['DynMo'].total_s:.3f}x |"
            )
        mean = {
            k: runs[k].total_s / n for k in ("uniform", "params", "head-aware static", "best fixed", "DynMo")
        }
        ha = r.ratio("head-aware static")
        flag = " (under 2%)" if ha < 1.02 else ""
        per_row = r.per_row("head-aware static")
        spread = f"{min(per_row):.3f}-{max(per_row):.3f}"
        if len(per_row) >= paired.MIN_SIGN_ROUNDS and all(x < 1.0 for x in per_row):
            spread += ", SLOWER in every row"
        a.append(
            f"| {r.case} | {r.layers} | {r.shape} | {mean['uniform']:.3f} | {mean['params']:.3f} | "
            f"{mean['head-aware static']:.3f} | {mean['best fixed']:.3f} | {mean['DynMo']:.3f} | "
            f"{r.ratio(r.static):.2f}x | {ha:.3f}x{flag} | {spread} | {r.ratio('best fixed'):.1%} | "
            f"{r.dense_gain:.2f}x |"
        )
        b.append(
            f"| {r.case} | {r.layers} | {r.shape} | {runs[r.static].bubble:.0%} | "
            f"{runs['head-aware static'].bubble:.0%} | {runs['DynMo'].bubble:.0%} | "
            f"{CASES[r.case].paper_bubble} |"
        )
        ours, indep = r.check
        model = runs["best fixed, policy's search"].total_s / n
        c.append(
            f"| {r.case} | {r.layers} | {r.shape} | {model:.4f} | {ours / n:.4f} | {indep / n:.4f} | "
            f"{ours / indep:.4f} |"
        )
    return [*a, "", *b, "", *c, "", *(e if len(e) > 4 else []), ""]


def measure_head(rounds: int, quick: bool, out: Path | None, force: bool, command: str) -> str:
    """Time the head + loss against a block at the paper's shape (``quick``: tiny widths); write the JSON."""
    import platform

    import torch

    from benchmarks._lib.paper_head import HeadShape, measure

    path = out if out is not None else RESULTS / f"paper_head-{dt.date.today().isoformat()}.json"
    if path.exists() and not force:
        raise FileExistsError(
            f"{path} exists; pass --out PATH to write elsewhere or --force to overwrite it."
        )
    torch.set_num_threads(1)
    shape = HeadShape(d_model=64, num_heads=4, d_ff=256, seq_len=64, vocab_size=500) if quick else HeadShape()
    record = measure(shape, rounds)
    record.update(
        command=command,
        device=f"CPU: {platform.machine()}, torch {torch.__version__}, one thread",
        date=dt.datetime.now(dt.UTC).isoformat(),
        kind="real compute (CPU, float32)" + (" quick: not figures" if quick else ""),
    )
    text = json.dumps(record, indent=1)
    path.write_text(text + "\n")
    print(f"head + loss / block: {record['ratio_fwd']:.2f} / {record['ratio_bwd']:.2f}; written to {path}")
    return text


def main(argv: list[str] | None = None) -> str:
    """Project every trace at the paper's setup, print and write the report; return it."""
    parser = trace_parser(
        "python -m benchmarks.paper_setup", __doc__.split("\n")[0], "a synthetic trace, 2 ranks"
    )
    parser.add_argument(
        "--budget", type=int, default=SEARCH_BUDGET, help="step-model simulations per refinement"
    )
    parser.add_argument("--rows", type=int, default=8, help="most rows of each trace (evenly spaced)")
    parser.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS), help="model depths (layers)")
    parser.add_argument("--case", nargs="+", default=None, help="cases (default: every trace found)")
    parser.add_argument(
        "--measure-head",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="measure the head + loss / block ratio on this CPU in ROUNDS rounds, write "
        "results/paper_head-<date>.json (--out: elsewhere) and stop",
    )
    add_kernel_arguments(parser, "every cost, instead,")
    parser.add_argument(
        "--decisions-only",
        action="store_true",
        help="only table (d): time the policy's decision at the largest depth (seconds, not minutes)",
    )
    args = parser.parse_args(argv)
    kernels = kernels_from_args(parser, args)
    command = command_line("paper_setup", argv)
    if args.measure_head:
        return measure_head(args.measure_head, args.quick, args.out, args.force, command)
    for key in ("budget", "rows"):
        if getattr(args, key) < 1:
            parser.error(f"--{key}={getattr(args, key)} must be >= 1.")
    out = results_path("paper_setup", args.out, args.force)
    costs = paper_costs(args.quick) if kernels is None else None
    if args.quick:
        stats, shapes, depths, m = [synthetic_trace(6, 3)], QUICK_SHAPES, [8], 4
    else:
        stats, shapes, depths, m = load_traces(args.traces), SHAPES, args.depths, MICROBATCHES
        stats.append(dense_trace(30))
        if args.case:
            stats = [s for s in stats if s.case in args.case]
    results: list[Row] = []
    timed: list[CostTrace] = []  # each case at the largest depth: the decision is timed on it
    curves: dict[str, str] = {}  # per case, where its block costs come from (with --kernels)
    for s in stats:
        for layers in depths:
            st, st_every = mapped(s, layers, args.rows), mapped(s, layers, s.num_rows)
            kept = kept_rows(s.num_rows, args.rows)
            if kernels is not None:
                trace = gpu_trace(st, kernels, clamp=args.clamp_curves, microbatches=m)
                full = gpu_trace(st_every, kernels, clamp=args.clamp_curves, microbatches=m)
                dense = gpu_trace(st, kernels, dense=True, clamp=args.clamp_curves, microbatches=m)
                clamped = "clamped" in trace.curve_label  # the count differs per depth
                curves.setdefault(f"{s.case}, {layers} layers" if clamped else s.case, trace.curve_label)
            else:
                assert costs is not None
                trace, dense = cost_trace(st, costs), cost_trace(st, costs, dense=True)
                full = cost_trace(st_every, costs)
            if layers == max(depths):
                timed.append(trace)
            for ranks, schedule in shapes:
                shape = Shape(ranks, schedule, m)
                if shape.stages > layers or args.decisions_only:
                    continue
                print(f"[{s.case}] {layers} layers, {shape} ...", file=sys.stderr, flush=True)
                results.append(
                    run_case(trace, dense, shape, args.budget, CASES[s.case].phases, st, every=(full, kept))
                )
    worst = max((r.check[0] / r.check[1] for r in results), default=1.0)
    if kernels is not None:
        kind, bold, source = "projected from GPU cost curves", "Projected from GPU cost curves", kernels.label
        per_mb = f"micro-batch {kernels.shape.get('micro_batch')} x seq {kernels.shape.get('seq_len')}"
        source += "; per case: " + "; ".join(f"{c}: {how}" for c, how in curves.items())
    else:
        assert costs is not None
        per_mb = "micro-batch 2 x seq 2048"
        kind, bold, source = (
            "projected from GPU costs, scaled",
            "Projected from GPU costs (scaled)",
            costs.label,
        )
    lines = [
        f"# The traces at the paper's setup ({kind})",
        "",
        f"Command: `{command}`  ",
        "Device: none ran the model; the step model simulated on a shared 2-core x86_64 CPU VM (torch "
        f"2.13.0+cpu). **{bold}**: simulated steps, migrations not counted; a "
        "projection is deterministic, so it has no rounds: the spread quoted beside head-aware / DynMo is "
        "over the trace's rows (recorded steps of one run, not independent repetitions), and DynMo counts "
        "as slower than the head-aware split beyond it only when slower in every row (of at least "
        f"{paired.MIN_SIGN_ROUNDS}), the rule the measured tables apply to rounds.",
        "",
        f"Costs: {source}. Micro-batches: {m} per step ({per_mb}). Rows: at most "
        f"{args.rows} per trace, evenly spaced. Depth mapping: by depth fraction (see the script).",
        "",
        *(
            [
                f"Independent check: largest policy's search / independent search = {worst:.4f} "
                f"({'all rows within 1%' if worst <= 1.01 else 'NOT within 1% on every row'}); the best "
                "fixed placement of (a) is the faster of the two.",
                "",
                *tables(results),
            ]
            if not args.decisions_only
            else ["Only table (d) (`--decisions-only`): no projection ran.", ""]
        ),
        *decision_times(
            timed, [Shape(r, sch, m) for r, sch in (QUICK_SHAPES if args.quick else DECISION_SHAPES)]
        ),
    ]
    report = "\n".join(lines)
    write_report(report, "paper_setup", out)
    return report


if __name__ == "__main__":
    main()
