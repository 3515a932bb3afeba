"""How much this machine's own speed moves: the noise floor under every real-compute comparison.

The calibration benchmarks compare predicted with measured steps; on a shared VM part of any difference
is the machine. Two questions, on a fixed workload (a stage of 4 of our GPT's blocks at the calibration's
sizes, width 128, 4 micro-batches of 2x64 tokens, forward and backward; one torch thread, pinned):

- **co-running**: does a rank slow down while the other core computes? Two processes, one per core,
  started together: one times the workload step after step, the other runs the same workload in
  phases of ``--phase-s`` and sleeps in between. Each timed step is filed by the other core's phase
  (steps that straddle a phase change are dropped), so both halves come from the same processes at
  interleaved times. Then the roles swap cores.
- **drift and process-to-process spread**: ``--processes`` fresh processes one after the other (cores
  alternating), each timing ``--segments`` segments of ``--segment-s``; per process its segments'
  medians. The spread inside a process (its segments) is the machine drifting over seconds; the spread
  between processes' medians adds what differs from one process to the next.

**Real compute**; medians.

    python -m benchmarks.machine_noise
    python -m benchmarks.machine_noise --quick      # a smoke run: short phases, 2 processes
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks._lib import harness
from benchmarks._lib.common import results_path, write_report
from benchmarks.hook_cost import blocks, stage_step

MICROBATCHES = 4


def _workload() -> Any:
    torch.manual_seed(0)
    step = stage_step(blocks(4, "gpt"), MICROBATCHES)
    for _ in range(3):
        step()
    return step


def _pin(core: int) -> None:
    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})


def _corun_rank(core: int, timer: bool, start: float, seconds: float, phase_s: float, out: Any) -> None:
    """One process of the co-running pair: the timer files its steps by the load's phase."""
    _pin(core)
    step = _workload()
    busy: dict[bool, list[float]] = {True: [], False: []}

    def load_busy(now: float) -> bool:  # the load computes in even phases
        return int((now - start) / phase_s) % 2 == 0

    while time.time() < start:
        time.sleep(0.001)
    while (now := time.time()) < start + seconds:
        if not timer:
            if load_busy(now):
                step()
            else:
                time.sleep(0.002)
            continue
        t0 = time.perf_counter()
        step()
        took = time.perf_counter() - t0
        if load_busy(now) == load_busy(time.time()):  # the whole step ran in one phase
            busy[load_busy(now)].append(took)
    if timer:
        out.put({k: v for k, v in busy.items()})


def corun(cores: list[int], seconds: float, phase_s: float) -> list[dict[str, Any]]:
    """Per timed core: median step with the other core computing and idle, and the steps filed."""
    ctx = mp.get_context("fork")
    rows = []
    for timed, load in ((cores[0], cores[1]), (cores[1], cores[0])):
        queue = ctx.Queue()
        start = time.time() + 3.0  # both have built their blocks by then
        procs = [
            ctx.Process(target=_corun_rank, args=(timed, True, start, seconds, phase_s, queue)),
            ctx.Process(target=_corun_rank, args=(load, False, start, seconds, phase_s, queue)),
        ]
        for p in procs:
            p.start()
        busy = queue.get(timeout=seconds + 120)
        for p in procs:
            p.join(timeout=60)
        if not busy[True] or not busy[False]:
            raise RuntimeError(f"core {timed}: no step fell inside a phase; raise --phase-s")
        rows.append(
            {
                "core": timed,
                "busy_ms": 1e3 * statistics.median(busy[True]),
                "idle_ms": 1e3 * statistics.median(busy[False]),
                "steps": (len(busy[True]), len(busy[False])),
            }
        )
    return rows


def _drift_rank(core: int, segments: int, segment_s: float, out: Any) -> None:
    _pin(core)
    step = _workload()
    medians = []
    for _ in range(segments):
        times, until = [], time.perf_counter() + segment_s
        while time.perf_counter() < until:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        medians.append(1e3 * statistics.median(times))
    out.put(medians)


