"""What the GPU check runs: the model sizes (realistic on GPU, tiny in the dry run) and the list of parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CASES = ("moe", "pruning", "freezing", "early_exit", "sparse_attention", "mod")
STALL_CASES = ("mod", "early_exit")  # the cases whose blocks see new shapes every step
STALL_STEPS = 20
PRECISIONS = ("bf16-mixed", "16-mixed")  # 16-mixed: fp16 with loss scaling


@dataclass(frozen=True)
class Sizes:
    """The GPT and run sizes every part uses.

    Attributes:
        num_layers: Transformer blocks.
        d_model: Hidden width.
        num_heads: Attention heads.
        seq_len: Tokens per sequence.
        batch_size: Sequences per step.
        num_microbatches: Micro-batches per step.
        steps: Optimizer steps per training run.
        rebalance_at: The step at which DynMo's callback opens its profiling window (1 warm-up step and
            2 measured steps follow; the dynamism of every case has settled by then), and again every as
            many steps.
        cost_windows: Profiling windows each per-layer-cost part runs (it trains :func:`cost_steps`
            steps): a second window tells a one-off slow layer from a steady cost.
    """

    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    batch_size: int
    num_microbatches: int
    steps: int
    rebalance_at: int
    cost_windows: int = 2


def cost_steps(sizes: Sizes) -> int:
    """Steps a per-layer-cost part trains: its last window opens at ``rebalance_at * cost_windows``."""
    return sizes.rebalance_at * sizes.cost_windows + 3


# A realistic width for the projections (the paper's GPT blocks are wider; one H100 holds these 8 blocks).
GPU_SIZES = Sizes(
    num_layers=8,
    d_model=1024,
    num_heads=16,
    seq_len=1024,
    batch_size=8,
    num_microbatches=4,
    steps=12,
    rebalance_at=6,
)
DRY_RUN_SIZES = Sizes(
    num_layers=4,
    d_model=32,
    num_heads=2,
    seq_len=16,
    batch_size=4,
    num_microbatches=2,
    steps=7,
    rebalance_at=3,
)


@dataclass(frozen=True)
class Part:
    """One part of the check, run in its own process.

    Attributes:
        name: Its key in the report.
        kind: What the worker runs: ``"train"``, ``"costs"``, ``"stalls"``, ``"migration"`` or
            ``"nccl_probe"``.
        timeout_s: Wall-clock limit, start-up included; the part is killed after it.
        options: The kind's arguments (JSON-ready).
        skipped: Why the part cannot run on this machine (recorded instead of running it), or ``None``.
    """

    name: str
    kind: str
    timeout_s: float
    options: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None


def parts(device: str, num_devices: int) -> list[Part]:
    """The parts for ``device`` (``"cuda"`` or ``"cpu"``) with ``num_devices`` usable, most important first.

    On CPU (the dry run) two processes stand for two devices. On one GPU a two-process pipeline cannot run:
    NCCL refuses two ranks on one device (``nccl_probe`` records what this NCCL says) and gloo moves no
    CUDA tensors point to point, so the two-process training is skipped and the migration moves CUDA
    tensors through CPU payloads over gloo instead of NCCL.
    """
    two = num_devices >= 2 or device == "cpu"
    out = [Part(f"train_1proc_{p}", "train", 150, {"devices": 1, "precision": p}) for p in PRECISIONS]
    out += [Part(f"costs_{case}", "costs", 150, {"case": case}) for case in CASES]
    stall = {"steps": STALL_STEPS}
    out += [Part(f"stalls_{case}", "stalls", 120, {"case": case, **stall}) for case in STALL_CASES]
    backend = "gloo" if device == "cpu" or num_devices < 2 else "nccl"
    out.append(Part("migration", "migration", 120, {"backend": backend}))
    why = None if two else f"{num_devices} CUDA device: a two-stage pipeline needs two (see nccl_probe)"
    out += [
        Part(f"train_2proc_{p}", "train", 180, {"devices": 2, "precision": p, "migrate": True}, skipped=why)
        for p in PRECISIONS
    ]
    probe = None if device == "cuda" and num_devices == 1 else "only asked on a one-GPU machine"
    out.append(Part("nccl_probe", "nccl_probe", 90, {}, skipped=probe))
    return out
