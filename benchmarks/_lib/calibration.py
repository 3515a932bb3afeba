"""The calibration models and jobs :mod:`benchmarks.calibration_sweep` runs, and the step a profile predicts.

Two models whose head and loss cost several blocks: our GPT with a large vocabulary (``gpt``) and a Hugging
Face GPT-2 with an untied head (``gpt2``), 8 blocks each (:class:`Sizes`, :func:`build_model`,
:func:`batches`); the placements compared under a schedule (:func:`candidates`); the step a profile job's
costs predict for a placement, with the runtime's cost per action fitted on the profile job's own steady
steps (:func:`predicted_ms`); and what makes the placements uneven as profiled (:func:`parts_line`).
Kept from the retired fixed-job calibration (``benchmarks/calibration.py``, superseded by the sweep).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_dynmo.balancing import BalanceProblem, Placement, uniform
from lightning_dynmo.balancing.hardware import whole_backward_ratio
from lightning_dynmo.balancing.step_prediction import per_action_s, predict_step
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from lightning_dynmo.pipeline import schedule_order
from lightning_dynmo.pipeline.step.schedule import resolve_schedule

MODELS = ("gpt", "gpt2")
PROFILE_FROM = 11  # a profile job's steps from ``skip`` to 10 (no hooks yet) measure the runtime's own cost
PROFILE_STEPS = 3  # then one window of this many profiled steps
SCHEDULES = ("1F1B", "ZBVZeroBubble")


@dataclass(frozen=True)
class Sizes:
    """A mode's sizes: the models' shape, the batches and how long jobs run."""

    num_layers: int = 8
    d_model: int = 128
    num_heads: int = 4
    seq_len: int = 64
    vocab_size: int = 8192
    batch_size: int = 8
    microbatches: int = 4
    steps: int = 16
    skip: int = 4  # steps before the steady state (also before a profile job's per-action fit)
    rounds: int = 3


FULL = Sizes()
QUICK = Sizes(num_layers=4, d_model=16, num_heads=2, seq_len=8, vocab_size=256, steps=16, skip=2, rounds=1)


@dataclass(frozen=True)
class CalibrationJob:
    """One 2-rank job: ``model`` under ``schedule`` at ``placement``; ``profile`` runs the static callback."""

    model: str
    schedule: str
    placement: str
    sizes: Sizes
    profile: bool = False
    lr: float = 1e-3  # a rate that learns; the times should not depend on it
    seed: int = 0


def build_model(job: CalibrationJob) -> pl.LightningModule:
    """The job's model, fresh weights from ``job.seed``."""
    s = job.sizes
    if job.model == "gpt":
        torch.manual_seed(job.seed)
        config = GPTConfig(
            vocab_size=s.vocab_size,
            seq_len=s.seq_len,
            num_layers=s.num_layers,
            d_model=s.d_model,
            num_heads=s.num_heads,
        )
        return GPT(config, OptimizerConfig(lr=job.lr))
    # The Hugging Face adapter is an optional extra: imported only for this model.
    from transformers import GPT2Config

    from lightning_dynmo.models.huggingface import HuggingFaceCausalLM

    config = GPT2Config(
        vocab_size=s.vocab_size,
        n_positions=s.seq_len,
        n_embd=s.d_model,
        n_layer=s.num_layers,
        n_head=s.num_heads,
        tie_word_embeddings=False,
    )
    return HuggingFaceCausalLM(config, attn_implementation="sdpa", seed=job.seed, lr=job.lr)


def batches(job: CalibrationJob, steps: int) -> DataLoader[Any]:
    """``steps`` batches of random tokens from ``job.seed``, in the shape ``job.model`` takes."""
    s = job.sizes
    gen = torch.Generator().manual_seed(job.seed)
    rows = torch.randint(0, s.vocab_size, (steps * s.batch_size, s.seq_len + 1), generator=gen)
    if job.model == "gpt":
        return DataLoader(list(rows), batch_size=s.batch_size)
    items = [{"input_ids": r[:-1], "labels": r[1:]} for r in rows]
    return DataLoader(items, batch_size=s.batch_size)  # type: ignore[arg-type]


def candidates(schedule: str, num_layers: int) -> list[str]:
    """Every 2-stage split under a one-stage-per-rank schedule; else uniform and its one-move neighbours."""
    stages = 2 * resolve_schedule(schedule).stages_per_rank
    base = uniform(num_layers, stages)
    if stages == 2:
        return [str(Placement((0, k, num_layers))) for k in range(1, num_layers)]
    out = [str(base)]
    bounds = base.boundaries
    for i in range(1, stages):
        for delta in (-1, 1):
            moved = (*bounds[:i], bounds[i] + delta, *bounds[i + 1 :])
            if moved[i - 1] < moved[i] < moved[i + 1]:
                out.append(str(Placement(moved)))
    return out


def predicted_ms(
    report: dict[str, Any], schedule: str, placement: str, microbatches: int, skip: int
) -> float:
    """The step a profile job's costs predict for ``placement``, ms.

    The runtime's own cost per action is fitted on the profile job's steady steps before its window
    (``skip`` to ``PROFILE_FROM``): the first steps run slower (allocations, the optimizer's first
    state), and the compared jobs are measured after ``skip`` too.
    """
    problem, order = BalanceProblem(report["costs"], hardware=report["hardware"]), schedule_order(schedule)
    profiled = Placement.from_string(report["placement"])
    bare = predict_step(problem, profiled, order, microbatches, per_op_s=0.0).step_s  # not the callback's
    before_window = statistics.median(report["step_s"][skip:PROFILE_FROM])
    per_op = per_action_s(order, profiled.num_stages, microbatches, before_window - bare)
    step = predict_step(problem, Placement.from_string(placement), order, microbatches, per_op_s=per_op)
    return 1e3 * step.step_s


def parts_line(profiles: list[dict[str, Any]]) -> str:
    """What makes the placements uneven: the head + loss and the embedding in blocks, as profiled.

    Per round, a part's forward + backward over the median block's, from the profile job's window; under
    a split-backward schedule also the whole-to-split backward ratio the step model takes from the profile
    (:func:`~lightning_dynmo.balancing.hardware.whole_backward_ratio`).
    """

    def blocks(part: str) -> list[float]:
        out = []
        for report in profiles:
            extra = getattr(report["hardware"], part)
            block = statistics.median(c.time_s for c in report["costs"])
            out.append(extra.time_s / block if extra is not None and block > 0 else float("nan"))
        return out

    head, emb = blocks("last_stage_extra"), blocks("first_stage_extra")
    line = (
        f"What makes the placements uneven, as profiled: head + loss = {statistics.median(head):.2f} blocks "
        f"(per round {min(head):.2f}-{max(head):.2f}), embedding = {statistics.median(emb):.2f} blocks."
    )
    ratios = [whole_backward_ratio(report["costs"]) for report in profiles]
    if any(r != 1.0 for r in ratios):  # measured both ways: a split-backward schedule
        line += (
            f" A block's backward run whole (the first stage's) costs {statistics.median(ratios):.2f}x its "
            f"split one (per round {min(ratios):.2f}-{max(ratios):.2f}), as the step model charges it."
        )
    return line
