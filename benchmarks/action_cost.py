"""The runtime's CPU cost per pipeline action: torch's bare schedule against DynMo on the same stage.

One stage holding a whole small GPT (embedding, ``--layers`` dense blocks, head and loss: the
calibration's sizes, width 128, 64 tokens, 2 rows a micro-batch), ``--microbatches`` micro-batches a
step under 1F1B, one process, one torch thread, world size 1 (gloo). Each job is its own process (a
fresh interpreter; ``--quick`` forks them); jobs run in rotated interleaved rounds
(:func:`benchmarks._lib.harness.rotated`):

- ``bare``: torch's own ``PipelineStage`` + ``Schedule1F1B`` over a plain module calling the model's
  embedding, blocks, head and loss; the step is ``schedule.step`` (its gradients scaled by torch);
- ``dynmo idle``: ``Trainer(strategy=DynMoStrategy(num_microbatches=...))`` with
  ``DynMoCallback(every_n_steps=10_000)`` (its always-on parts only: the busy timer and the per-step
  exchange); the step is everything DynMo runs for it: the strategy's ``training_step`` (batch split,
  schedule step, gradient bookkeeping, loss reduction and logging), its ``backward`` and its batch-start
  hook, and the callback's ``on_train_batch_start`` / ``on_train_batch_end``;
- ``dynmo window``: the same with ``DynMoCallback(every_step=True, skip_balanced=False)``, so every step
  runs inside a profiling window (per-layer hooks, the memory meter) and ends in a decision.

A job's figure is the median over its steps after ``--skip`` of the **CPU time** of the step
(``time.thread_time`` of the main thread: the schedule, the stage's compute and DynMo's bookkeeping all run
there) divided by the step's actions (one forward and one backward per micro-batch), and its wall time
likewise. The ratio of a DynMo job to ``bare`` is taken within each round; the report gives the median
and every round. The optimizer step is outside the timed step in every job (the same AdamW in each).

Then the check (in the same rounds, interleaved with the jobs above): the profiler's account of the step
against the measured step of the same run. Two more jobs, ``dynmo_check:none`` (blocks not compiled) and
``dynmo_check:<--compile-backend>`` (``DynMoStrategy(compile_blocks={"backend": ...})``, inductor by
default), open a window every ``skip`` steps from step ``skip`` on (none measures the first, compiling
steps). The blocks' profiled costs plus the parts' (embedding; head and loss) plus the optimizer update
the profiler timed in the window (shared among the units by parameter entries with a gradient), exactly
as the callback's last decision gave them to the balancer, are set against three measured medians of
the same run: the schedule step (every action), DynMo's step (the timed section above) and Lightning's
whole step (from the first callback's batch-start hook to the last one's batch-end hook: also zero_grad,
the optimizer update and Lightning's own loop). Every round and the median are reported, and a breakdown
of where the step goes: each piece (loss reduction, loss logging, the carried gradients' backward, the
optimizer update, the callback's hooks, ...) timed by its own clock, never as a remainder.

``--shape`` chooses the stage: ``small`` (the sizes above: a stage whose fixed costs are a large share of
its step), ``d512`` (4 GPT blocks of width 512, 8 heads, 256 tokens, 1 row a micro-batch, 4 micro-batches,
12 steps, medians of steps 4+: the blocks' work dominates the step, as at the sizes users train) or
``d512x2`` (the same blocks, 2 rows a micro-batch, 8 steps: one window, steps 5-7; the optimizer update,
which grows with the parameters but not the tokens, is half the share of the step).
``--check-only`` runs the check's jobs alone.

Real compute.

    python -m benchmarks.action_cost                # 4 rounds, ~6 minutes on 2 busy cores
    python -m benchmarks.action_cost --shape d512 --check-only   # 3 rounds of the check, ~4.5 minutes
    python -m benchmarks.action_cost --quick        # a smoke run (1 round, few steps): not figures
    python -m benchmarks.action_cost --profile dynmo_idle   # cProfile of one job's timed steps, to stderr
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

JOBS = ("bare", "dynmo_idle", "dynmo_window")
LABELS = {
    "bare": "torch's bare PipelineStage + Schedule1F1B",
    "dynmo_idle": "DynMoStrategy + DynMoCallback idle",
    "dynmo_window": "DynMoStrategy + DynMoCallback, every step in a profiling window",
}


@dataclass(frozen=True)
class Sizes:
    """A run's model and step sizes."""

    layers: int = 4
    width: int = 128
    heads: int = 4
    tokens: int = 64
    rows: int = 2  # per micro-batch
    microbatches: int = 4
    steps: int = 30
    skip: int = 10


