"""DynMo's step on one GPU against plain Lightning's, on the same model and batches, with and without compile.

A Llama-shaped ``HuggingFaceCausalLM`` (random init from a config: no download) at SmolLM2-135M's shape
(30 layers, width 576, vocabulary 49,152, tied head) and at TinyLlama-1.1B's (22 layers, width 2048,
vocabulary 32,000), batches of 16 x 1024 tokens in 4 micro-batches, bf16-mixed, ``--steps`` steps; each
mode its own process (a fresh interpreter; ``--dry-run`` forks them), modes in rotated interleaved rounds
(``--rounds``, 2 by default), every job reading the same seeded batches (``use_distributed_sampler=False``):

- ``plain``: ``Trainer(strategy="auto")`` and the adapter's own ``training_step`` with ``microbatches=4``;
- ``dynmo``: ``DynMoStrategy(num_microbatches=4)``, one stage, no callback;
- ``dynmo_cb``: the same with ``DynMoCallback(every_n_steps=10)`` (the only DynMo mode at the 1.1B shape);
- ``plain_compile`` / ``dynmo_compile`` (135M shape only): each block's ``forward`` compiled with
  ``torch.compile`` (inductor) the same way in both (DynMo's ``compile_blocks``, which plain Lightning
  gets by calling :func:`~lightning_dynmo.pipeline.model.compiled.compile_blocks` on the model's blocks);
  ``dynmo_compile`` runs with the callback.

A job's step time is the median over steps after ``--skip`` of the time between consecutive batch ends
(no per-step synchronise: the host runs ahead as it would in training); its device busy fraction is the
CUDA kernel time over the wall time of 3 more steps under ``torch.profiler``; its peak memory is
``torch.cuda.max_memory_allocated``. Ratios to ``plain`` (and ``dynmo_compile`` to ``plain_compile``)
are taken within each round; the report gives the median and every round.

    python -m benchmarks.gpu_overhead                 # on one GPU: 464 s for the 135M shape, 2 rounds (H200)
    python -m benchmarks.gpu_overhead --dry-run       # tiny, on CPU: the same code path, no figures

Real compute on the GPU; the dry run's numbers are not figures.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

MODES = ("plain", "dynmo", "dynmo_cb", "plain_compile", "dynmo_compile")
BASE = {
    "plain": "plain",
    "dynmo": "plain",
    "dynmo_cb": "plain",
    "plain_compile": "plain",
    "dynmo_compile": "plain_compile",
}


@dataclass(frozen=True)
class Shape:
    """A model shape and its run sizes."""

    name: str
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rows: int = 16
    tokens: int = 1024
    microbatches: int = 4
    steps: int = 30
    skip: int = 10
    profile_steps: int = 3
    precision: str = "bf16-mixed"
    compile_backend: str = "inductor"
    modes: tuple[str, ...] = MODES


# Sized so that the whole command stays near 6 minutes on one H200 (estimated: about 20 s a 135M job,
# 30 s a 1.1B job, the first inductor compile about a minute and later ones mostly from its cache).
SMOL_135M = Shape(
    "135M", layers=30, width=576, ffn=1536, heads=9, kv_heads=3, vocab=49_152, tied=True, steps=20, skip=5
)
TINYLLAMA_1B = Shape(
    "1.1B",
    layers=22,
    width=2048,
    ffn=5632,
    heads=32,
    kv_heads=4,
    vocab=32_000,
    tied=False,
    steps=15,
    skip=5,
    modes=("plain", "dynmo_cb"),  # the bound at this shape is with the callback on
)
DRY = Shape(
    "dry-run",
    layers=2,
    width=32,
    ffn=64,
    heads=2,
    kv_heads=1,
    vocab=128,
    tied=True,
    rows=4,
    tokens=16,
    microbatches=2,
    steps=4,
    skip=1,
    profile_steps=1,
    precision="32-true",
    compile_backend="eager",
)


def _model(shape: Shape) -> Any:
    from transformers import LlamaConfig

    from lightning_dynmo.models.huggingface import HuggingFaceCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.width,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max(2048, shape.tokens),
        tie_word_embeddings=shape.tied,
    )
    return HuggingFaceCausalLM(config, attn_implementation="sdpa", seed=0, microbatches=shape.microbatches)


def _batches(shape: Shape, count: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (count, shape.rows, shape.tokens), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def run_job(mode: str, shape: Shape, device: str) -> dict[str, Any]:
    """One job in this process: fit ``shape`` in ``mode``; step times, busy fraction, peak memory, losses."""
    from lightning_dynmo import DynMoCallback, DynMoStrategy
    from lightning_dynmo.pipeline.model.compiled import compile_blocks

    torch.manual_seed(0)
    cuda = device == "cuda"
    model = _model(shape)
    compiled = mode.endswith("_compile")
    options = {"backend": shape.compile_backend}
    callbacks: list[pl.Callback] = []
    strategy: Any = "auto"
    if mode.startswith("dynmo"):
        strategy = DynMoStrategy(
            num_microbatches=shape.microbatches, compile_blocks=options if compiled else False
        )
        if mode in ("dynmo_cb", "dynmo_compile"):
            callbacks.append(DynMoCallback(every_n_steps=10))
    elif compiled:
        compile_blocks(dict(model.layers.items()), options)
    timer = _StepEnds(shape.steps, shape.profile_steps, cuda)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision=shape.precision,  # type: ignore[arg-type]
        max_steps=shape.steps + shape.profile_steps,
        limit_val_batches=0,
        callbacks=[*callbacks, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    data = torch.utils.data.DataLoader(_batches(shape, shape.steps + shape.profile_steps), batch_size=None)
    trainer.fit(model, data)
    return {
        "step_s": timer.step_s,
        "busy": timer.busy,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "losses": timer.losses,
    }


class _StepEnds(pl.Callback):
    """Times every batch end; profiles the last ``profile_steps`` steps for the device's busy fraction."""

    def __init__(self, steps: int, profile_steps: int, cuda: bool) -> None:
        self.steps, self.profile_steps, self.cuda = steps, profile_steps, cuda
        self.ends: list[float] = []
        self.losses: list[float] = []
        self.busy: float | None = None
        self._profiler: Any = None
        self._started = 0.0

    @property
    def step_s(self) -> list[float]:
        """Seconds between consecutive batch ends over the timed steps."""
        timed = self.ends[: self.steps]
        return [b - a for a, b in itertools.pairwise(timed)]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.steps:
            return
        if self.cuda:  # the timed steps are done: profile the rest
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.ends.append(time.perf_counter())
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if batch_idx == 0:  # the first step's loss only: reading it synchronises, before the timed steps
            self.losses.append(float(loss.detach()))
        if batch_idx != self.steps + self.profile_steps - 1 or self._profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        kernel_us = sum(
            e.self_device_time_total
            for e in self._profiler.key_averages()
            if str(getattr(e, "device_type", "")).endswith("CUDA")
        )
        self.busy = (kernel_us / 1e6) / wall if self.cuda else None


