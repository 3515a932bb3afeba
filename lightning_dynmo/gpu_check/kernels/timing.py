"""The shapes the kernel check measures at, and its timer: forward + backward, interleaved rounds, medians."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["DRY_RUN_SHAPE", "PAPER_SHAPE", "Shape", "Timer"]


@dataclass(frozen=True)
class Shape:
    """One micro-batch's shape and the precision it runs in.

    Attributes:
        d_model: Hidden width.
        num_heads: Attention heads.
        seq_len: Tokens per sequence.
        micro_batch: Sequences per micro-batch.
        vocab_size: Vocabulary (the head and the embedding).
        dtype: ``"bfloat16"`` on a GPU, ``"float32"`` in the CPU dry run.
        tile: Rows per sparse-attention tile (a multiple of 16 for FlexAttention's Triton kernels).
        block: Side of the pruned blocks (BSR).
        num_layers: Blocks of the small GPTs the stall part trains.
    """

    d_model: int
    num_heads: int
    seq_len: int
    micro_batch: int
    vocab_size: int
    dtype: str
    tile: int
    block: int
    num_layers: int

    @property
    def torch_dtype(self) -> torch.dtype:
        """:attr:`dtype` as a torch dtype."""
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


#: The paper's GPT shape (hidden 1024, 32 heads, seq 2048, micro-batch 2, bf16, GPT-2 vocabulary).
PAPER_SHAPE = Shape(
    d_model=1024,
    num_heads=32,
    seq_len=2048,
    micro_batch=2,
    vocab_size=50257,
    dtype="bfloat16",
    tile=128,
    block=64,
    num_layers=4,
)
#: The CPU dry run: the same parts, tiny, in float32.
DRY_RUN_SHAPE = Shape(
    d_model=32,
    num_heads=2,
    seq_len=64,
    micro_batch=2,
    vocab_size=64,
    dtype="float32",
    tile=16,
    block=8,
    num_layers=2,
)


class Timer:
    """Times variants of one computation against each other on ``device``.

    Args:
        device: ``"cuda"`` (CUDA events, the device synchronised per call) or ``"cpu"`` (``perf_counter``).
        warmup: Untimed calls of each variant first (compilation, autotuning, allocator).
        rounds: Timed rounds; each calls every variant once, in turn.
    """

    def __init__(self, device: str, warmup: int, rounds: int) -> None:
        self.device, self.warmup, self.rounds = device, warmup, rounds

    def compare(self, variants: Mapping[str, Callable[[], object]]) -> dict[str, dict[str, Any]]:
        """``{name: {"median_ms", "rounds_ms"}}`` of each variant (a callable doing forward + backward)."""
        for run in variants.values():
            for _ in range(self.warmup):
                run()
        rounds: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(self.rounds):
            for name, run in variants.items():
                rounds[name].append(self.time_ms(run))
        return {
            name: {"median_ms": round(statistics.median(ms), 4), "rounds_ms": [round(m, 4) for m in ms]}
            for name, ms in rounds.items()
        }

    def time_ms(self, run: Callable[[], object]) -> float:
        """Milliseconds of one call of ``run``, the device's work included."""
        if self.device != "cuda":
            start = time.perf_counter()
            run()
            return 1e3 * (time.perf_counter() - start)
        begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        begin.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return float(begin.elapsed_time(end))
