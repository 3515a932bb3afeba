"""Benchmark: the whole DynMo overhead (profiling + decision + migration) as a share of training time.

Trains the demo GPT on 2 pipeline ranks (gloo, forked, 1 torch thread each) whose blocks have an
emulated cost (sleeps: meaningful on a 2-core machine), where blocks 0-3 become free at step
``--change-at`` (as if pruned), three ways: without DynMoCallback (baseline), with
``DynMoCallback(every_n_steps=100)``, and with ``DynMoCallback(every_step=True)``. Reports, per run, the
training wall time, the callback's own account of its overhead (profiler hook time + decision time
+ migration time, summed over every window) and that as a share of training time (targets: <= 2% with
``every_n_steps=100``, <= 10% rebalancing every step), plus the wall-time difference to the baseline
(which also contains the per-step exchange and the noise of the machine).

Usage::

    PYTHONPATH=. python benchmarks/callback_overhead.py [--steps 300] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dynmo.callback import DynMoCallback
from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.strategy import DynMoStrategy

NUM_LAYERS, BATCH, MICROBATCHES, SLEEP_MS = 8, 8, 4, 2.0
CONFIGS: dict[str, dict[str, Any] | None] = {
    "no DynMo (baseline)": None,
    "every_n_steps=100": {"every_n_steps": 100, "on_events": False},
    "every_step=True": {"every_step": True, "on_events": False},
}


class _Timing(pl.Callback):
    """Training wall time (first batch start to last batch end) and a cost change at a known step."""

    def __init__(self, change_at: int) -> None:
        self.change_at = change_at
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.start = time.perf_counter()
        if batch_idx == self.change_at:
            for index, layer in trainer.strategy.local_layers.items():
                if index < NUM_LAYERS // 2:
                    layer.cost.fwd_ms = layer.cost.bwd_ms = 0.0

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.end = time.perf_counter()


def _fit(rank: int, world: int, args: argparse.Namespace, config: dict[str, Any] | None) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    timing = _Timing(args.change_at)
    callbacks: list[pl.Callback] = [timing]
    dynmo = DynMoCallback(**config) if config is not None else None
    if dynmo is not None:
        callbacks.append(dynmo)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=DynMoStrategy(num_microbatches=MICROBATCHES, schedule="1F1B"),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    model = DemoGPT(num_layers=NUM_LAYERS, sleep_ms=[SLEEP_MS] * NUM_LAYERS)
    trainer.fit(model, RandomTokenDataModule(batch_size=BATCH, num_samples=BATCH * args.steps))
    return {
        "train_s": timing.end - timing.start,
        "overhead_s": dynmo.overhead_s if dynmo else 0.0,
        "windows": len(dynmo.rebalances) if dynmo else 0,
        "migrations": sum(r["applied"] for r in dynmo.rebalances) if dynmo else 0,
        "placement": str(trainer.strategy.placement),
        "gains": [
            (r["predicted_gain"], r["measured_gain"])
            for r in (dynmo.rebalances if dynmo else [])
            if r["applied"]
        ],
    }


def _entry(fn: Callable[..., Any], rank: int, world: int, store: str, queue: Any, *args: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
        )
        out = fn(rank, world, *args)
        dist.destroy_process_group()
        queue.put((rank, True, out))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def _run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, queue, *args)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
            if p.is_alive():
                p.kill()
                raise SystemExit("a rank did not finish within 900 s")
    results: dict[int, Any] = {}
    while not queue.empty():
        rank, ok, payload = queue.get()
        if not ok:
            raise SystemExit(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    return [results[r] for r in range(world)]


def report(args: argparse.Namespace, rows: dict[str, list[dict[str, Any]]]) -> str:
    base = max(r["train_s"] for r in rows["no DynMo (baseline)"])
    lines = [
        f"# DynMo overhead: profiling + decision + migration vs training ({dt.date.today().isoformat()})",
        "",
        f"Command: `PYTHONPATH=. python {' '.join(sys.argv)}`",
        "",
        f"Setup: demo GPT, {NUM_LAYERS} blocks with an emulated cost of {SLEEP_MS} ms forward / "
        f"{2 * SLEEP_MS} ms backward per micro-batch (sleeps), blocks 0-{NUM_LAYERS // 2 - 1} become free at "
        f"step {args.change_at}; 2 pipeline ranks (gloo, forked, 1 torch thread each), 1F1B, "
        f"{MICROBATCHES} micro-batches, batch {BATCH}, {args.steps} steps; default profiling windows "
        f"(1 warm-up + 3 steps; 0 + 1 with every_step). torch {torch.__version__}, CPU, "
        f"{os.cpu_count()} cores, load average before {args.load_before:.2f}, "
        f"after {os.getloadavg()[0]:.2f}.",
        "",
        "| run | training s | DynMo overhead s (its own account) | share | target | windows | migrations "
        "| final placement | predicted / measured gain per migration | wall-time difference to baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    targets = {"every_n_steps=100": "<= 2%", "every_step=True": "<= 10%", "no DynMo (baseline)": "-"}
    for name, results in rows.items():
        train = max(r["train_s"] for r in results)
        overhead = max(r["overhead_s"] for r in results)
        r0 = results[0]
        lines.append(
            f"| {name} | {train:.2f} | {overhead:.3f} | {overhead / train:.2%} | {targets[name]} | "
            f"{r0['windows']} | {r0['migrations']} | {r0['placement']} | {_gains(r0['gains'])} | "
            f"{(train - base) / base:+.1%} |"
        )
    lines += [
        "",
        "The overhead column is what DynMo spends on top of training: its profiler's hook time during each "
        "window, the time to gather costs, decide and broadcast, and migration time (the slowest rank's). "
        "Profiled steps are training steps, so they are not counted as overhead beyond their hooks. The "
        "wall-time difference also contains the faster steps after the rebalance (negative = faster than "
        "the static baseline), the per-step exchange of busy times and the machine's noise.",
        "",
    ]
    return "\n".join(lines)


def _gains(gains: list[tuple[float, float | None]]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:+.0%}"

    return ", ".join(f"{pct(p)} / {pct(m)}" for p, m in gains) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--change-at", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning_dynmo.callback").setLevel(logging.INFO)  # one line per rebalance
    args.load_before = os.getloadavg()[0]
    rows = {name: _run_ranks(_fit, 2, args, config) for name, config in CONFIGS.items()}
    text = report(args, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"callback-overhead-{dt.date.today().isoformat()}.md"
    path.write_text(text)
    print(text)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