def launch_job(mode: str, shape: Shape, device: str, timeout_s: float) -> dict[str, Any]:
    """Run one job in a fresh Python process; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        spec = json.dumps({**asdict(shape), "modes": list(shape.modes)})
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.gpu_overhead",
            "--job",
            mode,
            "--shape",
            spec,
            "--device",
            device,
        ]
        proc = subprocess.run(
            [*cmd, "--job-out", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=dict(os.environ),
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{shape.name} {mode} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        report: dict[str, Any] = json.loads(out.read_text())
        return report


def measure(
    shape: Shape, rounds: int, device: str, timeout_s: float, forked: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Every mode of ``shape`` once per round, in rotated order.

    ``forked``: each job in a forked child of this process (the CPU dry run: not figures), not a fresh
    interpreter (:func:`benchmarks._lib.common.run_forked`); never on a GPU (a forked CUDA context is
    unusable).
    """
    from benchmarks._lib.common import run_forked
    from benchmarks._lib.harness import rotated

    if forked and device != "cpu":
        raise ValueError(f"forked jobs run on the CPU only, not on device={device!r}")

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in shape.modes}
    for r in range(rounds):
        for mode in rotated(list(shape.modes), r):
            print(
                f"[gpu_overhead] {shape.name} round {r + 1}/{rounds}: {mode} ...", file=sys.stderr, flush=True
            )
            if forked:
                job = functools.partial(run_job, mode, shape, device)
                runs[mode].append(run_forked(job, f"{shape.name} {mode}", timeout_s))
            else:
                runs[mode].append(launch_job(mode, shape, device, timeout_s))
    return runs


