"""The runtime's CPU cost per pipeline action: torch's bare schedule against DynMo on the same stage.

One stage holding a whole small GPT (embedding, ``--layers`` dense blocks, head and loss: the
calibration's sizes, width 128, 64 tokens, 2 rows a micro-batch), ``--microbatches`` micro-batches a
step under 1F1B, one process, one torch thread, world size 1 (gloo). Each job is its own process;
jobs run in rotated interleaved rounds (:func:`benchmarks._lib.harness.rotated`):

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

Then, once, the profiler's account of the step against the measured step of the same run: the blocks'
profiled costs plus the parts' (embedding; head and loss), from the callback's last decision, against the
median wall time of the timed section, for the last round's ``dynmo window`` run and for a run whose blocks
are compiled (``DynMoStrategy(compile_blocks={"backend": --compile-backend})``, inductor by default,
windows every ``skip`` steps so that none measures the compiling first steps).

Real compute.

    python -m benchmarks.action_cost                # 4 rounds, ~5 minutes on 2 busy cores
    python -m benchmarks.action_cost --quick        # a smoke run (1 round, few steps): not figures
    python -m benchmarks.action_cost --profile dynmo_idle   # cProfile of one job's timed steps, to stderr
"""

from __future__ import annotations

import argparse
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


QUICK = Sizes(layers=2, width=32, heads=2, tokens=16, rows=2, microbatches=2, steps=6, skip=2)


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


def run_dynmo(sizes: Sizes, window: bool, compile_backend: str | None = None) -> dict[str, Any]:
    """One DynMo job (callback idle, or every step in a profiling window; blocks compiled with
    ``compile_backend`` when given); per-step CPU and wall seconds, and with a window the profiled costs."""
    import lightning.pytorch as pl
    import torch

    from lightning_dynmo import DynMoCallback, DynMoStrategy
    from lightning_dynmo.models import GPT, OptimizerConfig

    torch.manual_seed(0)
    model = GPT(_config(sizes), OptimizerConfig(lr=1e-3, weight_decay=0.0, warmup_steps=0))
    if compile_backend is not None:  # windows from step `skip` on: none measures the first (compiling) steps
        callback = DynMoCallback(every_n_steps=sizes.skip, min_gain=0.5)
    elif window:
        callback = DynMoCallback(every_step=True, skip_balanced=False, min_gain=0.5)
    else:
        callback = DynMoCallback(every_n_steps=10_000)
    compiled = {"backend": compile_backend} if compile_backend is not None else False
    strategy = DynMoStrategy(num_microbatches=sizes.microbatches, schedule="1F1B", compile_blocks=compiled)
    timer = _CpuTimer()
    losses_seen: list[float] = []
    schedule_s: list[float] = []  # per step: the wall time of the schedule step alone (every action)
    from lightning_dynmo.strategy import steps as strategy_steps

    run_schedule_step = strategy_steps.run_schedule_step

    def timed_schedule_step(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return run_schedule_step(*args, **kwargs)
        finally:
            schedule_s.append(time.perf_counter() - start)

    strategy_steps.run_schedule_step = timed_schedule_step  # measurement only, in this job's process

    class Wrap(pl.Callback):
        """First in the list: wraps what DynMo runs for a step once the Trainer has set it up."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for obj, names in (
                (strategy, ("training_step", "backward", "on_train_batch_start")),
                (callback, ("on_train_batch_start", "on_train_batch_end")),
            ):
                for name in names:
                    setattr(obj, name, timer.wrap(getattr(obj, name)))

    class Close(pl.Callback):
        """Last in the list: a step ends after every other callback's batch-end hook."""

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
        ) -> None:
            timer.close_step()
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
        "losses": losses_seen,
    }
    hardware = callback.last_hardware
    if window and callback.last_costs is not None and hardware is not None:
        parts = [c for c in (hardware.first_stage_extra, hardware.last_stage_extra) if c is not None]
        report["profiled_s"] = {
            "blocks": sum(c.fwd_time_s + c.bwd_time_s for c in callback.last_costs),
            "parts": sum(c.fwd_time_s + c.bwd_time_s for c in parts),
            "per_op": 2 * sizes.microbatches * float(hardware.per_op_s or 0.0),
        }
    return report


def run_job(name: str, sizes: Sizes) -> dict[str, Any]:
    """Run job ``name`` in this process."""
    import torch

    torch.set_num_threads(1)
    if name == "bare":
        return run_bare(sizes)
    if name in ("dynmo_idle", "dynmo_window"):
        return run_dynmo(sizes, window=name == "dynmo_window")
    if name.startswith("dynmo_compiled:"):  # "dynmo_compiled:<backend>": windows on compiled blocks
        return run_dynmo(sizes, window=True, compile_backend=name.partition(":")[2])
    raise ValueError(f"job={name!r} is not one of {list(JOBS)}")


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


