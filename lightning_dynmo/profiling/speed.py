"""How fast each rank computes: one fixed reference workload, timed on every rank of the pipeline.

Why a reference workload. A layer's profiled time mixes what the layer costs with how fast the rank that
ran it is, and every layer was measured on one rank only, so the profile alone cannot separate the two
(a stage that is slow could hold expensive layers or sit on a slow worker). Comparing layers that ran on
two ranks would, but only after migrations, and dynamic models change their layers' costs between the
windows that would have to be compared. The same work timed on every rank in the same window compares
the ranks and nothing else: the ratio of the times is the ratio of the speeds, and it does not move when
the model does. Its limit: it measures speed for its own kind of work (dense matrix products forward
and backward, like a transformer block's); a worker slowed only on other work (memory-bound kernels,
host-side Python) is seen in proportion to how much of that work the probe shares.

:func:`time_reference_workload` times the workload on this rank. The callback runs it on every active rank
at once (each rank then computes while its peers do too, as in training) and
:func:`lightning_dynmo.balancing.hardware.worker_slowdown` turns the times into per-pipeline-rank factors.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

#: Hidden width of the reference workload per device type (its tokens are twice that).
PROBE_WIDTH = {"cpu": 128, "cuda": 2048}


def time_reference_workload(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    width: int | None = None,
    repeats: int = 5,
    warmup: int = 1,
) -> float:
    """Median seconds of a fixed MLP forward and backward (``2 * width`` tokens, ``width`` -> ``4 * width``).

    The inputs come from a fixed seed and do not depend on the rank, so every rank does the same work.

    Args:
        device: Where to run it (the stage's device).
        dtype: The model's floating-point type.
        width: Hidden width; ``None``: :data:`PROBE_WIDTH` for the device type (1024 elsewhere).
        repeats: Timed runs (the median is returned).
        warmup: Untimed runs first (allocator, kernel selection).
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats}, warmup={warmup}: need repeats >= 1 and warmup >= 0.")
    device = torch.device(device)
    d = width if width is not None else PROBE_WIDTH.get(device.type, 1024)
    if d < 1:
        raise ValueError(f"width={width} must be >= 1.")
    gen = torch.Generator().manual_seed(0)

    def tensor(*shape: int, grad: bool = False) -> torch.Tensor:
        t: torch.Tensor = (torch.randn(*shape, generator=gen) / d**0.5).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    x, w1, w2 = tensor(2 * d, d), tensor(d, 4 * d, grad=True), tensor(4 * d, d, grad=True)
    times = []
    for _ in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        (F.gelu(x @ w1) @ w2).square().mean().backward()  # type: ignore[no-untyped-call]
        _sync(device)
        times.append(time.perf_counter() - start)
        w1.grad, w2.grad = None, None
    return statistics.median(times[warmup:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