#: The pieces of a DynMo step the breakdown times (wall seconds), in the order Lightning runs them; a
#: piece with one more dot is inside the one above it.
PIECES = (
    "Lightning's whole step (first batch-start hook to last batch-end hook)",
    "· batch-start hooks (strategy, callback)",
    "· strategy training_step",
    "· · batch split, gradients set aside and restored",
    "· · schedule step (every forward and backward action)",
    "· · loss reduction",
    "· · loss logging (LightningModule.log)",
    "· · step-end hook and the gradient carrier",
    "· zero_grad",
    "· strategy backward (the carried gradients into .grad)",
    "· optimizer update (AdamW)",
    "· callback batch-end hook",
)
(
    WHOLE,
    HOOKS_START,
    TRAINING_STEP,
    SPLIT,
    SCHEDULE,
    REDUCE,
    LOG,
    CARRY,
    ZERO_GRAD,
    BACKWARD,
    OPTIMIZER,
    HOOK_END,
) = PIECES

QUICK = Sizes(layers=2, width=32, heads=2, tokens=16, rows=2, microbatches=2, steps=6, skip=2)
#: ``--shape``: ``small`` (the calibration's sizes: a stage whose fixed costs are a large share of its step),
#: ``d512`` (GPT blocks of width 512 over 256 tokens, where the blocks' work dominates a step, as it does at
#: the sizes users train) and ``d512x2`` (the same with 2 rows a micro-batch: twice the tokens a step, so the
#: optimizer update, which scales with the parameters alone, is half the share; 8 steps, one window).
SHAPES = {
    "small": Sizes(),
    "d512": Sizes(layers=4, width=512, heads=8, tokens=256, rows=1, microbatches=4, steps=12, skip=4),
    "d512x2": Sizes(layers=4, width=512, heads=8, tokens=256, rows=2, microbatches=4, steps=8, skip=4),
}


def _config(sizes: Sizes) -> Any:
    from lightning_dynmo.models import GPTConfig

    return GPTConfig(
        vocab_size=256,
        num_layers=sizes.layers,
        d_model=sizes.width,
        num_heads=sizes.heads,
        seq_len=sizes.tokens,
    )


def _batches(sizes: Sizes) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    shape = (sizes.steps, sizes.rows * sizes.microbatches, sizes.tokens + 1)
    return list(torch.randint(0, 256, shape, generator=gen))


class _CpuTimer:
    """Sums main-thread CPU and wall seconds spent inside wrapped callables, per step."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.depth = 0
        self.steps_cpu: list[float] = []
        self.steps_wall: list[float] = []

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:  # nested wrapped calls count once
                    self.cpu += time.thread_time() - c0
                    self.wall += time.perf_counter() - w0

        return timed

    def close_step(self) -> None:
        self.steps_cpu.append(self.cpu)
        self.steps_wall.append(self.wall)
        self.cpu = self.wall = 0.0


class _Pieces:
    """Wall seconds per named piece of a step (the breakdown of the step), summed per step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.steps: dict[str, list[float]] = {}
        self.marks: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.now[name] = self.now.get(name, 0.0) + seconds

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - start)

        return timed

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()

    def since(self, piece: str, mark: str) -> None:
        if mark in self.marks:
            self.add(piece, time.perf_counter() - self.marks.pop(mark))

    def close_step(self) -> None:
        for name in PIECES:
            self.steps.setdefault(name, []).append(self.now.get(name, 0.0))
        self.now = {}