def measure(sizes: Sizes, rounds: int, jobs: Sequence[str] = JOBS) -> dict[str, list[dict[str, Any]]]:
    """Every job once per round, in rotated order; the reports per job."""
    from benchmarks._lib.harness import rotated

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for r in range(rounds):
        for name in rotated(list(jobs), r):
            print(f"[action_cost] round {r + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            runs[name].append(launch_job(name, sizes))
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
    for name, job_runs in runs.items():
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


def profiled_vs_measured(runs: dict[str, dict[str, Any]], sizes: Sizes) -> list[str]:
    """The profiler's account of a step (blocks + parts + the runtime's per-action cost) against the
    measured step (the median wall time of the timed section, steps ``skip``+) of the same run."""
    lines = [
        "### The profiler's costs against the measured step of the same run",
        "",
        "| run | blocks (ms) | parts (ms) | blocks + parts (ms) | schedule step (ms) | (blocks + parts) / "
        "schedule step | whole timed step (ms) | (blocks + parts) / whole |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, run in runs.items():
        costs = run.get("profiled_s")
        if costs is None:
            lines.append(f"| {name} | no decision recorded | | | | | | |")
            continue
        total = costs["blocks"] + costs["parts"]
        schedule = statistics.median(run["schedule_s"][sizes.skip :])
        whole = statistics.median(run["wall_s"][sizes.skip :])
        lines.append(
            f"| {name} | {1e3 * costs['blocks']:.2f} | {1e3 * costs['parts']:.2f} | {1e3 * total:.2f} "
            f"| {1e3 * schedule:.2f} | {total / schedule:.3f} | {1e3 * whole:.2f} | {total / whole:.3f} |"
        )
    lines += [
        "",
        "Blocks and parts: the costs of the callback's last decision (per step: each unit's median call "
        "times its calls, median over the window's steps, smoothed over windows). Schedule step: the wall "
        "time of the strategy's schedule step (every forward and backward action of the step), median over "
        "steps; whole timed step: the timed section of the per-action table (the schedule step plus the "
        "strategy's and the callback's bookkeeping, the loss logging, the carried gradients' backward, and "
        "at a window's end the decision), median over steps.",
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny model, 1 round; not figures")
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
    sizes = Sizes(**json.loads(args.sizes)) if args.sizes else (QUICK if args.quick else Sizes())
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

    rounds = 1 if args.quick else args.rounds
    if rounds < 1:
        raise ValueError(f"--rounds={rounds}: a comparison needs at least 1 round; pass --rounds 1 or more")
    out = results_path("action_cost", args.out, args.force)
    started = time.perf_counter()
    runs = measure(sizes, rounds)
    lines, ratios = table(runs, sizes)
    sections = [
        harness.header("The runtime's CPU cost per pipeline action", "action_cost", argv, [harness.REAL]),
        f"Stage: one stage holding the whole GPT ({sizes.layers} dense blocks, width {sizes.width}, "
        f"{sizes.tokens} tokens, {sizes.rows} rows a micro-batch), {sizes.microbatches} micro-batches a step "
        f"under 1F1B ({2 * sizes.microbatches} actions), one process and one torch thread per job; "
        f"{rounds} interleaved rounds of {sizes.steps} steps, medians of steps {sizes.skip}+.",
        "\n".join(lines),
        "Losses (first and last step of round 1): "
        + "; ".join(f"{n}: {runs[n][0]['losses'][0]:.6f} .. {runs[n][0]['losses'][-1]:.6f}" for n in runs),
        f"DynMo idle / bare, CPU per action: **{ratios['dynmo_idle']:.3f}** (median of the rounds' ratios).",
    ]
    backend = "eager" if args.quick else args.compile_backend
    checked = {"uncompiled, every step a window (the last round's dynmo_window)": runs["dynmo_window"][-1]}
    if backend != "none":
        print(
            f"[action_cost] compiled blocks ({backend}), a window every {sizes.skip} steps", file=sys.stderr
        )
        checked[f"compiled (backend {backend!r}), a window every {sizes.skip} steps"] = launch_job(
            f"dynmo_compiled:{backend}", sizes, timeout_s=900
        )
    sections.append("\n".join(profiled_vs_measured(checked, sizes)))
    harness.finish("action_cost", out, sections, started)


if __name__ == "__main__":
    main()