def table(shape: Shape, runs: dict[str, list[dict[str, Any]]]) -> tuple[list[str], dict[str, float]]:
    """The shape's table and each mode's median ratio to its base (``plain``, or ``plain_compile``)."""
    lines = [
        f"### {shape.name}: {shape.layers} layers, width {shape.width}, vocabulary {shape.vocab}"
        f"{' (tied head)' if shape.tied else ''}; {shape.rows} x {shape.tokens} tokens in "
        f"{shape.microbatches} micro-batches, {shape.precision}",
        "",
        "| mode | median step (ms) | every round | ratio to its base, median | every round | device busy "
        "| peak memory (GB) | loss at step 0 |",
        "|---|---:|---|---:|---|---:|---:|---:|",
    ]
    step_ms = {
        m: [1e3 * statistics.median(run["step_s"][shape.skip :]) for run in rs] for m, rs in runs.items()
    }
    ratios: dict[str, float] = {}
    for mode, values in step_ms.items():
        base = step_ms[BASE[mode]]
        within = [v / b for v, b in zip(values, base, strict=True)]
        ratios[mode] = statistics.median(within)
        busy = [run["busy"] for run in runs[mode] if run["busy"] is not None]
        busy_text = f"{100 * statistics.median(busy):.0f}%" if busy else "n/a"
        peak = max(run["peak_bytes"] for run in runs[mode]) / 1e9
        lines.append(
            f"| {mode} (vs {BASE[mode]}) | {statistics.median(values):.1f} | "
            f"{', '.join(f'{v:.1f}' for v in values)} "
            f"| {ratios[mode]:.3f} | {', '.join(f'{x:.3f}' for x in within)} | {busy_text} | {peak:.1f} "
            f"| {runs[mode][0]['losses'][0]:.5f} |"
        )
    return lines, ratios


def verdicts(shape: Shape, ratios: dict[str, float], step_ms: dict[str, float]) -> list[str]:
    """The issue's bounds, each marked met or not."""
    bound = 1.05 if shape.name == "135M" else 1.02
    out = [
        f"- DynMo + callback / plain at {shape.name}: {ratios['dynmo_cb']:.3f} (bound {bound}): "
        f"{'met' if ratios['dynmo_cb'] <= bound else 'NOT met'}"
    ]
    if "dynmo_compile" in ratios:
        out.append(
            f"- DynMo + compile / plain + compile: {ratios['dynmo_compile']:.3f} (bound 1.05): "
            f"{'met' if ratios['dynmo_compile'] <= 1.05 else 'NOT met'}"
        )
        faster = step_ms["dynmo_compile"] < step_ms["dynmo_cb"]
        out.append(
            f"- DynMo + compile ({step_ms['dynmo_compile']:.1f} ms) faster than DynMo uncompiled with the "
            "callback "
            f"({step_ms['dynmo_cb']:.1f} ms): {'met' if faster else 'NOT met'}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny, on CPU, one round: the code path, no figures"
    )
    parser.add_argument("--shapes", default="135M,1.1B", help="comma-separated: 135M, 1.1B")
    parser.add_argument(
        "--out", type=Path, default=None, help="the report's path (default: dated, in results/)"
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing dated report")
    parser.add_argument("--job-timeout", type=float, default=300.0)
    parser.add_argument("--job", choices=MODES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--device", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--job-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job is not None:
        spec = json.loads(args.shape)
        shape = Shape(**{**spec, "modes": tuple(spec["modes"])})
        args.job_out.write_text(json.dumps(run_job(args.job, shape, args.device)))
        return
    from benchmarks._lib import harness
    from benchmarks._lib.common import results_path

    if args.rounds < 1:
        raise ValueError(
            f"--rounds={args.rounds}: a comparison needs at least 1 round; pass --rounds 1 or more"
        )
    if args.dry_run:
        shapes, device, rounds = [DRY], "cpu", 1
    else:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "benchmarks.gpu_overhead measures a GPU and none is visible; use --dry-run on CPU"
            )
        known = {s.name: s for s in (SMOL_135M, TINYLLAMA_1B)}
        wanted = [name.strip() for name in args.shapes.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in known]
        if unknown or not wanted:
            raise ValueError(f"--shapes={args.shapes!r}: each must be one of {list(known)}")
        shapes, device, rounds = [known[name] for name in wanted], "cuda", args.rounds
    out = results_path("gpu_overhead-dry-run" if args.dry_run else "gpu_overhead", args.out, args.force)
    started = time.perf_counter()
    sections = [
        harness.header(
            "DynMo's step on one GPU against plain Lightning's"
            + (" (dry run: not figures)" if args.dry_run else ""),
            "gpu_overhead",
            argv,
            [harness.REAL],
        )
    ]
    for shape in shapes:
        runs = measure(shape, rounds, device, args.job_timeout, forked=args.dry_run)
        lines, ratios = table(shape, runs)
        medians = {
            m: statistics.median(1e3 * statistics.median(r["step_s"][shape.skip :]) for r in rs)
            for m, rs in runs.items()
        }
        sections += ["\n".join(lines), "\n".join(verdicts(shape, ratios, medians))]
    harness.finish("gpu_overhead", out, sections, started)


if __name__ == "__main__":
    main()
