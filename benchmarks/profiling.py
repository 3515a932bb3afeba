"""Benchmark: per-layer times profiled inside a real pipeline step vs the same layers timed alone (CPU).

A 2-stage ``torch.distributed.pipelining`` pipeline (gloo, one torch thread per rank, started with
torch's elastic launcher) of residual MLP blocks of uneven widths. Each rank profiles its layers with
:class:`LayerProfiler` over a window of steps. After every profiled step each rank also times hook-free
copies ("twins") of its layers outside the pipeline, forward then backward on fresh micro-batches, as
many as a step has, with one untimed call first:

- **alone**: one rank at a time while the other waits (the strict reference);
- **co-running**: every rank at once, so both cores are busy as they are inside the pipeline;
- **after idle** (diagnostic): alone, but each timed call comes right after an idle sleep (``--idle-ms``),
  as a stage's first call after it waited for its peer does.

The same layers are also profiled in one process as one stage (no peer, no communication threads),
which checks the profiler's attribution on its own.

Two effects besides the profiler make a layer's time differ between a pipeline and a twin on CPU, and
the script measures them rather than guessing:

- **Page faults.** glibc returns freed blocks of 128 KiB and more to the OS and faults them back in on
  the next use, and how often that happens depends on the whole process's allocation history, so a
  pipeline stage and a twin fault differently. The script counts minor page faults of the profiled
  steps and of the twins' timed calls, and runs everything twice: with glibc's defaults, and with the
  allocator kept steady (``mallopt``: no ``mmap`` below 32 MiB, no trimming), which is what a caching
  allocator (jemalloc, tcmalloc) gives a CPU training job.
- **A co-running neighbour** sharing caches and memory bandwidth: the co-running reference.
- **Waking up.** A call that comes right after the process slept (waiting for its peer) runs slower
  while the core warms up again; on a VM the effect can be large. In 1F1B every backward of stage 0
  starts after such a wait, so its last layer pays it on every micro-batch. The after-idle column
  measures this per layer.

Target (issue #4): every per-layer figure within 20% of the isolated timing.

Usage::

    python -m benchmarks.profiling [--repeats 3] [--steps 20] [--allocator both|steady|default] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from benchmarks._lib import harness
from benchmarks._lib.common import launch, results_path, write_report
from lightning_dynmo.profiling import LayerProfiler

WIDTH, TOKENS, MICROBATCH_ROWS = 128, 64, 4
HIDDEN = [256, 1024, 512, 128, 768, 256, 1024, 384]  # uneven on purpose: costs differ per layer
TOLERANCE = 0.2
ALLOCATORS = ("default", "steady")


@dataclass(frozen=True)
class Spec:
    """One measurement: how the pipeline runs and how the allocator behaves in every process."""

    allocator: str
    schedule: str = "1F1B"
    microbatches: int = 4
    steps: int = 20
    idle_ms: float = 5.0


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block, the cost shape of a transformer FFN."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stage(nn.Module):
    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): m for i, m in sorted(layers.items())})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def set_allocator(mode: str) -> None:
    """``steady``: glibc keeps freed memory (no ``mmap`` below 32 MiB, no trim); ``default``: leave it."""
    if mode == "default":
        return
    if mode != "steady":
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {mode!r}.")
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise RuntimeError("glibc mallopt refused the steady allocator settings.")


def _microbatch() -> torch.Tensor:
    return torch.randn(MICROBATCH_ROWS, TOKENS, WIDTH, requires_grad=True)


def time_alone(layer: nn.Module, microbatches: int, idle_s: float = 0.0) -> tuple[float, float, int, int]:
    """Forward s, backward s, forward faults, backward faults of ``layer`` over ``microbatches`` calls.

    One untimed call first: the first call after a wait reads high, and the profiler charges a layer
    its median call, not its first. ``idle_s > 0`` sleeps that long before every timed forward and
    backward, as a stage idles while it waits for its peer (the idle reference).
    """
    warm = layer(_microbatch())
    warm.backward(torch.ones_like(warm))
    fwd_s = bwd_s = 0.0
    fwd_faults = bwd_faults = 0
    for _ in range(microbatches):
        x = _microbatch()
        if idle_s:
            time.sleep(idle_s)
        f0 = _minor_faults()
        t0 = time.perf_counter()
        y = layer(x)
        t1 = time.perf_counter()
        f1 = _minor_faults()
        grad = torch.ones_like(y)  # the pipeline's output gradient also arrives ready-made
        if idle_s:
            time.sleep(idle_s)
        f2 = _minor_faults()
        t2 = time.perf_counter()
        y.backward(grad)
        t3 = time.perf_counter()
        bwd_faults += _minor_faults() - f2
        fwd_s, bwd_s, fwd_faults = fwd_s + t1 - t0, bwd_s + t3 - t2, fwd_faults + f1 - f0
    return fwd_s, bwd_s, fwd_faults, bwd_faults


def _median(samples: Sequence[tuple[float, ...]], field: int) -> float:
    return statistics.median(s[field] for s in samples)


def _rows(
    profiled: Any, alone: dict[int, list[Any]], shared: dict[int, list[Any]], idle: dict[int, list[Any]]
) -> dict[int, dict[str, float]]:
    nan = float("nan")
    return {
        i: {
            "fwd_prof": p.fwd_time_s,
            "bwd_prof": p.bwd_time_s,
            "fwd_alone": _median(alone[i], 0),
            "bwd_alone": _median(alone[i], 1),
            "fwd_shared": _median(shared[i], 0) if shared else nan,
            "bwd_shared": _median(shared[i], 1) if shared else nan,
            "fwd_idle": _median(idle[i], 0) if idle else nan,
            "bwd_idle": _median(idle[i], 1) if idle else nan,
            "faults_alone": _median(alone[i], 2) + _median(alone[i], 3),
        }
        for i, p in profiled.layers.items()
    }


def _profiled_step(profiler: LayerProfiler, step: Any) -> int:
    """Run one profiled step; return the minor page faults it took (read outside the timed hooks)."""
    before = _minor_faults()
    profiler.begin_step()
    step()
    profiler.end_step()
    return _minor_faults() - before


def pipeline_rank(spec: Spec) -> dict[str, Any]:
    """One rank of the pipelined measurement; rank 0 returns every rank's rows."""
    torch.set_num_threads(1)
    set_allocator(spec.allocator)
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = _measure_stage(spec, rank, world)
        everyone: list[Any] = [None] * world
        dist.gather_object(mine, everyone if rank == 0 else None, dst=0)
    finally:
        dist.destroy_process_group()
    return {"ranks": everyone} if rank == 0 else {}


