"""Time migrate_units on 2 CPU ranks (gloo): one transformer-sized MLP block with its AdamW state,
bounced between the ranks. Prints one line per size: bytes moved, median seconds, MB/s.

    python -m benchmarks.bench_migration [--dims 256 512] [--repeats 7]
    python -m benchmarks.bench_migration --quick   # a smoke run (one small block, 2 bounces): not figures

Timings on a shared 2-core machine are noisy; rerun on a quiet one before quoting them.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch
from torch import nn

from lightning_dynmo.pipeline.migration.transport import UnitMove, migrate_units
from tests.distributed.harness import run_distributed


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))


def _bounce(rank: int, world_size: int, dim: int, repeats: int) -> list[tuple[int, float]]:
    units: dict[str, nn.Module] = {}
    if rank == 0:
        block = MLPBlock(dim)
        units["layers.0"] = block
    # Both ranks build the same group layout; the receiver's group starts empty.
    optimizer = torch.optim.AdamW([{"params": [p for u in units.values() for p in u.parameters()]}], lr=1e-3)
    if rank == 0:
        block(torch.randn(2, dim)).sum().backward()
        optimizer.step()
    timings = []
    owner = 0
    for _ in range(repeats + 1):  # the first bounce is a warm-up
        move = UnitMove("layers.0", owner, 1 - owner)
        received, report = migrate_units([move], units, [optimizer], device=torch.device("cpu"))
        units = received
        owner = 1 - owner
        timings.append((report.bytes_sent + report.bytes_received, report.seconds))
    return timings[1:]


def main(argv: list[str] | None = None) -> list[str]:
    """Print and return one line per size: bytes moved, the median seconds of a move, MB/s."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run, not figures: one small block")
    parser.add_argument("--dims", type=int, nargs="+", default=None, help="block widths (default 256 512)")
    parser.add_argument("--repeats", type=int, default=None, help="timed bounces per width (default 7)")
    args = parser.parse_args(argv)
    dims = args.dims or ([64] if args.quick else [256, 512])
    repeats = args.repeats or (2 if args.quick else 7)
    lines = []
    for dim in dims:
        with tempfile.TemporaryDirectory() as tmp:
            per_rank = run_distributed(_bounce, 2, tmp, timeout_s=300, args=(dim, repeats))
        nbytes = per_rank[0][0][0]
        seconds = statistics.median(max(a[1], b[1]) for a, b in zip(per_rank[0], per_rank[1], strict=True))
        rate = nbytes / seconds / 1e6
        lines.append(
            f"dim={dim}: {nbytes / 1e6:.1f} MB per move, median {seconds * 1e3:.1f} ms, {rate:.0f} MB/s"
        )
        print(lines[-1])
    return lines


if __name__ == "__main__":
    main()
