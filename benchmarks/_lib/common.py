"""Shared pieces of the benchmarks: launching a 2-process job and timing its steps."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from lightning_dynmo.data import StdlibCorpus, TextDataModule
from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.demos.cost import SLEEPS
from lightning_dynmo.strategy import DynMoStrategy

T = TypeVar("T")

RESULTS = Path(__file__).resolve().parents[1] / "results"


def command_line(script: str, argv: list[str] | None) -> str:
    """How ``python -m benchmarks.<script>`` was called: its arguments (``argv``, else the process's),
    for the report's ``Command:`` line."""
    args = argv if argv is not None else sys.argv[1:]
    return f"python -m benchmarks.{script}" + "".join(f" {a}" for a in args)


def write_report(report: str, name: str, out: Path | None = None) -> Path:
    """Print ``report`` and write it to ``out`` (default ``benchmarks/results/<name>-<date>.md``).

    Scripts choose ``out`` with :func:`results_path` before they measure, so an existing report is never
    overwritten by accident.
    """
    print(report)
    path = out or RESULTS / f"{name}-{dt.date.today().isoformat()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report + "\n")
    print(f"\nwritten to {path}", file=sys.stderr)
    return path


def results_path(name: str, out: Path | None, force: bool) -> Path:
    """Where a report goes: ``out``, else ``benchmarks/results/<name>-<date>.md``; never an existing file
    unless ``force`` (committed results stay as they are).

    Raises:
        FileExistsError: if that file exists (e.g. committed figures) and not ``force``.
    """
    path = out if out is not None else RESULTS / f"{name}-{dt.date.today().isoformat()}.md"
    if path.exists() and not force:
        raise FileExistsError(
            f"{path} exists; pass --out PATH to write elsewhere or --force to overwrite it."
        )
    return path


def run_forked(job: Callable[[], dict[str, Any]], name: str, timeout_s: float) -> dict[str, Any]:
    """Run ``job`` in a forked child of this process; the JSON-ready report it returned.

    For smoke runs on CPU (``--quick``, ``--dry-run``): the child starts with this process's torch and
    lightning already imported, which a fresh interpreter spends most of a tiny job on. It also starts
    with this process's state, so a run whose figures count launches every job in a fresh interpreter.
    The fork is the GPU check's (:func:`lightning_dynmo.gpu_check.runner.fork_call`).

    Raises:
        RuntimeError: if the job raised, died or ran past ``timeout_s`` (killed); its output's tail.
    """
    from lightning_dynmo.gpu_check.runner import fork_call

    with tempfile.TemporaryDirectory() as tmp:
        result, log = Path(tmp) / "report.json", Path(tmp) / "job.log"

        def call() -> int:
            result.write_text(json.dumps(job()))
            return 0

        status = fork_call(call, log, timeout_s)
        if status != 0:
            why = f"ran past {timeout_s:g} s (killed)" if status is None else f"failed (exit {status})"
            tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
            raise RuntimeError(f"{name} {why}:\n{tail}")
        report: dict[str, Any] = json.loads(result.read_text())
        return report


def launch(
    fn: Callable[[T], dict[str, Any]],
    spec: T,
    nproc: int = 2,
    start_method: str = "spawn",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run ``fn(spec)`` on ``nproc`` local ranks with torch's elastic launcher; return rank 0's result.

    This is what ``torchrun --standalone`` does, driven from Python so one script can run many jobs.
    With ``"spawn"`` ``fn`` must be importable (a module-level function); ``"fork"`` starts the ranks
    without importing torch and Lightning again (seconds per job on a small machine), which needs a parent
    that has not started torch's worker threads (call ``torch.set_num_threads(1)`` first). ``"forkserver"``
    forks them from a server process that imported torch, Lightning and ``fn``'s module once, with no
    other thread: use it for many ranks. A plain fork copies the launching process mid-work, and its
    elastic agent serves the job's store on a thread that looks peers up in glibc's resolver while the
    agent forks; a rank forked while that thread holds the resolver's lock deadlocks at its first
    lookup (seen at 16 ranks: ranks stuck in ``getaddrinfo`` or ``getnameinfo`` under the store's
    connect, in about one job of ten).

    With no more ranks than usable CPU cores each rank is pinned to its own core (local rank ``r`` to the
    ``r``-th core), so the OS does not move a rank mid-step. One split's step time still moves from job to
    job on the 2-core VM (15-28% between rounds in ``benchmarks/results/e2e-2026-11-23.md``): compare
    placements over interleaved rounds. Jobs with more ranks than cores (emulated costs) are not pinned.

    With ``timeout_s`` (from the main thread only), a job still running after that many seconds is
    stopped (its ranks terminated by the launcher) and run once more, said on stderr; a second overrun
    raises :class:`TimeoutError`. A job that hangs (a rank stuck in its launch, say) then costs minutes,
    not the process group's 30-minute timeout and the whole benchmark.
    """
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "lightning.pytorch", fn.__module__])
    fn = _RankEntry(fn, pin=nproc <= len(os.sched_getaffinity(0)))  # the cores this process may use
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"dynmo-bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
    )
    if timeout_s is None:
        return elastic_launch(config, fn)(spec)[0]
    try:
        return _within(elastic_launch(config, fn), spec, timeout_s)
    except TimeoutError:
        print(f"a {nproc}-rank job ran past {timeout_s:g} s: stopped, running it again", file=sys.stderr)
    again = dataclasses.replace(config, run_id=f"dynmo-bench-{uuid.uuid4().hex[:8]}")
    return _within(elastic_launch(again, fn), spec, timeout_s)


def _within(run: Callable[[T], dict[int, Any]], spec: T, timeout_s: float) -> dict[str, Any]:
    """Rank 0's result of ``run(spec)``, stopped by a SIGTERM to this process after ``timeout_s`` (the
    elastic agent then terminates its ranks and raises); raises :class:`TimeoutError` when that happened."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("launch(timeout_s=...) must be called from the main thread (it uses a signal).")
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        os.kill(os.getpid(), signal.SIGTERM)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        result: dict[str, Any] = run(spec)[0]
        return result
    except SignalException as err:
        if expired.is_set():
            raise TimeoutError(f"the job ran past {timeout_s:g} s; its ranks were stopped") from err
        raise
    finally:
        timer.cancel()


class _RankEntry:
    """``fn`` as one rank runs it (picklable: the ranks may be spawned).

    The job's store is on this machine, so the rank reaches it at ``127.0.0.1`` rather than by name: a
    forked rank that looks ``localhost`` up can deadlock in glibc's resolver, whose lock another thread of
    the launching process (the elastic agent's) may hold at the fork. Seen on 16 ranks: one rank stuck in
    ``getaddrinfo`` under the store's connect, every other rank waiting for it. With ``pin``, the rank also
    runs on the core of its local rank.
    """

    def __init__(self, fn: Callable[[T], dict[str, Any]], pin: bool) -> None:
        self.fn, self.pin = fn, pin
        # The launcher names the job and its processes by these.
        self.__name__ = getattr(fn, "__name__", type(self).__name__)
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, spec: T) -> dict[str, Any]:
        if os.environ.get("MASTER_ADDR") == "localhost":
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        if self.pin:
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]})
        return self.fn(spec)


