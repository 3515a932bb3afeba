"""``python -m lightning_dynmo.gpu_check``: run every part, one process each, and write ``gpu_check.json``.

    python -m lightning_dynmo.gpu_check                      # on a GPU machine: under 8 minutes
    python -m lightning_dynmo.gpu_check --dry-run --out /tmp/x  # the same parts, tiny, on CPU/gloo

The report (``<out>/gpu_check.json``) names the hardware, the sizes, and per part its result or its error;
the parts' logs sit beside it. Parts run most important first; once ``--budget-s`` is spent the rest are
recorded as skipped, so the command ends in time whatever hangs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dynmo.gpu_check import hardware
from lightning_dynmo.gpu_check.plan import DRY_RUN_SIZES, GPU_SIZES, parts
from lightning_dynmo.gpu_check.runner import run_part

DEFAULT_OUT = Path("benchmarks/results/gpu")
BUDGET_S = 450.0  # 7.5 minutes: the check must end within 8 on one GPU
MIN_PART_S = 20.0  # a part given less than this would only time out: skipped instead


def main(argv: list[str] | None = None) -> Path:
    """Run the check; return the report's path."""
    args = _parser().parse_args(argv)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device is visible: run on a GPU machine, or pass --dry-run for the CPU/gloo run.")
    out = args.out or DEFAULT_OUT / dt.date.today().isoformat()
    out.mkdir(parents=True, exist_ok=True)
    report = run_check(device, out, args.budget_s)
    path = out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu check: {report['passed']}/{len(report['parts'])} parts passed; report {path}")
    return path


def run_check(device: str, out: Path, budget_s: float) -> dict[str, Any]:
    """Every part for ``device`` in turn, within ``budget_s`` seconds; the report as a dict."""
    sizes = DRY_RUN_SIZES if device == "cpu" else GPU_SIZES
    num_devices = torch.cuda.device_count() if device == "cuda" else 0
    started, clock = dt.datetime.now(dt.UTC), time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for part in parts(device, num_devices):
        left = budget_s - (time.perf_counter() - clock)
        if part.skipped is not None or left < MIN_PART_S:
            results[part.name] = {
                "ok": None,
                "skipped": part.skipped or f"out of the {budget_s:.0f} s budget",
            }
        else:
            results[part.name] = run_part(part, sizes, device, out, min(part.timeout_s, left))
        _print_line(part.name, results[part.name])
    return {
        "command": " ".join(["python -m lightning_dynmo.gpu_check", *sys.argv[1:]]),
        "mode": "dry-run (cpu, gloo)" if device == "cpu" else "gpu",
        "started_utc": started.isoformat(),
        "wall_s": time.perf_counter() - clock,
        "hardware": hardware.describe(),
        "sizes": dataclasses.asdict(sizes),
        "passed": sum(1 for r in results.values() if r.get("ok") is True),
        "parts": results,
    }


def _print_line(name: str, result: dict[str, Any]) -> None:
    verdict = {True: "ok", False: "FAILED", None: "skipped"}[result.get("ok")]
    why = result.get("error") or result.get("skipped") or ""
    print(f"{name:<28} {verdict:<8} {result.get('wall_s', 0.0):6.1f} s  {why}", flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lightning_dynmo.gpu_check", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU/gloo (two processes)")
    parser.add_argument(
        "--out", type=Path, default=None, help=f"report directory (default {DEFAULT_OUT}/<date>)"
    )
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="stop starting parts after this")
    return parser