def drift(cores: list[int], processes: int, segments: int, segment_s: float) -> list[tuple[int, list[float]]]:
    """Per fresh process (cores alternating): its core and its segments' median steps, ms."""
    ctx = mp.get_context("fork")
    rows = []
    for i in range(processes):
        queue, core = ctx.Queue(), cores[i % len(cores)]
        proc = ctx.Process(target=_drift_rank, args=(core, segments, segment_s, queue))
        proc.start()
        rows.append((core, queue.get(timeout=segments * segment_s + 120)))
        proc.join(timeout=60)
    return rows


def report(args: Any, corun_rows: list[dict[str, Any]], drift_rows: list[tuple[int, list[float]]]) -> str:
    lines = [
        f"## How much the machine's speed moves ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{harness.command('machine_noise', args.argv)}`  ",
        f"Hardware: {harness.hardware()}.  ",
        "Figures: **real compute**; workload: a stage of 4 of our GPT's blocks (width 128), "
        f"{MICROBATCHES} micro-batches of 2x64 tokens forward and backward, one torch thread, pinned.",
        "",
        f"### Co-running: the other core computing or idle, in phases of {args.phase_s:g} s "
        f"({args.corun_s:g} s a side)",
        "",
        "| timed core | other core computing (ms) | other core idle (ms) | slowdown "
        "| steps (computing / idle) |",
        "|---:|---:|---:|---:|---|",
    ]
    for row in corun_rows:
        lines.append(
            f"| {row['core']} | {row['busy_ms']:.1f} | {row['idle_ms']:.1f} "
            f"| {row['busy_ms'] / row['idle_ms'] - 1:+.1%} | {row['steps'][0]} / {row['steps'][1]} |"
        )
    medians = [statistics.median(m) for _, m in drift_rows]
    inside = [(max(m) - min(m)) / statistics.median(m) for _, m in drift_rows]
    overall = statistics.median(medians)
    lines += [
        "",
        f"### Drift: {len(drift_rows)} fresh processes one after the other, {args.segments} segments of "
        f"{args.segment_s:g} s each",
        "",
        "| process | core | segments' median steps (ms) | its median | segments' range |",
        "|---:|---:|---|---:|---:|",
    ]
    for i, ((core, segs), med, spread) in enumerate(zip(drift_rows, medians, inside, strict=True)):
        lines.append(
            f"| {i + 1} | {core} | {', '.join(f'{s:.1f}' for s in segs)} | {med:.1f} | {spread:.0%} |"
        )
    lines += [
        "",
        f"Inside a process, its segments span {statistics.median(inside):.0%} of its median (median over "
        f"processes; widest {max(inside):.0%}). Between processes, their medians span "
        f"{(max(medians) - min(medians)) / overall:.0%} of the overall median ({overall:.1f} ms).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__, "short phases, 2 processes")
    parser.add_argument("--phase-s", type=float, default=1.0, help="the load's busy and idle phases")
    parser.add_argument("--corun-s", type=float, default=40.0, help="seconds each co-running side runs")
    parser.add_argument("--processes", type=int, default=8, help="fresh processes the drift part starts")
    parser.add_argument("--segments", type=int, default=4, help="timed segments per process")
    parser.add_argument("--segment-s", type=float, default=2.0, help="seconds per segment")
    args = parser.parse_args(argv)
    if args.quick:
        args.phase_s, args.corun_s, args.processes, args.segments, args.segment_s = 0.5, 3.0, 2, 2, 0.5
    args.argv = sys.argv[1:] if argv is None else argv
    out = results_path("machine_noise", args.out, args.force)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    if len(cores) < 2:
        raise SystemExit("machine_noise needs 2 usable cores (co-running compares one core with the other)")
    torch.set_num_threads(1)  # the processes are forked from this one
    corun_rows = corun(cores[:2], args.corun_s, args.phase_s)
    drift_rows = drift(cores[:2], args.processes, args.segments, args.segment_s)
    write_report(report(args, corun_rows, drift_rows), "machine_noise", out)


if __name__ == "__main__":
    main()