def fit_demo_gpt(
    strategy: DynMoStrategy, callbacks: list[pl.Callback], steps: int, sleep_ms: Sequence[float]
) -> pl.Trainer:
    """Fit a :class:`DemoGPT` with emulated block costs on 2 CPU ranks for ``steps`` steps (batches of 8)."""
    trainer = benchmark_trainer(strategy, callbacks, steps)
    model = DemoGPT(num_layers=len(sleep_ms), sleep_ms=list(sleep_ms))
    trainer.fit(model, RandomTokenDataModule(batch_size=8, num_samples=8 * steps))
    return trainer


def benchmark_trainer(
    strategy: DynMoStrategy, callbacks: list[pl.Callback], steps: int, devices: int = 2
) -> pl.Trainer:
    """The Trainer the pipeline benchmarks share: ``devices`` CPU ranks, ``steps`` steps, only training.

    No validation, logger, checkpoints, progress bar or distributed sampler (every rank reads the same
    batches).
    """
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )


def corpus_data(seq_len: int, batch_size: int, cache_dir: str, max_bytes: int = 2**20) -> TextDataModule:
    """The offline standard-library corpus (its first ``max_bytes``) as token rows cached in ``cache_dir``."""
    corpus = StdlibCorpus(max_bytes=max_bytes)
    return TextDataModule(corpus=corpus, seq_len=seq_len, batch_size=batch_size, cache_dir=cache_dir)


class StepTimer(pl.Callback):
    """Wall time of every training step, from one batch start to the next (the last: to train end)."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self._t0: float | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        now = time.perf_counter()
        if self._t0 is not None:
            self.step_s.append(now - self._t0)
        self._t0 = now

    def on_train_end(self, *args: Any) -> None:
        if self._t0 is not None:
            self.step_s.append(time.perf_counter() - self._t0)


class CpuOfEveryRank(pl.Callback):
    """Every rank's CPU seconds per training step (its process, all threads: gloo's included), by global
    rank, gathered at the end of training (the group is still up).

    Emulated costs sleep, so a replay's ranks should leave the cores idle: the sum over ranks of their CPU
    seconds per step, over the step's wall time, says how many cores the emulation itself kept busy.
    """

    def __init__(self) -> None:
        self.cpu_s: list[list[float]] = []
        self._mine: list[float] = []
        self._t0: float | None = None

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        if self._t0 is not None:
            self._mine.append(time.process_time() - self._t0)

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._mine)
        self.cpu_s = [[float(s) for s in rank] for rank in gathered]


def cores_busy(cpu_s: Sequence[Sequence[float]], step_s: Sequence[float], skip: int = 0) -> float:
    """How many cores ``cpu_s`` (per rank, per step) kept busy over steps of ``step_s`` wall seconds: the
    sum over ranks of their mean CPU seconds per step, over the mean step, both from step ``skip`` on."""
    step_s = step_s[skip:]
    if not step_s or sum(step_s) <= 0 or not cpu_s or any(len(rank) <= skip for rank in cpu_s):
        raise ValueError(f"cores_busy needs timed steps and CPU records (got {step_s!r}, {cpu_s!r}).")
    wall = sum(step_s) / len(step_s)
    return sum(sum(rank[skip:]) / len(rank[skip:]) for rank in cpu_s) / wall


class SleepsOfEveryRank(pl.Callback):
    """At the end of training, every rank's emulated-sleep overshoot (slept over requested,
    :data:`lightning_dynmo.demos.cost.SLEEPS`), by global rank (the group is still up)."""

    def __init__(self) -> None:
        self.overshoot: list[float] = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, SLEEPS.overshoot)
        self.overshoot = [float(v) for v in gathered]