def _init_group() -> None:
    import torch.distributed as dist

    store_dir = tempfile.mkdtemp(prefix="action_cost_")
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=0, world_size=1)


def run_bare(sizes: Sizes) -> dict[str, Any]:
    """One ``bare`` job: torch's schedule over a plain module; per-step CPU and wall seconds."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from lightning_dynmo.models import GPT

    torch.manual_seed(0)
    model = GPT(_config(sizes))

    class Whole(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
            self.layers, self.ln_f, self.head = model.layers, model.ln_f, model.head

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            hidden = model.pipeline_first(idx)
            for block in self.layers.values():
                hidden = block(hidden)
            return model.pipeline_last(hidden)

    _init_group()
    whole = Whole()
    stage = PipelineStage(whole, 0, 1, torch.device("cpu"), group=dist.group.WORLD)
    schedule = Schedule1F1B(stage, n_microbatches=sizes.microbatches, loss_fn=model.pipeline_loss)
    optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-3, weight_decay=0.0)
    timer = _CpuTimer()
    step = timer.wrap(schedule.step)
    losses_seen = []
    for batch in _batches(sizes):
        losses: list[torch.Tensor] = []
        step(batch[:, :-1], target=batch[:, 1:], losses=losses)
        timer.close_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses_seen.append(float(torch.stack(losses).mean()))
    dist.destroy_process_group()
    return {"cpu_s": timer.steps_cpu, "wall_s": timer.steps_wall, "losses": losses_seen}


def run_dynmo(sizes: Sizes, window: str, compile_backend: str | None = None) -> dict[str, Any]:
    """One DynMo job; per-step CPU and wall seconds, the step's pieces, and with windows the profiled costs.

    Args:
        sizes: The model's and the run's sizes.
        window: ``"idle"`` (the callback's always-on parts only), ``"every_step"`` (every step in a
            profiling window that ends in a decision) or ``"periodic"`` (a window every ``skip`` steps,
            from step ``skip`` on: none measures the first, compiling steps).
        compile_backend: Compile each block's forward with this ``torch.compile`` backend (``None``: not).
    """
    import lightning.pytorch as pl
    import torch

    from lightning_dynmo import DynMoCallback, DynMoStrategy
    from lightning_dynmo.models import GPT, OptimizerConfig

    torch.manual_seed(0)
    model = GPT(_config(sizes), OptimizerConfig(lr=1e-3, weight_decay=0.0, warmup_steps=0))
    if window == "periodic":
        callback = DynMoCallback(every_n_steps=sizes.skip, min_gain=0.5)
    elif window == "every_step":
        callback = DynMoCallback(every_step=True, skip_balanced=False, min_gain=0.5)
    else:
        callback = DynMoCallback(every_n_steps=10_000)
    compiled = {"backend": compile_backend} if compile_backend is not None else False
    strategy = DynMoStrategy(num_microbatches=sizes.microbatches, schedule="1F1B", compile_blocks=compiled)
    timer = _CpuTimer()
    pieces = _Pieces()
    # Lightning's whole step in CPU seconds of the main thread (every piece runs there, one torch thread):
    # the step's work without the time a loaded machine gave to other processes.
    whole_cpu_s: list[float] = []
    whole_cpu_start = [0.0]
    losses_seen: list[float] = []
    schedule_s: list[float] = []  # per step: the wall time of the schedule step alone (every action)
    from lightning_dynmo.pipeline.step import grads as pipeline_grads
    from lightning_dynmo.strategy import steps as strategy_steps

    run_schedule_step = strategy_steps.run_schedule_step

    def timed_schedule_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return run_schedule_step(*args, **kwargs)
        finally:
            schedule_s.append(time.perf_counter() - start)
            pieces.add(SCHEDULE, schedule_s[-1])

    # Measurement only, in this job's process: the functions the strategy's training_step calls.
    strategy_steps.run_schedule_step = timed_schedule_step
    strategy_steps.split_batch = pieces.wrap(SPLIT, strategy_steps.split_batch)
    strategy_steps.reduce_step_losses = pieces.wrap(REDUCE, strategy_steps.reduce_step_losses)
    strategy_steps.call_step_end_hook = pieces.wrap(CARRY, strategy_steps.call_step_end_hook)
    for name, piece in (("take_grads", SPLIT), ("restore_grads", SPLIT), ("loss_carrying_grads", CARRY)):
        setattr(pipeline_grads, name, pieces.wrap(piece, getattr(pipeline_grads, name)))
    model.log = pieces.wrap(LOG, model.log)  # type: ignore[method-assign]
    # Which steps each profiling window measured (its steps after warm-up), to set the profiled costs
    # against the measured steps they came from: a shared machine's load moves from second to second.
    from lightning_dynmo.profiling import LayerProfiler

    windows: list[tuple[LayerProfiler, list[int]]] = []
    profiler_begin_step = LayerProfiler.begin_step

    def counted_begin_step(profiler: LayerProfiler) -> None:
        if not windows or windows[-1][0] is not profiler:
            windows.append((profiler, []))
        calls = windows[-1][1]
        calls.append(len(pieces.steps.get(WHOLE, ())))  # this step's index
        profiler_begin_step(profiler)

    LayerProfiler.begin_step = counted_begin_step  # type: ignore[method-assign]

    class Wrap(pl.Callback):
        """First in the list: wraps what DynMo runs for a step once the Trainer has set it up."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for obj, names in (
                (strategy, ("training_step", "backward", "on_train_batch_start")),
                (callback, ("on_train_batch_start", "on_train_batch_end")),
            ):
                for name in names:
                    piece = {
                        "training_step": TRAINING_STEP,
                        "backward": BACKWARD,
                        "on_train_batch_end": HOOK_END,
                    }.get(name, HOOKS_START)
                    setattr(obj, name, timer.wrap(pieces.wrap(piece, getattr(obj, name))))
            optimizer = trainer.optimizers[0]
            optimizer.zero_grad = pieces.wrap(ZERO_GRAD, optimizer.zero_grad)  # type: ignore[method-assign]
            optimizer.register_step_post_hook(lambda *_: pieces.since(OPTIMIZER, "optimizer"))

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
            pieces.mark("step")
            whole_cpu_start[0] = time.thread_time()

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            pieces.mark("optimizer")  # the closure (training_step, zero_grad, backward) has run

    class Close(pl.Callback):
        """Last in the list: a step ends after every other callback's batch-end hook."""

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
        ) -> None:
            timer.close_step()
            pieces.since(WHOLE, "step")
            whole_cpu_s.append(time.thread_time() - whole_cpu_start[0])
            pieces.close_step()
            losses_seen.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=sizes.steps,
        limit_val_batches=0,
        callbacks=[Wrap(), callback, Close()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, torch.utils.data.DataLoader(_batches(sizes), batch_size=None))
    report: dict[str, Any] = {
        "cpu_s": timer.steps_cpu,
        "wall_s": timer.steps_wall,
        "schedule_s": schedule_s,
        "pieces_s": pieces.steps,
        "whole_cpu_s": whole_cpu_s,
        "losses": losses_seen,
    }
    # The costs the callback's last decision gave the balancer, exactly as it gave them.
    hardware = callback.last_hardware
    if window != "idle" and callback.last_costs is not None and hardware is not None:
        parts = [c for c in (hardware.first_stage_extra, hardware.last_stage_extra) if c is not None]
        report["profiled_s"] = {
            "blocks": sum(c.fwd_time_s + c.bwd_time_s for c in callback.last_costs),
            "parts": sum(c.fwd_time_s + c.bwd_time_s for c in parts),
            # The optimizer update the profiler timed, as shared among the units (one stage: its sum is
            # the step model's once-per-step term, the largest stage's update).
            "update": sum(c.update_time_s for c in [*callback.last_costs, *parts]),
        }
        # The last complete window's measured steps: those of the last decision's costs.
        complete = [
            steps[profiler.warmup_steps :]
            for profiler, steps in windows
            if len(steps) == profiler.warmup_steps + profiler.profile_steps
        ]
        report["window_steps"] = complete[-1] if complete else []
    return report


