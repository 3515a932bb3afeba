"""``python -m lightning_dynmo.gpu_check.kernels``: run every kernel part and write one JSON.

    python -m lightning_dynmo.gpu_check.kernels                       # on one GPU: under 8 minutes
    python -m lightning_dynmo.gpu_check.kernels --dry-run --out /tmp/k # the same parts, tiny, on CPU

The JSON (``<out>/kernels.json``) holds the command, the device
(:func:`~lightning_dynmo.gpu_check.hardware.describe`), the shape, and per part its result, its error
or why it was skipped; each part's ``must_show`` says whether the issue's bound held. Parts run most
important first; once ``--budget-s`` is spent the rest are recorded as skipped.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_dynmo.gpu_check import hardware
from lightning_dynmo.gpu_check.kernels import parts
from lightning_dynmo.gpu_check.kernels.timing import DRY_RUN_SHAPE, PAPER_SHAPE, Shape, Timer

__all__ = ["PARTS", "main", "run_kernels"]

log = logging.getLogger(__name__)

DEFAULT_OUT = Path("benchmarks/results/gpu")
BUDGET_S = 420.0  # 7 minutes of parts: the command ends within 8 on one GPU
#: The parts, most important first: (name, function, seconds it needs at least to be worth starting).
PARTS: tuple[tuple[str, Callable[[Shape, Timer, str], dict[str, Any]], float], ...] = (
    ("attention", parts.attention, 60.0),
    ("pruning", parts.pruning, 30.0),
    ("stalls", parts.stalls, 45.0),
    ("moe", parts.moe, 20.0),
    ("cost_curves", parts.cost_curves, 60.0),
)


def main(argv: list[str] | None = None) -> Path:
    """Run the kernel check; return the JSON's path."""
    args = _parser().parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device is visible: run on a GPU machine, or pass --dry-run for the CPU run.")
    out = args.out or DEFAULT_OUT / dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(
        ["python -m lightning_dynmo.gpu_check.kernels", *(argv if argv is not None else sys.argv[1:])]
    )
    report = run_kernels(device, args.budget_s, command, only=args.parts)
    path = out / "kernels.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    log.info("kernel check written to %s", path)
    return path


def run_kernels(device: str, budget_s: float, command: str, only: list[str] | None = None) -> dict[str, Any]:
    """Every part (or those named in ``only``) on ``device`` within ``budget_s``; the report as a dict."""
    shape = DRY_RUN_SHAPE if device == "cpu" else PAPER_SHAPE
    # The dry run checks that every part runs; one round is enough (no figure comes from a CPU run).
    timer = Timer(device, warmup=0, rounds=1) if device == "cpu" else Timer(device, warmup=3, rounds=7)
    started, clock = dt.datetime.now(dt.UTC), time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for name, run, needs_s in PARTS:
        left = budget_s - (time.perf_counter() - clock)
        if only is not None and name not in only:
            results[name] = {"ok": None, "skipped": "not among --parts"}
        elif left < needs_s:
            results[name] = {"ok": None, "skipped": f"{left:.0f} s left of the {budget_s:.0f} s budget"}
        else:
            results[name] = _run_part(run, shape, timer, device)
    return {
        "label": "real compute",
        "command": command,
        "started_utc": started.isoformat(),
        "elapsed_s": round(time.perf_counter() - clock, 1),
        "budget_s": budget_s,
        "device": hardware.describe(),
        "shape": shape.to_dict(),
        "timer": {
            "warmup": timer.warmup,
            "rounds": timer.rounds,
            "statistic": "median of interleaved rounds",
        },
        "parts": results,
    }


def _run_part(
    run: Callable[[Shape, Timer, str], dict[str, Any]], shape: Shape, timer: Timer, device: str
) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = run(shape, timer, device)
    except Exception as error:  # one part's failure is a finding; the others still run
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"ok": True, "seconds": round(time.perf_counter() - start, 1), "result": result}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_dynmo.gpu_check.kernels", description=__doc__)
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on CPU (what the test suite runs)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder of kernels.json (default: dated results)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help="seconds of parts before skipping the rest"
    )
    parser.add_argument(
        "--parts", nargs="+", choices=[name for name, _, _ in PARTS], help="run only these parts"
    )
    return parser
