"""Early exit and Mixture of Depths on real compute: layer times, static vs DynMo on 2 stages, 8 stages.

Three parts per case (``early_exit``, ``mod``), all on the GPT's real blocks (no emulated cost):

1. **Per-layer time** (this process, one thread): each block's forward and backward on one micro-batch
   of its real inputs, interleaved over blocks, medians of ``--timing-repeats``. Early exit: the
   threshold is calibrated on the untrained model so that about ``--exit-share`` of the tokens still
   active leave at each exit layer (CALM's position decay on), and the table shows each layer's share
   of active tokens next to its time. Mixture of Depths: a routed block at several capacities (its
   time against the tokens it processes), and the processed share of each routed layer of the ready
   configuration (predictor routing) over several batches.
2. **Pipeline** (2 gloo ranks, 1F1B): DynMo (early exit: on the blocks' events; MoD: every step)
   starting from the uniform split, and a sweep of every fixed 2-stage placement (the static uniform
   split is one of them), in ``--rounds`` interleaved rounds (:mod:`benchmarks.gpt_pipeline`); medians.
   Ratios are taken within a round (:mod:`benchmarks.harness`): DynMo against the static uniform split
   and against the ideal, each round's ideal being the fixed placement fastest in the other rounds.
   DynMo's step times include its own profiling and migrations. The
   learning rate is 1e-8: the jobs measure what the calibrated routing costs, so it must not drift.
3. **Projection at 8 stages** (:func:`lightning_dynmo.balancing.simulate_pipeline`, 1F1B, 16
   micro-batches): a 32-layer model whose per-layer times come from part 1 (a least-squares line of
   time against processed share), static uniform split against DynMo's placement. Early exit: the
   measured exit rate at every exit layer; MoD: each routed layer's processed share follows the
   measured per-batch shares, and DynMo re-partitions every step on the previous steps' smoothed costs
   (as ``DynMoCallback(every_step=True)`` does), against an oracle that knows the step's costs.

    python -m benchmarks.early_exit_mod                 # both cases, ~10 minutes on a quiet machine
    python -m benchmarks.early_exit_mod --case mod      # one case
    python -m benchmarks.early_exit_mod --quick         # smoke run: tiny model, one round
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import harness
from benchmarks.common import results_path
from benchmarks.gpt_pipeline import JobSpec, median_ms, run_job
from lightning_dynmo.balancing import (
    BalanceProblem,
    Hardware,
    LayerCost,
    Placement,
    partition,
    simulate_pipeline,
    uniform,
)
from lightning_dynmo.dynamism.early_exit import EarlyExitBlock, early_exit_config
from lightning_dynmo.dynamism.mod import MoDBlock, MoDOptions, mod_config
from lightning_dynmo.dynamism.tokens import token_counts
from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.pipeline.model.contract import HIDDEN, block_inputs

CASES = ("early_exit", "mod")


@dataclass(frozen=True)
class Setup:
    """Sizes and repetitions of one benchmark run (see ``main``'s options)."""

    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    batch_size: int
    num_microbatches: int
    steps: int
    settle: int
    rounds: int
    sweep_repeats: int
    timing_repeats: int
    exit_share: float
    capacity: float

    @property
    def shape(self) -> dict[str, int]:
        return {"d_model": self.d_model, "num_heads": self.num_heads, "seq_len": self.seq_len}

    def batch(self, seed: int = 0) -> Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (self.batch_size, self.seq_len + 1), generator=gen)

    def microbatch(self, seed: int = 0) -> Tensor:
        return self.batch(seed)[: self.batch_size // self.num_microbatches]


# -- the two models -----------------------------------------------------------------------------


def early_exit_model(setup: Setup, threshold: float) -> GPTConfig:
    """Dense blocks for the first quarter, early-exit blocks after (CALM's position decay on)."""
    return early_exit_config(
        num_layers=setup.num_layers,
        first_exit_layer=max(1, setup.num_layers // 4),
        threshold=threshold,
        position_temperature=4.0,
        **setup.shape,
    )


def mod_model(setup: Setup) -> GPTConfig:
    """The ready MoD configuration: every other block routed, predictor routing."""
    return mod_config(
        num_layers=setup.num_layers, capacity=setup.capacity, routing="predictor", **setup.shape
    )


def calibrate_exit_threshold(setup: Setup) -> float:
    """The threshold at which about ``exit_share`` of the tokens leave at the first exit layer."""
    probe = GPT(early_exit_model(setup, threshold=2.0))
    first_exit = max(1, setup.num_layers // 4)
    batch = setup.batch()
    states = block_states(probe, batch)
    block = probe.layers[str(first_exit)]
    assert isinstance(block, EarlyExitBlock) and block.exit_head is not None and block.exit_norm is not None
    with torch.no_grad():
        hidden = states[first_exit + 1][HIDDEN]
        top2 = block.exit_head(block.exit_norm(hidden)).softmax(-1).topk(2, dim=-1).values
        confidence = (top2[..., 0] - top2[..., 1]).double()
        positions = torch.arange(setup.seq_len).expand_as(confidence)
        scale = block.exit_thresholds(positions) / block.options.threshold
        ratio = (confidence / scale).flatten()
    return float(torch.quantile(ratio, 1.0 - setup.exit_share))


def block_states(model: GPT, batch: Tensor) -> list[dict[str, Tensor]]:
    """The stage-interface state before every block and after the last one (detached)."""
    inputs, target = batch[:, :-1], batch[:, 1:]
    first = model.pipeline_first(inputs)
    state: dict[str, Tensor] = dict(first) if isinstance(first, dict) else {HIDDEN: first}
    states = [{k: v.detach() for k, v in state.items()}]
    with torch.no_grad():
        for block in model.layers.values():
            kwargs = {n: state.get(n, target) for n in block_inputs(block)}
            out = block(state[HIDDEN], **kwargs)
            hidden, updates = out if isinstance(out, tuple) else (out, {})
            state = {**state, **updates, HIDDEN: hidden}
            states.append({k: v.detach() for k, v in state.items()})
    return states


# -- part 1: per-layer time ---------------------------------------------------------------------


@dataclass(frozen=True)
class LayerTime:
    """One block's median forward and backward time on one micro-batch, and its processed share."""

    name: str
    fwd_ms: float
    bwd_ms: float
    share: float

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


def time_calls(calls: Sequence[Callable[[], tuple[float, float]]], repeats: int) -> list[tuple[float, float]]:
    """Medians of ``(fwd_s, bwd_s)`` per call, the calls interleaved ``repeats`` times (one warm-up)."""
    samples: list[list[tuple[float, float]]] = [[] for _ in calls]
    for r in range(repeats + 1):
        for i, call in enumerate(calls):
            result = call()
            if r:
                samples[i].append(result)
    return [
        (1e3 * statistics.median(f for f, _ in s), 1e3 * statistics.median(b for _, b in s)) for s in samples
    ]


def block_call(
    block: nn.Module, state: dict[str, Tensor], target: Tensor
) -> Callable[[], tuple[float, float]]:
    """Forward and backward of ``block`` on ``state`` (gradient of ones on its output), timed."""
    kwargs = {n: state.get(n, target) for n in block_inputs(block)}

    def call() -> tuple[float, float]:
        x = state[HIDDEN].detach().requires_grad_(True)
        block.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = block(x, **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
        t1 = time.perf_counter()
        hidden.backward(torch.ones_like(hidden))
        return t1 - t0, time.perf_counter() - t1

    return call


def layer_times(model: GPT, microbatch: Tensor, repeats: int) -> tuple[list[LayerTime], LayerCost, LayerCost]:
    """Every block's time on its real inputs, plus the first parts' and last parts' costs."""
    model.train()
    states = block_states(model, microbatch)  # also fills each block's token counts
    target = microbatch[:, 1:]
    counts = token_counts(model)
    calls = [block_call(block, states[i], target) for i, block in enumerate(model.layers.values())]
    calls += [_first_parts_call(model, microbatch), _last_parts_call(model, states[-1][HIDDEN], target)]
    timed = time_calls(calls, repeats)
    layers = []
    for i, (fwd, bwd) in enumerate(timed[: len(model.layers)]):
        c = counts.get(i)
        share = c.last_processed / c.last_seen if c is not None and c.last_seen else 1.0
        layers.append(LayerTime(type(model.layers[str(i)]).__name__, fwd, bwd, share))
    (ffwd, fbwd), (lfwd, lbwd) = timed[-2:]
    first = LayerCost(fwd_time_s=ffwd / 1e3, bwd_time_s=fbwd / 1e3)
    last = LayerCost(fwd_time_s=lfwd / 1e3, bwd_time_s=lbwd / 1e3)
    return layers, first, last


def _first_parts_call(model: GPT, microbatch: Tensor) -> Callable[[], tuple[float, float]]:
    def call() -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        out = model.pipeline_first(microbatch[:, :-1])
        hidden = out[HIDDEN] if isinstance(out, dict) else out
        t1 = time.perf_counter()
        hidden.backward(torch.ones_like(hidden))
        return t1 - t0, time.perf_counter() - t1

    return call


def _last_parts_call(model: GPT, hidden: Tensor, target: Tensor) -> Callable[[], tuple[float, float]]:
    def call() -> tuple[float, float]:
        x = hidden.detach().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model.pipeline_loss(model.pipeline_last(x), target)
        t1 = time.perf_counter()
        loss.backward()
        return t1 - t0, time.perf_counter() - t1

    return call


def mod_capacity_times(setup: Setup, capacities: Sequence[float]) -> list[LayerTime]:
    """A routed block (top-k routing) at each capacity, and a dense block, on the same micro-batch."""
    config = mod_model(setup)
    model = GPT(config)
    states = block_states(model, setup.microbatch())
    state, target = states[1], setup.microbatch()[:, 1:]
    dense = model.layers["0"]
    blocks: list[tuple[str, nn.Module, float]] = [("DenseBlock", dense, 1.0)]
    for capacity in capacities:
        block = MoDBlock(config, 1, MoDOptions(capacity=capacity))
        block.load_state_dict(model.layers["1"].state_dict())
        blocks.append(
            (
                f"MoDBlock c={capacity:g}",
                block,
                MoDOptions(capacity=capacity).capacity_tokens(setup.seq_len) / setup.seq_len,
            )
        )
    timed = time_calls([block_call(b, state, target) for _, b, _ in blocks], setup.timing_repeats)
    return [LayerTime(name, f, b, share) for (name, _, share), (f, b) in zip(blocks, timed, strict=True)]


def routed_shares(setup: Setup, batches: int) -> dict[int, list[float]]:
    """Per routed layer of the ready MoD model, the processed share of each of ``batches`` batches."""
    model = GPT(mod_model(setup))
    model.train()
    shares: dict[int, list[float]] = {}
    for seed in range(batches):
        block_states(model, setup.batch(seed))
        for i, c in token_counts(model).items():
            shares.setdefault(i, []).append(c.last_processed / c.last_seen)
    return shares


# -- part 2: the pipeline --------------------------------------------------------------------------


def pipeline_comparison(config: GPTConfig, callback: dict[str, Any], setup: Setup) -> dict[str, Any]:
    """DynMo against a sweep of every fixed 2-stage placement (the uniform split among them), in rounds.

    Each round runs the DynMo job and the sweep job (:func:`benchmarks.harness.run_rounds`); the static
    uniform split's time is its visits in the sweep, interleaved with the other candidates. Each round's
    ideal is the candidate fastest in the other rounds (:mod:`benchmarks.paired`).
    """
    last = setup.num_layers - 1
    candidates = tuple(f"0-{k}|{k + 1}-{last}" for k in range(last))
    dynmo = JobSpec(
        kind="dynmo",
        config=config,
        steps=setup.steps,
        batch_size=setup.batch_size,
        num_microbatches=setup.num_microbatches,
        callback={"balancer": "partition", "cost": "time", **callback},
        lr=1e-8,  # the calibrated routing must not drift while it is timed (this script's micro-measurement)
    )
    sweep = replace(dynmo, kind="sweep", candidates=candidates, repeats=setup.sweep_repeats)
    runs = harness.run_rounds(
        {"DynMo": dynmo, "sweep": sweep}, run_job, setup.rounds, "pipeline", start_method="fork"
    )
    per_round = {p: [median_ms(run["sweep_s"][p]) for run in runs["sweep"]] for p in candidates}
    per_round["DynMo"] = harness.step_ms(runs["DynMo"], setup.settle)
    static = str(uniform(setup.num_layers, 2))
    comparison = harness.compare_runs(per_round, [static], ["DynMo"], candidates)
    rows = {
        f"fixed {p}" + (" = static uniform" if p == static else ""): {
            "ms": statistics.median(per_round[p]),
            "per_round": per_round[p],
            "placement": p,
        }
        for p in candidates
    }
    return {
        "rows": {**harness.rows_of({"DynMo": runs["DynMo"]}, per_round), **rows},
        "comparison": comparison,
        "decisions": [run["decisions"] for run in runs["DynMo"]],
        "profiled_layer_ms": runs["DynMo"][-1].get("layer_ms", []),
    }


# -- part 3: projection ----------------------------------------------------------------------------


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``y`` against ``x``."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return statistics.mean(ys), 0.0
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def step_time_s(
    costs: Sequence[LayerCost], placement: Placement, extras: tuple[LayerCost, LayerCost], microbatches: int
) -> float:
    """Simulated 1F1B step time of ``placement`` (costs are per micro-batch)."""
    stages = [placement.layers_of(s) for s in range(placement.num_stages)]
    fwd = [sum(costs[i].fwd_time_s for i in stage) for stage in stages]
    bwd = [sum(costs[i].bwd_time_s for i in stage) for stage in stages]
    fwd[0] += extras[0].fwd_time_s
    bwd[0] += extras[0].bwd_time_s
    fwd[-1] += extras[1].fwd_time_s
    bwd[-1] += extras[1].bwd_time_s
    return simulate_pipeline(fwd, bwd, microbatches, "1f1b").step_time_s


def dynmo_placement(
    costs: Sequence[LayerCost], stages: int, extras: tuple[LayerCost, LayerCost]
) -> Placement:
    return partition(
        BalanceProblem(costs, hardware=Hardware(first_stage_extra=extras[0], last_stage_extra=extras[1])),
        stages,
    )


def _cost_at(fits: tuple[tuple[float, float], tuple[float, float]], share: float) -> LayerCost:
    (fa, fb), (ba, bb) = fits
    return LayerCost(fwd_time_s=max(0.0, fa + fb * share) / 1e3, bwd_time_s=max(0.0, ba + bb * share) / 1e3)


def _share_fits(points: Sequence[LayerTime]) -> tuple[tuple[float, float], tuple[float, float]]:
    """Lines of forward and backward milliseconds against processed share."""
    return line_fit([(p.share, p.fwd_ms) for p in points]), line_fit([(p.share, p.bwd_ms) for p in points])


def project_early_exit(
    layers: Sequence[LayerTime], extras: tuple[LayerCost, LayerCost], exit_rate: float, projection: Projection
) -> dict[str, Any]:
    """Static uniform split against DynMo's placement for a deeper early-exit model (see the docstring)."""
    dense = [t for t in layers if t.name == "DenseBlock"]
    exits = [t for t in layers if t.name == "EarlyExitBlock"]
    dense_cost = LayerCost(
        fwd_time_s=statistics.median(t.fwd_ms for t in dense) / 1e3,
        bwd_time_s=statistics.median(t.bwd_ms for t in dense) / 1e3,
    )
    fits = _share_fits(exits)
    first_exit = projection.num_layers // 4
    shares = [1.0] * first_exit + [
        (1.0 - exit_rate) ** (i - first_exit) for i in range(first_exit, projection.num_layers)
    ]
    costs = [dense_cost if i < first_exit else _cost_at(fits, a) for i, a in enumerate(shares)]
    return _compare_fixed(costs, extras, projection) | {"last_share": shares[-1]}


def project_mod(
    capacity_times: Sequence[LayerTime],
    shares: dict[int, list[float]],
    extras: tuple[LayerCost, LayerCost],
    projection: Projection,
    smoothing: float = 0.8,
) -> dict[str, Any]:
    """Static uniform split against DynMo re-partitioning every step, for a deeper MoD model."""
    dense = next(t for t in capacity_times if t.name == "DenseBlock")
    dense_cost = LayerCost(fwd_time_s=dense.fwd_ms / 1e3, bwd_time_s=dense.bwd_ms / 1e3)
    fits = _share_fits([t for t in capacity_times if t.name != "DenseBlock"])
    measured = [shares[i] for i in sorted(shares)]
    steps = len(measured[0])
    stages, microbatches = projection.num_stages, projection.num_microbatches
    static = uniform(projection.num_layers, stages)

    def costs_at(step: int) -> list[LayerCost]:
        costs = []
        for i in range(projection.num_layers):
            if i % 2 == 0:
                costs.append(dense_cost)
            else:  # routed layer j follows measured layer j mod L, shifted so that layers differ
                j = i // 2
                costs.append(_cost_at(fits, measured[j % len(measured)][(step + j) % steps]))
        return costs

    mean_costs = [
        LayerCost(
            fwd_time_s=statistics.mean(costs_at(s)[i].fwd_time_s for s in range(steps)),
            bwd_time_s=statistics.mean(costs_at(s)[i].bwd_time_s for s in range(steps)),
        )
        for i in range(projection.num_layers)
    ]
    best_fixed = dynmo_placement(mean_costs, stages, extras)
    totals = {"static": 0.0, "dynmo": 0.0, "oracle": 0.0, "fixed": 0.0}
    smoothed: list[LayerCost] | None = None
    for step in range(steps):
        costs = costs_at(step)
        placement = dynmo_placement(smoothed or costs, stages, extras)
        totals["fixed"] += step_time_s(costs, best_fixed, extras, microbatches)
        totals["static"] += step_time_s(costs, static, extras, microbatches)
        totals["dynmo"] += step_time_s(costs, placement, extras, microbatches)
        totals["oracle"] += step_time_s(costs, dynmo_placement(costs, stages, extras), extras, microbatches)
        smoothed = (
            costs
            if smoothed is None
            else [
                LayerCost(
                    fwd_time_s=smoothing * old.fwd_time_s + (1 - smoothing) * new.fwd_time_s,
                    bwd_time_s=smoothing * old.bwd_time_s + (1 - smoothing) * new.bwd_time_s,
                )
                for old, new in zip(smoothed, costs, strict=True)
            ]
        )
    static_s = totals["static"] / steps
    return {
        "static_ms": 1e3 * static_s,
        "dynmo_ms": 1e3 * totals["dynmo"] / steps,
        "oracle_ms": 1e3 * totals["oracle"] / steps,
        "speedup": totals["static"] / totals["dynmo"],
        "oracle_speedup": totals["static"] / totals["oracle"],
        "fixed_ms": 1e3 * totals["fixed"] / steps,
        "fixed": str(best_fixed),
        "steps": steps,
        "static": str(static),
    }


@dataclass(frozen=True)
class Projection:
    """The deeper pipeline of part 3."""

    num_layers: int = 32
    num_stages: int = 8
    num_microbatches: int = 16


def _compare_fixed(
    costs: Sequence[LayerCost], extras: tuple[LayerCost, LayerCost], projection: Projection
) -> dict[str, Any]:
    static = uniform(projection.num_layers, projection.num_stages)
    balanced = dynmo_placement(costs, projection.num_stages, extras)
    static_s = step_time_s(costs, static, extras, projection.num_microbatches)
    balanced_s = step_time_s(costs, balanced, extras, projection.num_microbatches)
    return {
        "static_ms": 1e3 * static_s,
        "dynmo_ms": 1e3 * balanced_s,
        "speedup": static_s / balanced_s,
        "static": str(static),
        "dynmo": str(balanced),
    }


# -- report ---------------------------------------------------------------------------------------


def layer_table(layers: Sequence[LayerTime], profiled_ms: Sequence[float] = ()) -> list[str]:
    rows = [
        "| layer | block | processed share | fwd (ms) | bwd (ms) | fwd+bwd (ms) "
        "| in the DynMo pipeline, per step (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i, t in enumerate(layers):
        profiled = f"{profiled_ms[i]:.1f}" if i < len(profiled_ms) else "-"
        times = f"{t.fwd_ms:.2f} | {t.bwd_ms:.2f} | {t.total_ms:.2f}"
        rows.append(f"| {i} | {t.name} | {t.share:.0%} | {times} | {profiled} |")
    return rows


def pipeline_table(result: dict[str, Any]) -> list[str]:
    """The paired comparison's table and verdict, then how many of DynMo's decisions it applied."""
    rebalances = result["rows"]["DynMo"].get("rebalances", [0] * len(result["decisions"]))
    applied = ", ".join(f"{a} of {d}" for a, d in zip(rebalances, result["decisions"], strict=True))
    verdict, _ = harness.verdict(result["comparison"])
    return [
        *harness.table(result["rows"], result["comparison"]),
        "",
        *verdict,
        f"DynMo decisions applied per round: {applied}.",
    ]


def early_exit_section(setup: Setup, projection: Projection) -> str:
    threshold = calibrate_exit_threshold(setup)
    config = early_exit_model(setup, threshold)
    model = GPT(config)
    layers, first, last = layer_times(model, setup.microbatch(), setup.timing_repeats)
    exits = [t.share for t in layers if t.name == "EarlyExitBlock"]
    rates = [1 - b / a for a, b in itertools.pairwise(exits) if a > 0]
    exit_rate = statistics.mean(rates) if rates else 0.0
    print("[early_exit] pipeline ...", file=sys.stderr, flush=True)
    pipe = pipeline_comparison(config, {"on_events": True}, setup)
    proj = project_early_exit(layers, (first, last), exit_rate, projection)
    rows = setup.batch_size // setup.num_microbatches
    return "\n".join(
        [
            "### Early exit",
            "",
            f"Threshold {threshold:.3g} (calibrated: {setup.exit_share:.0%} of the active tokens leave at "
            f"the first exit layer; measured mean exit rate per exit layer {exit_rate:.0%}), CALM position "
            f"decay (τ = 4). Per-layer time on one micro-batch of {rows} rows, and the per-step cost DynMo's "
            "profiler measured inside the pipeline (last round):",
            "",
            *layer_table(layers, pipe["profiled_layer_ms"]),
            "",
            "2-stage pipeline (trigger: the blocks' dynamism events):",
            "",
            *pipeline_table(pipe),
            "",
            f"Projection, {projection.num_layers} layers on {projection.num_stages} stages "
            f"({projection.num_microbatches} micro-batches, 1F1B, simulator): the first quarter dense, then "
            f"{exit_rate:.0%} of the active tokens leave at every exit layer ({proj['last_share']:.1%} reach "
            f"the last); layer time from the line fitted to the measured layers. Static `{proj['static']}`: "
            f"{proj['static_ms']:.1f} ms; DynMo `{proj['dynmo']}`: {proj['dynmo_ms']:.1f} ms; "
            f"**{proj['speedup']:.2f}x**.",
        ]
    )


def mod_section(setup: Setup, projection: Projection, capacities: Sequence[float]) -> str:
    config = mod_model(setup)
    layers, first, last = layer_times(GPT(config), setup.microbatch(), setup.timing_repeats)
    by_capacity = mod_capacity_times(setup, capacities)
    shares = routed_shares(setup, batches=max(4, setup.timing_repeats))
    print("[mod] pipeline ...", file=sys.stderr, flush=True)
    pipe = pipeline_comparison(config, {"every_step": True}, setup)
    proj = project_mod(by_capacity, shares, (first, last), projection)
    share_rows = [
        f"| {i} | {statistics.mean(s):.0%} | {min(s):.0%} | {max(s):.0%} |" for i, s in sorted(shares.items())
    ]
    return "\n".join(
        [
            "### Mixture of Depths",
            "",
            "A routed block (top-k routing) against the share of tokens it processes, one micro-batch:",
            "",
            *layer_table(by_capacity),
            "",
            "The ready configuration (every other block routed, predictor routing, capacity "
            f"{setup.capacity:g}; untrained predictor): processed share per routed layer over "
            f"{len(next(iter(shares.values())))} batches:",
            "",
            "| layer | mean | min | max |",
            "|---:|---:|---:|---:|",
            *share_rows,
            "",
            "Its per-layer time, and the per-step cost DynMo's profiler measured inside the pipeline:",
            "",
            *layer_table(layers, pipe["profiled_layer_ms"]),
            "",
            "2-stage pipeline (trigger: every step):",
            "",
            *pipeline_table(pipe),
            "",
            f"Projection, {projection.num_layers} layers on {projection.num_stages} stages "
            f"({projection.num_microbatches} micro-batches, 1F1B, simulator): every other layer routed, "
            "each routed layer's share following the measured per-batch shares over "
            f"{proj['steps']} steps. Static `{proj['static']}`: {proj['static_ms']:.1f} ms per step; DynMo "
            f"re-partitioning every step on smoothed past costs: {proj['dynmo_ms']:.1f} ms "
            f"(**{proj['speedup']:.2f}x**); an oracle knowing each step's costs: {proj['oracle_ms']:.1f} ms "
            f"({proj['oracle_speedup']:.2f}x); the best fixed placement for the mean costs, "
            f"`{proj['fixed']}`: {proj['fixed_ms']:.1f} ms.",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = harness.argument_parser(__doc__, "tiny model, one round", "rounds", "steps", "settle")
    parser.add_argument("--case", choices=[*CASES, "both"], default="both")
    parser.add_argument("--timing-repeats", type=int, default=None)
    parser.add_argument("--exit-share", type=float, default=0.3)
    parser.add_argument("--capacity", type=float, default=0.125)
    args = parser.parse_args(argv)
    out = results_path("early_exit_mod", args.out, args.force)
    quick = args.quick
    setup = Setup(
        num_layers=4 if quick else 8,
        d_model=32 if quick else 128,
        num_heads=2 if quick else 4,
        seq_len=32 if quick else 128,
        batch_size=8,
        num_microbatches=4,
        steps=args.steps or (8 if quick else 30),
        settle=args.settle if args.settle is not None else (4 if quick else 12),
        rounds=args.rounds or (1 if quick else 3),
        sweep_repeats=1 if quick else 3,
        timing_repeats=args.timing_repeats or (3 if quick else 20),
        exit_share=args.exit_share,
        capacity=args.capacity,
    )
    if setup.settle + 2 > setup.steps:
        parser.error("--steps must leave at least 2 measured steps after --settle")
    torch.set_num_threads(1)
    projection = Projection()
    started = time.perf_counter()
    sections = []
    if args.case in ("early_exit", "both"):
        sections.append(early_exit_section(setup, projection))
    if args.case in ("mod", "both"):
        sections.append(mod_section(setup, projection, (0.125, 0.25, 0.5, 1.0)))
    harness.finish(
        "early_exit_mod",
        out,
        [
            harness.header(
                "Early exit and Mixture of Depths: real compute",
                "early_exit_mod",
                argv,
                [harness.REAL, harness.PROJECTED],
            ),
            f"Setup: GPT with {setup.num_layers} blocks, d_model {setup.d_model}, {setup.num_heads} heads, "
            f"seq_len {setup.seq_len}, batches of {setup.batch_size} rows in {setup.num_microbatches} "
            f"micro-batches, float32, one torch thread per process; pipeline jobs: 2 gloo ranks, 1F1B, "
            f"{setup.steps} steps (the first {setup.settle} not measured), {setup.rounds} interleaved "
            "round(s), medians; learning rate 1e-8 (the routing must not drift while measured).",
            *sections,
        ],
        started,
    )


if __name__ == "__main__":
    main()