def run_job(name: str, sizes: Sizes) -> dict[str, Any]:
    """Run job ``name`` in this process."""
    import torch

    torch.set_num_threads(1)
    if name == "bare":
        return run_bare(sizes)
    if name in ("dynmo_idle", "dynmo_window"):
        return run_dynmo(sizes, window="idle" if name == "dynmo_idle" else "every_step")
    if name.startswith("dynmo_check:"):  # "dynmo_check:<backend>" ("none": not compiled), periodic windows
        backend = name.partition(":")[2]
        return run_dynmo(sizes, window="periodic", compile_backend=None if backend == "none" else backend)
    raise ValueError(f"job={name!r} is not one of {list(JOBS)} nor 'dynmo_check:<backend or none>'")


def launch_job(name: str, sizes: Sizes, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run job ``name`` in a fresh Python process; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        args = [
            sys.executable,
            "-m",
            "benchmarks.action_cost",
            "--job",
            name,
            "--sizes",
            json.dumps(asdict(sizes)),
        ]
        proc = subprocess.run(
            [*args, "--job-out", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # Lightning would otherwise give the job every core
        )
        if proc.returncode != 0:
            raise RuntimeError(f"job {name} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        report: dict[str, Any] = json.loads(out.read_text())
        return report


def per_action_us(run: dict[str, Any], key: str, sizes: Sizes) -> float:
    """A job's median step (after ``skip``) of ``key`` seconds, per action, in microseconds."""
    actions = 2 * sizes.microbatches
    return 1e6 * statistics.median(run[key][sizes.skip :]) / actions


def measure(
    sizes: Sizes, rounds: int, jobs: Sequence[str] = JOBS, forked: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Every job once per round, in rotated order; the reports per job.

    ``forked``: each job in a forked child of this process (the quick run: not figures), not a fresh
    interpreter (:func:`benchmarks._lib.common.run_forked`).
    """
    from benchmarks._lib.common import run_forked
    from benchmarks._lib.harness import rotated

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for r in range(rounds):
        for name in rotated(list(jobs), r):
            print(f"[action_cost] round {r + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            if forked:
                report = run_forked(functools.partial(run_job, name, sizes), f"job {name}", timeout_s=900)
            else:
                report = launch_job(name, sizes, timeout_s=900)
            runs[name].append(report)
    return runs


def table(runs: dict[str, list[dict[str, Any]]], sizes: Sizes) -> tuple[list[str], dict[str, float]]:
    """The report's table, and each DynMo job's median CPU ratio to ``bare``."""
    lines = [
        "| job | CPU per action (us), median | every round | wall per action (us), median | every round "
        "| CPU / bare, median | every round |",
        "|---|---:|---|---:|---|---:|---|",
    ]
    ratios: dict[str, float] = {}
    bare = [per_action_us(run, "cpu_s", sizes) for run in runs["bare"]]
    for name in JOBS:
        job_runs = runs[name]
        cpu = [per_action_us(run, "cpu_s", sizes) for run in job_runs]
        wall = [per_action_us(run, "wall_s", sizes) for run in job_runs]
        within = [c / b for c, b in zip(cpu, bare, strict=True)]
        ratios[name] = statistics.median(within)
        lines.append(
            f"| {LABELS[name]} | {statistics.median(cpu):.0f} | {', '.join(f'{c:.0f}' for c in cpu)} | "
            f"{statistics.median(wall):.0f} | {', '.join(f'{w:.0f}' for w in wall)} | {ratios[name]:.3f} | "
            f"{', '.join(f'{x:.3f}' for x in within)} |"
        )
    return lines, ratios


def check_jobs(backend: str) -> dict[str, str]:
    """The check's jobs by label: DynMo with a window every ``skip`` steps, blocks not compiled and
    compiled with ``backend`` (``"none"``: the uncompiled one alone)."""
    jobs = {"uncompiled": "dynmo_check:none"}
    if backend != "none":
        jobs[f"compiled (backend {backend!r})"] = f"dynmo_check:{backend}"
    return jobs


def _median_ms(values: Sequence[float], steps: Sequence[int]) -> float:
    return 1e3 * statistics.median(values[i] for i in steps)


def check_rounds(run: dict[str, Any], sizes: Sizes, over: str) -> dict[str, float] | None:
    """One run's profiled account against its measured steps (ms and ratios), or ``None`` without a
    decision. Every figure is measured: the profiled costs by the callback's profiler, the steps by the
    benchmark's clocks; none is derived from another.

    Args:
        run: A check job's report.
        sizes: Its sizes.
        over: ``"window"``: medians over the steps the last decision's window measured (the same steps
            the profiled costs come from); ``"run"``: over the run's steps ``skip``+.
    """
    costs = run.get("profiled_s")
    if costs is None:
        return None
    steps = run["window_steps"] if over == "window" else range(sizes.skip, len(run["wall_s"]))
    if not steps:
        return None
    update = 1e3 * costs.get("update", 0.0)
    total = 1e3 * (costs["blocks"] + costs["parts"]) + update
    schedule = _median_ms(run["schedule_s"], steps)
    dynmo = _median_ms(run["wall_s"], steps)
    whole = _median_ms(run["pieces_s"][WHOLE], steps)
    whole_cpu = _median_ms(run["whole_cpu_s"], steps)
    return {
        "blocks": 1e3 * costs["blocks"],
        "parts": 1e3 * costs["parts"],
        "update": update,
        "total": total,
        "schedule": schedule,
        "of_schedule": total / schedule,
        "dynmo": dynmo,
        "of_dynmo": total / dynmo,
        "whole": whole,
        "of_whole": total / whole,
        "whole_cpu": whole_cpu,
        "of_whole_cpu": total / whole_cpu,
    }


CHECK_COLUMNS = (
    ("blocks", "blocks (ms)", ".2f"),
    ("parts", "parts (ms)", ".2f"),
    ("update", "update (ms)", ".2f"),
    ("total", "blocks + parts + update (ms)", ".2f"),
    ("schedule", "schedule step (ms)", ".2f"),
    ("of_schedule", "/ schedule step", ".3f"),
    ("dynmo", "DynMo's step (ms)", ".2f"),
    ("of_dynmo", "/ DynMo's step", ".3f"),
    ("whole", "Lightning's whole step (ms)", ".2f"),
    ("of_whole", "/ whole step", ".3f"),
    ("whole_cpu", "whole step, CPU (ms)", ".2f"),
    ("of_whole_cpu", "/ whole step CPU", ".3f"),
)


OVER = {
    "window": "over the steps the profiler measured (the last decision's window)",
    "run": "over the run's steps after the skipped ones",
}


def profiled_vs_measured(
    runs: dict[str, list[dict[str, Any]]], sizes: Sizes, tolerance: float = 0.10
) -> tuple[list[str], dict[tuple[str, str], float]]:
    """The profiler's account of a step (blocks + parts + the optimizer update) against the measured steps
    of the same run, every round and the median, per check job, over the window's steps and over the run's;
    and each job's median ratio to Lightning's whole step, by (job label, ``over``)."""
    lines = ["### The profiler's costs against the measured step of the same run"]
    verdicts: dict[tuple[str, str], float] = {}
    for over, heading in OVER.items():
        lines += [
            "",
            f"Measured steps: medians {heading}:",
            "",
            "| run | round | " + " | ".join(title for _, title, _ in CHECK_COLUMNS) + " |",
            "|---|---|" + "---:|" * len(CHECK_COLUMNS),
        ]
        for label, job_runs in runs.items():
            rows = [check_rounds(run, sizes, over) for run in job_runs]
            for r, row in enumerate(rows):
                cells = (
                    [format(row[key], fmt) for key, _, fmt in CHECK_COLUMNS]
                    if row is not None
                    else ["no decision recorded", *[""] * (len(CHECK_COLUMNS) - 1)]
                )
                steps = (
                    f" (steps {', '.join(map(str, job_runs[r]['window_steps']))})" if over == "window" else ""
                )
                lines.append(f"| {label} | {r + 1}{steps} | " + " | ".join(cells) + " |")
            measured = [row for row in rows if row is not None]
            if measured:
                median = {key: statistics.median(row[key] for row in measured) for key, _, _ in CHECK_COLUMNS}
                cells = [f"**{format(median[key], fmt)}**" for key, _, fmt in CHECK_COLUMNS]
                lines.append(f"| {label} | median | " + " | ".join(cells) + " |")
                verdicts[(label, over)] = median["of_whole"]
    lines += [
        "",
        "Blocks and parts: the costs the callback's last decision gave the balancer (per step: each unit's "
        "median call times its calls over the window's measured steps), measured with the profiler's hooks "
        "outside each (compiled) block. Update: the optimizer update the profiler timed in the same window "
        "(from on_before_optimizer_step to the optimizer's step post-hook), shared among the units by their "
        "parameter entries with a gradient and summed back (the step model's once-per-step term on the one "
        f"stage). A window every {sizes.skip} steps from step {sizes.skip} on. "
        "Schedule step: the wall time of the strategy's schedule step (every forward and backward action); "
        "DynMo's step: the timed section of the per-action table (the strategy's training_step, backward and "
        "batch-start hook, the callback's hooks); Lightning's whole step: from the first callback's "
        "batch-start hook to the last one's batch-end hook (all of that plus zero_grad, the optimizer update "
        "and Lightning's own loop), in wall time and in CPU time of the main thread, where every piece runs "
        "(one torch thread): where the wall time is well above the CPU time, the loaded machine gave the job "
        "only part of a core. The profiler's clocks are wall clocks (as are a GPU's), so the verdicts set "
        "wall against wall. Medians over the steps named; a round's ratio is its own run's. The median row "
        "gives the median of each column over the rounds.",
        "",
    ]
    for (label, over), ratio in verdicts.items():
        within = abs(ratio - 1.0) <= tolerance
        lines.append(
            f"- {label}, {OVER[over]}: profiled blocks + parts + update / Lightning's whole step, median of "
            f"the rounds: **{ratio:.3f}**: {'within' if within else 'NOT within'} {tolerance:.0%} of the "
            "measured step."
        )
    return lines, verdicts


def breakdown(runs: dict[str, list[dict[str, Any]]], sizes: Sizes) -> list[str]:
    """Where a DynMo step's wall time goes, piece by piece, per check job: the median over rounds of each
    run's median over steps ``skip``+ (ms), and its share of Lightning's whole step."""
    labels = list(runs)
    lines = [
        "### Where the step goes",
        "",
        "| piece | " + " | ".join(f"{label} (ms) | share" for label in labels) + " |",
        "|---|" + "---:|---:|" * len(labels),
    ]
    medians = {
        label: {
            name: statistics.median(
                _median_ms(run["pieces_s"][name], range(sizes.skip, len(run["wall_s"]))) for run in job_runs
            )
            for name in PIECES
        }
        for label, job_runs in runs.items()
    }
    profiled = {
        label: [
            row["total"] for row in (check_rounds(run, sizes, "run") for run in job_runs) if row is not None
        ]
        for label, job_runs in runs.items()
    }
    for name in PIECES:
        cells = [
            f"{medians[label][name]:.2f} | {medians[label][name] / medians[label][WHOLE]:.1%}"
            for label in labels
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = []
    for label in labels:
        total = statistics.median(profiled[label]) if profiled[label] else float("nan")
        cells.append(f"{total:.2f} | {total / medians[label][WHOLE]:.1%}")
    lines.append("| profiled blocks + parts + update (the balancer's costs) | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each piece is timed by its own clock around the call (a piece with one more dot is inside the "
        "one above it); none is a remainder. The optimizer update runs from Lightning's "
        "on_before_optimizer_step to the optimizer's step post-hook.",
    ]
    return lines


def profile_job(name: str, sizes: Sizes) -> None:
    """cProfile one job in this process; the top functions by cumulative time go to stderr."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run_job(name, sizes)
    profiler.disable()
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(45)


def sizes_for(shape: str, quick: bool) -> Sizes:
    """The sizes of ``--shape`` (``--quick``: the smoke run's, whatever the shape).

    Raises:
        ValueError: if ``shape`` is not one of :data:`SHAPES`.
    """
    if shape not in SHAPES:
        raise ValueError(f"--shape={shape!r} is not one of {sorted(SHAPES)}; pass one of them")
    return QUICK if quick else SHAPES[shape]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (default: 4, or 3 with a d512 shape)"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 1 round; not figures")
    parser.add_argument(
        "--shape",
        default="small",
        help=f"the stage's shape, one of {sorted(SHAPES)} (default small; see the module's docstring)",
    )
    parser.add_argument(
        "--check-only",
        action="store_true",
        help="run only the profiled-against-measured check (not the per-action table)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the report's path (default: dated, in results/)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing dated report")
    parser.add_argument("--profile", choices=JOBS, default=None, help="cProfile one job and exit")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="the compiled run's torch.compile backend (the quick run uses 'eager'); 'none' skips that run",
    )
    parser.add_argument("--job", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = Sizes(**json.loads(args.sizes)) if args.sizes else sizes_for(args.shape, args.quick)
    if args.job is not None:
        report = run_job(args.job, sizes)
        assert args.job_out is not None, "--job needs --job-out"
        args.job_out.write_text(json.dumps(report))
        return
    if args.profile is not None:
        profile_job(args.profile, sizes)
        return
    from benchmarks._lib import harness
    from benchmarks._lib.common import results_path

    rounds = 1 if args.quick else (args.rounds or (4 if args.shape == "small" else 3))
    if args.rounds is not None and args.rounds < 1:
        raise ValueError(
            f"--rounds={args.rounds}: a comparison needs at least 1 round; pass --rounds 1 or more"
        )
    out = results_path("action_cost", args.out, args.force)
    started = time.perf_counter()
    backend = "eager" if args.quick else args.compile_backend
    checks = check_jobs(backend)
    jobs = [*checks.values()] if args.check_only else [*JOBS, *checks.values()]
    runs = measure(sizes, rounds, jobs, forked=args.quick)
    sections = [
        harness.header("The runtime's CPU cost per pipeline action", "action_cost", argv, [harness.REAL]),
        f"Stage ({'quick' if args.quick else args.shape}): one stage holding the whole GPT ({sizes.layers} "
        f"dense blocks, width {sizes.width}, {sizes.heads} heads, {sizes.tokens} tokens, {sizes.rows} rows a "
        f"micro-batch, float32), {sizes.microbatches} micro-batches a step under 1F1B "
        f"({2 * sizes.microbatches} actions), one process and one torch thread per job; {rounds} interleaved "
        f"round(s) of {sizes.steps} steps, medians of steps {sizes.skip}+.",
    ]
    if not args.check_only:
        lines, ratios = table(runs, sizes)
        sections += [
            "\n".join(lines),
            f"DynMo idle / bare, CPU per action: **{ratios['dynmo_idle']:.3f}** (median of the rounds' "
            "ratios).",
        ]
    sections.append(
        "Losses (first and last step of round 1): "
        + "; ".join(f"{n}: {runs[n][0]['losses'][0]:.6f} .. {runs[n][0]['losses'][-1]:.6f}" for n in runs)
    )
    checked = {label: runs[job] for label, job in checks.items()}
    lines, _ = profiled_vs_measured(checked, sizes)
    sections += ["\n".join(lines), "\n".join(breakdown(checked, sizes))]
    harness.finish("action_cost", out, sections, started)


if __name__ == "__main__":
    main()
