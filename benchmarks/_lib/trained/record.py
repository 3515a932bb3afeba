"""Command line: record the traces of the chosen cases and print each one's spread across layers.

``python -m benchmarks.trained --case pruning --case freezing`` loads SmolLM2-135M afresh for every case
(training cases change it in place) and writes ``benchmarks/results/traces/<case>-<date>.json``;
``--quick`` runs a tiny random Llama for 2-3 steps instead (what the test suite checks).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks._lib.trained import early_exit, freezing, mod, moe, pruning, sparse_attention
from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.smollm import load_smollm2, tiny_llama
from benchmarks._lib.trained.traces import Trace, format_spread

__all__ = ["CASES", "main"]

CASES: dict[str, Callable[[CaseRun], Trace]] = {
    "pruning": pruning.record,
    "sparse_attention": sparse_attention.record,
    "freezing": freezing.record,
    "moe": moe.record,
    "mod": mod.record,
    "early_exit": early_exit.record,
}
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "results" / "traces"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options (see ``--help``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trained", description=__doc__)
    parser.add_argument(
        "--case", action="append", choices=sorted(CASES), help="a case (repeat); default: all"
    )
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, 2-3 steps (seconds)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the trace files")
    parser.add_argument("--seed", type=int, default=0, help="torch seed before each case")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    """Record every chosen case; returns the written files."""
    args = parse_args(argv)
    words = list(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "-m", "benchmarks.trained", *words])
    written = []
    for case in args.case or list(CASES):
        torch.manual_seed(args.seed)
        pretrained = tiny_llama() if args.quick else load_smollm2()
        trace = CASES[case](CaseRun(pretrained, args.quick, command))
        path = trace.write(args.out)
        print(format_spread(trace))
        print(f"  -> {path}")
        written.append(path)
    return written