def _measure_stage(spec: Spec, rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    blocks = {i: MLPBlock(h) for i, h in enumerate(HIDDEN)}
    per_stage = len(HIDDEN) // world
    mine = {i: b for i, b in blocks.items() if i // per_stage == rank}
    twins = {i: copy.deepcopy(b) for i, b in mine.items()}  # copied before any hook exists
    stage = PipelineStage(Stage(mine), rank, world, torch.device("cpu"))
    schedule = get_schedule_class(spec.schedule)(
        stage, spec.microbatches, loss_fn=lambda out, target: (out - target).square().mean()
    )
    x = torch.randn(spec.microbatches * MICROBATCH_ROWS, TOKENS, WIDTH)
    y = torch.randn_like(x)

    def step() -> float:
        t0 = time.perf_counter()
        inputs = (x,) if rank == 0 else ()
        targets = {"target": y, "losses": []} if rank == world - 1 else {}
        schedule.step(*inputs, **targets)
        return time.perf_counter() - t0

    for _ in range(2):  # shape inference and allocator warm-up
        step()
    dist.barrier()
    plain_step_s = statistics.median(step() for _ in range(spec.steps))

    # Profiled steps and reference timings are interleaved, so all see the same background load.
    profiler = LayerProfiler(mine, warmup_steps=1, profile_steps=spec.steps, stages=[stage])
    profiler.start()
    alone: dict[int, list[Any]] = {i: [] for i in mine}
    shared: dict[int, list[Any]] = {i: [] for i in mine}
    idle: dict[int, list[Any]] = {i: [] for i in mine}
    faults: list[int] = []
    while not profiler.done:
        dist.barrier()
        faults.append(_profiled_step(profiler, step))
        for turn in range(world):  # one rank at a time: no co-running stage either
            dist.barrier()
            if turn == rank:
                for i, twin in twins.items():
                    alone[i].append(time_alone(twin, spec.microbatches))
                    idle[i].append(time_alone(twin, spec.microbatches, idle_s=spec.idle_ms / 1e3))
        dist.barrier()
        for i, twin in twins.items():  # every rank at once, as the cores are shared inside a pipeline
            shared[i].append(time_alone(twin, spec.microbatches))
    result = profiler.result()
    return {
        "rows": _rows(result, alone, shared, idle),
        "faults_per_step": statistics.median(faults),
        "plain_step_s": plain_step_s,
        "profiled_step_s": result.step_time_s,
        "hook_s": result.hook_time_s,
    }


def single_process(spec: Spec) -> dict[str, Any]:
    """All blocks as one stage in one process (no peer, no communication threads), same references."""
    torch.set_num_threads(1)
    set_allocator(spec.allocator)
    torch.manual_seed(0)
    layers = {i: MLPBlock(h) for i, h in enumerate(HIDDEN)}
    twins = {i: copy.deepcopy(m) for i, m in layers.items()}
    stage = Stage(layers)

    def step() -> None:
        for _ in range(spec.microbatches):
            out = stage(_microbatch())
            out.backward(torch.ones_like(out))

    for _ in range(3):
        step()
    profiler = LayerProfiler(layers, warmup_steps=1, profile_steps=spec.steps)
    profiler.start()
    alone: dict[int, list[Any]] = {i: [] for i in layers}
    faults: list[int] = []
    while not profiler.done:
        faults.append(_profiled_step(profiler, step))
        for i, twin in twins.items():
            alone[i].append(time_alone(twin, spec.microbatches))
    return {"rows": _rows(profiler.result(), alone, {}, {}), "faults_per_step": statistics.median(faults)}


# -- report ------------------------------------------------------------------------------------------


def _ratios(rows: dict[int, dict[str, float]], reference: str) -> list[float]:
    return [rows[i][f"{d}_prof"] / rows[i][f"{d}_{reference}"] for i in sorted(rows) for d in ("fwd", "bwd")]


def _within(ratios: list[float]) -> str:
    inside = sum(1 - TOLERANCE <= r <= 1 + TOLERANCE for r in ratios)
    return f"{inside}/{len(ratios)} ({min(ratios):.2f}-{max(ratios):.2f})"


def _twin_faults(rows: dict[int, dict[str, float]]) -> float:
    return sum(r["faults_alone"] for r in rows.values())


def _merged(run: dict[str, Any]) -> dict[int, dict[str, float]]:
    return {i: row for rank in run["pipeline"]["ranks"] for i, row in rank["rows"].items()}


def report(args: argparse.Namespace, runs: list[dict[str, Any]]) -> str:
    spec = runs[0]["spec"]
    lines = [
        harness.header(
            "Profiling accuracy: in a pipeline step vs the layer alone",
            "profiling",
            args.argv,
            [harness.REAL],
        ),
        "",
        f"Setup: 2 ranks (gloo, elastic launcher, 1 torch thread each), schedule {spec.schedule}, "
        f"{spec.microbatches} micro-batches of {MICROBATCH_ROWS}x{TOKENS}x{WIDTH} float32 per step, "
        f"residual MLP blocks with hidden sizes {HIDDEN}. Profiled: per-layer medians over {spec.steps} "
        f"steps after 1 warm-up step. References: hook-free twins timed after every profiled step "
        f"(median), alone (one rank at a time), co-running (all ranks at once) and alone after "
        f"{spec.idle_ms:g} ms idle before each call. Page faults: minor "
        f"faults per step (median), of the profiled steps and of the twins' timed calls. "
        f"torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores; load average before {args.load_before:.2f}, after "
        f"{os.getloadavg()[0]:.2f}.",
        "",
        f"## Per-layer figures within {TOLERANCE:.0%} (count, ratio range profiled / reference)",
        "",
        "| allocator | run | pipeline vs alone | pipeline vs co-running | one process vs alone "
        "| page faults / step: pipeline stages | their twins | one process | its twins |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        rows, single = _merged(run), run["single"]["rows"]
        stage_faults = " + ".join(f"{r['faults_per_step']:.0f}" for r in run["pipeline"]["ranks"])
        lines.append(
            f"| {run['spec'].allocator} | {run['repeat']} | {_within(_ratios(rows, 'alone'))} "
            f"| {_within(_ratios(rows, 'shared'))} | {_within(_ratios(single, 'alone'))} "
            f"| {stage_faults} | {_twin_faults(rows):.0f} | {run['single']['faults_per_step']:.0f} "
            f"| {_twin_faults(single):.0f} |"
        )
    for run in runs:
        lines += _layer_table(run)
    lines += [
        "",
        "## Profiler overhead (last run)",
        "",
        "| stage | step without hooks ms | step with hooks ms | hook CPU time per step ms |",
        "|---|---|---|---|",
    ]
    for stage, r in enumerate(runs[-1]["pipeline"]["ranks"]):
        lines.append(
            f"| {stage} | {r['plain_step_s'] * 1e3:.1f} | {r['profiled_step_s'] * 1e3:.1f} "
            f"| {r['hook_s'] * 1e3:.2f} |"
        )
    lines += [
        "",
        "Times are per training step (all micro-batches). The step-time comparison includes the machine's "
        "noise; the hook CPU time is the profiler's own cost, measured inside its hooks.",
    ]
    return "\n".join(lines)


def _layer_table(run: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"## Per layer: allocator {run['spec'].allocator}, run {run['repeat']}",
        "",
        "| layer | stage | pass | profiled ms | alone ms | co-running ms | / alone | / co-running "
        "| alone after idle ms | idle / alone |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, rank in enumerate(run["pipeline"]["ranks"]):
        for i, row in sorted(rank["rows"].items()):
            for d in ("fwd", "bwd"):
                prof, alone, shared = row[f"{d}_prof"], row[f"{d}_alone"], row[f"{d}_shared"]
                idle = row[f"{d}_idle"]
                lines.append(
                    f"| {i} | {stage} | {d} | {prof * 1e3:.2f} | {alone * 1e3:.2f} | {shared * 1e3:.2f} "
                    f"| {prof / alone:.2f} | {prof / shared:.2f} | {idle * 1e3:.2f} | {idle / alone:.2f} |"
                )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__, "the steady allocator, 1 run of 2 steps", "repeats", "steps")
    parser.add_argument("--allocator", choices=(*ALLOCATORS, "both"), default=None, help="default: both")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--idle-ms", type=float, default=5.0, help="sleep before each after-idle call")
    args = parser.parse_args(argv)
    out = results_path("profiling", args.out, args.force)
    args.repeats = args.repeats or (1 if args.quick else 3)  # runs per allocator setting
    args.steps = args.steps or (2 if args.quick else 20)  # profiled steps per run
    args.allocator = args.allocator or ("steady" if args.quick else "both")
    args.argv = sys.argv[1:] if argv is None else argv
    args.load_before = os.getloadavg()[0]
    allocators = ALLOCATORS if args.allocator == "both" else (args.allocator,)
    runs = []
    for allocator in allocators:
        spec = Spec(allocator=allocator, schedule=args.schedule, steps=args.steps, idle_ms=args.idle_ms)
        for repeat in range(1, args.repeats + 1):
            runs.append(
                {
                    "spec": spec,
                    "repeat": repeat,
                    "pipeline": launch(pipeline_rank, spec),
                    "single": launch(single_process, spec, nproc=1),
                }
            )
    write_report(report(args, runs), "profiling", out)


if __name__ == "__main__":
    main()
