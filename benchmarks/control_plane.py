"""What the control plane of DynMo costs per step and per decision, against the number of ranks.

For each rank count ``P`` (``--ranks``, default 2 4 8 16) one gloo job of ``P`` CPU processes builds the
rank grid of ``--pipeline-size`` stages times ``P / pipeline-size`` data-parallel replicas (tiny layers:
the model is never run) and times, on every rank, the real code of :class:`~lightning_dynmo.DynMoCallback`
and the strategy's per-step control, per call: ``--repeats`` calls back to back per round, the median
over ``--rounds`` rounds (each after a barrier) of the slowest rank:

- **step, no event**: the strategy's per-step control (its error context, built lazily, and the SIGTERM
  agreement) plus the callback's per-step exchange (``_share_step``: 5 numbers per rank, the SIGTERM flag
  among them, so that the next batch start's agreement needs no collective of its own, gathered on the
  first rank and broadcast back); beside it the same exchange through gloo's ring all-gather (before
  2026-11-27);
- **step, with event**: the same with a dynamism event published on every rank (the exchange adds one
  all-gather of the events); beside it the pre-issue-13 exchange (one ``broadcast_object_list`` per rank);
- **decision**: the profile gather (one all-reduce of the layer table over the pipeline), the decision on
  the first rank and its broadcast (``_decide_once``), no migration;
- **migration**: every replica moves one 16x16 linear layer from pipeline position 0 to 1 (back on the
  next call) with :func:`~lightning_dynmo.pipeline.migrate_units`: all replicas in one plan,
  and, beside it, one call per replica as the strategy did before issue #13.

A second table counts the ``torch.distributed`` calls each of these makes (machine-independent). Each
timing is fitted with ``a + b*log2(P)`` and ``a + b*P``; the better fit (smaller RMS residual) is
projected to 720 ranks. On a shared 2-core machine, 16 processes share 2 cores: the timings include
scheduling delays and grow with ``P`` for that reason too; the call counts are exact.

    python -m benchmarks.control_plane              # 2, 4, 8, 16 ranks
    python -m benchmarks.control_plane --quick      # 2 and 4 ranks, few repeats
"""

from __future__ import annotations

import argparse
import functools
import math
import multiprocessing as mp
import pickle
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks._lib import harness
from benchmarks._lib.common import results_path, write_report
from lightning_dynmo.balancing.costs import LayerCost
from lightning_dynmo.balancing.hardware import Hardware
from lightning_dynmo.balancing.placement import Placement
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig, dynmo_callback
from lightning_dynmo.events import DynamismEvent, EventBus
from lightning_dynmo.pipeline.faults.guard import CommContext, communication_guard, describe_peers
from lightning_dynmo.pipeline.faults.shutdown import SigtermAgreement
from lightning_dynmo.pipeline.migration.transport import UnitMove, migrate_units
from lightning_dynmo.pipeline.placement.groups import build_groups
from lightning_dynmo.pipeline.placement.layout import RankGrid
from lightning_dynmo.pipeline.step.schedule import resolve_schedule
from lightning_dynmo.profiling import gather_layer_costs
from lightning_dynmo.strategy.view import PipelineView

PROJECT_TO = 720
LAYERS_PER_STAGE = 4
_COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "send",
    "recv",
    "batch_isend_irecv",  # isend / irecv are not wrapped: P2POp checks their identity
)
_CASES = (
    "step",
    "ring_step",
    "event_step",
    "ring_event_step",
    "legacy_event_step",
    "decision",
    "migration",
    "legacy_migration",
)


@dataclass(frozen=True)
class Spec:
    pipeline_size: int
    repeats: int
    rounds: int


# -- on every rank -------------------------------------------------------------------------------------


@contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Count the outermost ``torch.distributed`` calls made inside the block."""
    counts: Counter[str] = Counter()
    depth = [0]
    originals = {name: getattr(dist, name) for name in _COUNTED}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class _Harness:
    """A stand-in for the Trainer and DynMoStrategy around the real callback and control-plane code."""

    def __init__(self, spec: Spec) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        pp = min(spec.pipeline_size, world)
        self.grid = RankGrid(world_size=world, pipeline_size=pp)
        groups = build_groups(self.grid, rank, timedelta(seconds=600), world_has_timeout=False)
        self.position = self.grid.pipeline_rank(rank)
        self.num_layers = LAYERS_PER_STAGE * pp
        self.placement = Placement.from_string(
            "|".join(f"{s * LAYERS_PER_STAGE}-{(s + 1) * LAYERS_PER_STAGE - 1}" for s in range(pp))
        )
        self.bus = EventBus()
        self.callback = DynMoCallback(
            balancer="partition", event_bus=self.bus, profiling=ProfilingConfig(measure_comm=False)
        )
        self.callback._unsubscribe = self.bus.subscribe(self.callback._inbox.add)
        self.sigterm = SigtermAgreement(forward=None)
        active = tuple(range(world))
        view = PipelineView(
            placement=self.placement,
            schedule=resolve_schedule("1F1B"),
            num_microbatches=2 * pp,
            pipeline_size=pp,
            stage_index=self.position,
            stage_indices=(self.position,),
            is_first_stage=self.position == 0,
            is_released=False,
            global_rank=rank,
            active_ranks=active,
            pipeline_rank_of=self.grid.pipeline_rank,
            local_layers={},
            pipeline_stages=[],
            root_device=torch.device("cpu"),
            pipeline_group=groups.pipeline,
            active_group=groups.active,
            control_group=groups.control,
            data_parallel_group=None,
            data_parallel_size=world // pp,
            has_tied_parameters=False,
            sigterm=self.sigterm,
        )
        self.view = view
        strategy = SimpleNamespace(
            root_device=view.root_device,
            global_rank=rank,
            active_ranks=active,
            active_group=groups.active,
            pipeline_group=groups.pipeline,
            stage_indices=view.stage_indices,
            pipeline_view=lambda: view,
        )
        strategy.guard = lambda what, control=False: communication_guard(what, self.comm_context())
        strategy.broadcast = self.broadcast
        self.strategy = strategy
        self.trainer = SimpleNamespace(strategy=strategy, global_step=0, global_rank=rank, loggers=[])
        self.units: dict[str, nn.Module] = {
            f"layers.{i}": nn.Linear(16, 16) for i in self.placement.layers_of(self.position)
        }
        self.moved = False  # whether the moving layer is on position 1 now

    def comm_context(self) -> CommContext:
        # As DynMoStrategy._comm_context: peers are described only if a guarded step fails.
        s = self.strategy
        peers = partial(describe_peers, s.global_rank, s.active_ranks, self.grid, self.placement, "loop")
        return CommContext(s.global_rank, s.stage_indices, peers, timedelta(seconds=600), None, dict)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        # As DynMoStrategy.broadcast.
        box = [obj]
        with communication_guard(f"strategy.broadcast(src={src})", self.comm_context()):
            dist.broadcast_object_list(box, src=src, group=self.strategy.active_group)
        return box[0]

    def step(self) -> None:
        """The strategy's per-step control and the callback's per-step exchange."""
        with communication_guard("the SIGTERM check at a batch start", self.comm_context()):
            self.sigterm.agree(self.strategy.active_group, self.strategy.root_device)
        with communication_guard("a schedule step", self.comm_context()):
            pass  # the schedule step itself is training, not control
        self.callback._share_step(self.trainer, self.view, 1e-3 * (1 + self.position), 5e-3)  # type: ignore[arg-type]
        self.trainer.global_step += 1

    def ring_step(self) -> None:
        """:meth:`step` with the rows exchanged by ``dist.all_gather`` (gloo's ring), as before 2026-11-27."""
        with _ring_exchanges():
            self.step()

    def event_step(self) -> None:
        first = self.position * LAYERS_PER_STAGE
        self.bus.publish(DynamismEvent("pruned", (first,), self.trainer.global_step, "benchmark"))
        self.step()

    def ring_event_step(self) -> None:
        """:meth:`event_step` with the exchanges before 2026-11-27 (two rings and an object all-gather)."""
        with _ring_exchanges():
            self.event_step()

    def legacy_event_step(self) -> None:
        """The exchange before issue #13: one broadcast_object_list per active rank."""
        mine = [DynamismEvent("pruned", (self.position,), self.trainer.global_step).to_dict()]
        with communication_guard("the SIGTERM check at a batch start", self.comm_context()):
            self.sigterm.agree(self.strategy.active_group, self.strategy.root_device)
        row = torch.tensor([1.0, 1e-3, 5e-3, 0.0], dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in self.strategy.active_ranks]
        dist.all_gather(rows, row, group=self.strategy.active_group)
        for source in self.strategy.active_ranks:
            self.broadcast(mine if source == self.strategy.global_rank else None, src=source)
        self.trainer.global_step += 1

    def decision(self) -> None:
        """Profile gather + decide on the first rank + broadcast (no migration)."""
        local = {
            i: LayerCost(
                fwd_time_s=1e-3 * (1 + i % 3),
                bwd_time_s=2e-3 * (1 + i % 3),
                num_params=1000,
                memory_bytes=8000,
                activation_bytes=4096,
            )
            for i in self.placement.layers_of(self.position)
        }
        costs = gather_layer_costs(local, self.num_layers, self.strategy.pipeline_group)
        hardware = Hardware()
        self.callback._decide_once(self.trainer, self.view, costs, hardware, None)  # type: ignore[arg-type]

    def migration(self) -> None:
        """Every replica moves one layer between its positions 0 and 1 (and back the next call): one plan."""
        self._migrate(one_plan=True)

    def legacy_migration(self) -> None:
        """The same moves, one replica after another (the strategy before issue #13)."""
        self._migrate(one_plan=False)

    def _migrate(self, one_plan: bool) -> None:
        if self.grid.pipeline_size < 2:
            return
        name = f"layers.{LAYERS_PER_STAGE - 1}"
        src, dst = (1, 0) if self.moved else (0, 1)
        moves = [
            UnitMove(name, self.grid.pipeline_ranks(r)[src], self.grid.pipeline_ranks(r)[dst])
            for r in range(self.grid.data_parallel_size)
        ]
        plans = [moves] if one_plan else [[m] for m in moves]
        for plan in plans:
            received, _ = migrate_units(
                plan, self.units, [], device=torch.device("cpu"), group=self.strategy.active_group
            )
            for move in plan:
                if move.src == self.strategy.global_rank:
                    del self.units[move.unit]
            self.units.update(received)
        self.moved = not self.moved


@contextmanager
def _ring_exchanges() -> Iterator[None]:
    """Inside the block, the callback's exchanges as before 2026-11-27: its per-step rows by one
    ``dist.all_gather`` and its events by one ``all_gather_object`` (each a ring on gloo)."""

    def ring(row: torch.Tensor, active_ranks: Sequence[int], group: Any) -> torch.Tensor:
        rows = [torch.empty_like(row) for _ in active_ranks]
        dist.all_gather(rows, row, group=group)
        return torch.stack(rows)

    def events_by_object(
        payload: bytes, sizes: Sequence[int], active_ranks: Sequence[int], group: Any, device: Any = None
    ) -> list[dict[str, Any]]:
        parts: list[Any] = [None] * len(active_ranks)
        dist.all_gather_object(parts, pickle.loads(payload) if payload else [], group=group)
        return [dict(e) for part in parts for e in part]

    real = dynmo_callback.exchange_rows, dynmo_callback.exchange_events
    dynmo_callback.exchange_rows = ring  # type: ignore[assignment]
    dynmo_callback.exchange_events = events_by_object  # type: ignore[assignment]
    try:
        yield
    finally:
        dynmo_callback.exchange_rows, dynmo_callback.exchange_events = real


def _rank_job(rank: int, world_size: int, store_file: str, spec: Spec, out: Any) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_file, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=600)
    )
    try:
        harness = _Harness(spec)
        cases: dict[str, Callable[[], None]] = {
            "step": harness.step,
            "ring_step": harness.ring_step,
            "event_step": harness.event_step,
            "ring_event_step": harness.ring_event_step,
            "legacy_event_step": harness.legacy_event_step,
            "decision": harness.decision,
            "migration": harness.migration,
            "legacy_migration": harness.legacy_migration,
        }
        counts: dict[str, dict[str, int]] = {}
        medians: dict[str, float] = {}
        cpu_medians: dict[str, float] = {}
        for name, fn in cases.items():
            fn()  # warm-up (first-use allocations, the digest of the first decision)
            with count_collectives() as counted:
                fn()
            counts[name] = dict(counted)
            samples, cpu_samples = [], []
            for _ in range(spec.rounds):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                for _ in range(spec.repeats):
                    fn()
                samples.append((time.perf_counter() - start) / spec.repeats)
                cpu_samples.append((time.process_time() - cpu_start) / spec.repeats)
            medians[name] = statistics.median(samples)
            cpu_medians[name] = statistics.median(cpu_samples)
        # The slowest rank's median: the control plane holds every rank until the last one is through.
        table = torch.tensor([[medians[c], cpu_medians[c]] for c in _CASES], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        if rank == 0:
            out.put(
                {
                    "counts": counts,
                    "seconds": dict(zip(_CASES, table[:, 0].tolist(), strict=True)),
                    "cpu_seconds": dict(zip(_CASES, table[:, 1].tolist(), strict=True)),
                    "pipeline_size": harness.grid.pipeline_size,
                    "replicas": harness.grid.data_parallel_size,
                }
            )
    finally:
        dist.destroy_process_group()


def _first_result(out: Any, procs: list[Any], timeout_s: float) -> dict[str, Any]:
    """Rank 0's result; a rank that dies first fails the job at once instead of after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            result: dict[str, Any] = out.get(timeout=1.0)
            return result
        except queue.Empty:
            dead = [r for r, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"ranks {dead} died before reporting; see their output above.") from None
    raise TimeoutError(f"no result within {timeout_s:g} s")


def run_ranks(spec: Spec, world_size: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Run :func:`_rank_job` on ``world_size`` forked ranks (modules already imported: a fast start)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_file = str(Path(tmp) / "store")
        procs = [
            ctx.Process(target=_rank_job, args=(r, world_size, store_file, spec, out))
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            result = _first_result(out, procs, timeout_s)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
        failed = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
        if failed:
            raise RuntimeError(f"ranks {failed} of the {world_size}-rank job failed; see their output above.")
    return result


# -- fits and report -------------------------------------------------------------------------------------


def fit(ranks: Sequence[int], values: Sequence[float]) -> tuple[str, float, float, float]:
    """The better of ``a + b*log2(P)`` and ``a + b*P`` by RMS residual: ``(model, a, b, rms)``."""
    best: tuple[str, float, float, float] | None = None
    for model, basis in (("log2(P)", math.log2), ("P", float)):
        xs = [basis(p) for p in ranks]
        mx, my = statistics.fmean(xs), statistics.fmean(values)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, values, strict=True)) / sxx if sxx else 0.0
        a = my - b * mx
        rms = math.sqrt(statistics.fmean((a + b * x - y) ** 2 for x, y in zip(xs, values, strict=True)))
        if best is None or rms < best[3]:
            best = (model, a, b, rms)
    assert best is not None
    return best


def project(model: str, a: float, b: float, ranks: int) -> float:
    return a + b * (math.log2(ranks) if model == "log2(P)" else ranks)


def _count_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}" for name, n in sorted(counts.items())) or "none"


def _timing_rows(
    results: dict[int, dict[str, Any]], ranks: list[int], key: str, labels: dict[str, str]
) -> list[str]:
    rows = []
    for case in _CASES:
        ms = [1e3 * results[p][key][case] for p in ranks]
        if len(ranks) >= 2:
            model, a, b, rms = fit(ranks, ms)
            fitted = f"{a:.3g} + {b:.3g}*{model}"
            at = f"{project(model, a, b, PROJECT_TO):.3g} ms"
            if b <= 0:  # a falling fit would project below zero: no growth was measured
                at = f"no growth measured (<= {max(ms):.3g} ms)"
            residual = f"{rms:.3g} ms"
        else:
            fitted, residual, at = "-", "-", "-"
        row = " | ".join(f"{v:.3f}" for v in ms)
        rows.append(f"| {labels[case]} | {row} | {fitted} | {residual} | {at} |")
    return rows


def report(results: dict[int, dict[str, Any]], argv: Sequence[str] | None, load: str) -> str:
    ranks = sorted(results)
    title = "Control-plane cost against the number of ranks"
    lines = [
        harness.header(title, "control_plane", argv, [harness.REAL]),
        "",
        f"Machine load before the run (`uptime`): `{load}`. gloo on CPU, one process per rank, one torch",
        "thread each, on a shared 2-core machine: up to 16 processes share 2 cores, so the timings include",
        "scheduling delays that grow with the number of ranks. Each figure is the time per call of the",
        "slowest rank: calls back to back in rounds, each round after a barrier, the median over rounds.",
        "The call counts below are exact and machine-independent.",
        "",
        "Grid per run: "
        + ", ".join(f"P={p}: {results[p]['pipeline_size']}x{results[p]['replicas']} (PP x DP)" for p in ranks)
        + f"; {LAYERS_PER_STAGE} tiny layers per stage (never run).",
        "",
        "## Wall milliseconds per step / per decision",
        "",
        "| case | " + " | ".join(f"P={p}" for p in ranks) + " | best fit | RMS residual | at 720 ranks |",
        "|---|" + "---|" * (len(ranks) + 3),
    ]
    labels = {
        "step": "step, no event",
        "ring_step": "step, no event, ring all-gather (before 2026-11-27)",
        "event_step": "step, with event",
        "ring_event_step": "step, with event, ring all-gathers (before 2026-11-27)",
        "legacy_event_step": "step, with event, pre-#13 exchange",
        "decision": "decision (gather + decide + broadcast)",
        "migration": "migration, 1 layer per replica, one plan",
        "legacy_migration": "migration, 1 layer per replica, pre-#13 loop over replicas (today's agreements)",
    }
    lines += _timing_rows(results, ranks, "seconds", labels)
    lines += [
        "",
        "## CPU milliseconds per call (the slowest rank's process time: its own work, not its waits)",
        "",
        "Oversubscribed cores make every collective wait for all P processes to be scheduled, which the",
        "wall times above include; the process time counts what a rank itself computes (Python, pickling,",
        "gloo's own work), the part a loop over ranks would make grow.",
        "",
        "| case | " + " | ".join(f"P={p}" for p in ranks) + " | best fit | RMS residual | at 720 ranks |",
        "|---|" + "---|" * (len(ranks) + 3),
    ]
    lines += _timing_rows(results, ranks, "cpu_seconds", labels)
    lines += [
        "",
        "## torch.distributed calls (outermost, on global rank 0) per step / per decision",
        "",
        "| case | " + " | ".join(f"P={p}" for p in ranks) + " |",
        "|---|" + "---|" * len(ranks),
    ]
    for case in _CASES:
        row = " | ".join(_count_text(results[p]["counts"][case]) for p in ranks)
        lines.append(f"| {labels[case]} | {row} |")
    lines += [
        "",
        "With issue #13's control plane every row but the pre-#13 ones makes the same calls at every P; the",
        "pre-#13 event exchange makes one `broadcast_object_list` per rank (720 at 720 ranks, each a size",
        "broadcast and a payload broadcast). The projection extrapolates the fit far outside the measured",
        "range and inherits its noise: read it as an order of magnitude.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--pipeline-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10, help="calls timed back to back per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (after a barrier); the median is kept")
    parser.add_argument("--quick", action="store_true", help="2 and 4 ranks, 3 rounds of 3 calls")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--force", action="store_true", help="overwrite an existing report")
    args = parser.parse_args(argv)
    out = results_path("control-plane", args.out, args.force)
    if args.quick:
        args.ranks, args.repeats, args.rounds = [2, 4], min(args.repeats, 3), min(args.rounds, 3)
    bad = [p for p in args.ranks if p < 1 or p % min(args.pipeline_size, p)]
    if bad:
        raise ValueError(
            f"--ranks {bad}: every rank count must be a multiple of --pipeline-size={args.pipeline_size} "
            "(or smaller than it); pick counts such as 2 4 8 16."
        )
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    results = {}
    for ranks in args.ranks:
        began = time.perf_counter()
        results[ranks] = run_ranks(Spec(args.pipeline_size, args.repeats, args.rounds), ranks)
        print(f"{ranks} ranks done in {time.perf_counter() - began:.1f} s", file=sys.stderr)
    return write_report(report(results, argv, load), "control-plane", out)


if __name__ == "__main__":
    main()
