"""What the profiler's own hooks add to a stage's step, and what an action costs after its rank idled.

Two effects that move with a layer when DynMo moves it, measured in one process, one torch thread, on
a stage of 1, 4 or 7 blocks at the calibration's sizes (width 128, 64 tokens, 2 rows a micro-batch):
our GPT's dense blocks, and Hugging Face GPT-2 blocks when ``transformers`` is installed;
``--microbatches`` forward and backward calls a step:

- **hooks**: the step with :class:`~lightning_dynmo.profiling.layer_timer.LayerTimer` attached against
  the same step without it, alternating (which goes first alternates too), ``--rounds`` pairs. Also the
  time the hooks' own bodies take (what ``hook_time_s`` reports): the rest is the price of having hooks
  at all (the module call's slow path, autograd's hook dispatch).
- **after idle**: one block's forward and backward run back to back against the same after a sleep of
  ``--idle-ms``, for 1, 3 and 6 blocks of work: a fixed extra time shows as a ratio that falls as the
  work grows.

Real compute; figures are per step (hooks) or per action (after idle), medians over rounds.

    python -m benchmarks.hook_cost
    python -m benchmarks.hook_cost --quick      # a smoke run: 2 rounds
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks._lib import harness
from benchmarks._lib.common import results_path, write_report
from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.profiling.clock import StepClock
from lightning_dynmo.profiling.layer_timer import LayerTimer

WIDTH, TOKENS, ROWS, HEADS = 128, 64, 2, 4


def blocks(count: int, model: str) -> list[nn.Module]:
    """``count`` blocks of ``model`` (``"gpt"``: our dense blocks; ``"gpt2"``: Hugging Face's)."""
    torch.manual_seed(0)
    if model == "gpt":
        config = GPTConfig(vocab_size=256, num_layers=count, d_model=WIDTH, num_heads=HEADS, seq_len=TOKENS)
        return list(GPT(config).layers.values())
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config2 = GPT2Config(n_embd=WIDTH, n_head=HEADS, n_positions=TOKENS, n_layer=count)
    config2._attn_implementation = "eager"  # as GPT2Model picks on CPU; a bare block has none set
    return [_FirstOutput(GPT2Block(config2, layer_idx=i)) for i in range(count)]


class _FirstOutput(nn.Module):
    """A block whose forward may return a tuple, returning its hidden states only."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def models() -> list[str]:
    """``gpt``, and ``gpt2`` where ``transformers`` is installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ["gpt"]
    return ["gpt", "gpt2"]


def stage_step(stage: Sequence[nn.Module], microbatches: int) -> Callable[[], None]:
    """One step of ``stage``: every micro-batch forward through the blocks, then its backward."""

    def step() -> None:
        for _ in range(microbatches):
            h = torch.randn(ROWS, TOKENS, WIDTH, requires_grad=True)
            for block in stage:
                h = block(h)
            h.sum().backward()

    return step


def hooks(stage: Sequence[nn.Module], microbatches: int, rounds: int) -> dict[str, float]:
    """Median step ms without and with the layer timer attached, and the ms inside its hooks."""
    step = stage_step(stage, microbatches)
    timer = LayerTimer(dict(enumerate(stage)), StepClock("cpu"))
    for _ in range(3):
        step()
    bare, hooked, inside = [], [], []
    for r in range(rounds):
        for with_hooks in (True, False) if r % 2 else (False, True):
            if with_hooks:
                timer.attach()
                timer.begin_step()
            start = time.perf_counter()
            step()
            seconds = time.perf_counter() - start
            if with_hooks:
                timer.end_step()
                inside.append(timer.hook_time_s)
                timer.detach()
                hooked.append(seconds)
            else:
                bare.append(seconds)
    return {
        "bare_ms": 1e3 * statistics.median(bare),
        "hooked_ms": 1e3 * statistics.median(hooked),
        "inside_ms": 1e3 * statistics.median(inside),
    }


def after_idle(block: nn.Module, works: Sequence[int], idle_ms: float, rounds: int) -> list[dict[str, float]]:
    """Per amount of work (blocks' worth), the median ms back to back and after an idle, per action."""
    out = []
    x = torch.randn(ROWS, TOKENS, WIDTH, requires_grad=True)

    def action(repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            block(x).sum().backward()
        return time.perf_counter() - start

    action(3)
    for work in works:
        hot, idle = [], []
        for _ in range(rounds):
            action(work)  # untimed: the first action after the last idle
            hot += [action(work) for _ in range(4)]
            for _ in range(4):
                time.sleep(idle_ms / 1e3)
                idle.append(action(work))
        h, i = statistics.median(hot), statistics.median(idle)
        out.append({"work": work, "hot_ms": 1e3 * h, "idle_ms": 1e3 * i, "extra_ms": 1e3 * (i - h)})
    return out


def report(
    args: Any, hook_rows: dict[tuple[str, int], dict[str, float]], idle_rows: list[dict[str, float]]
) -> str:
    lines = [
        f"## The profiler's hooks and the cost after an idle ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{harness.command('hook_cost', args.argv)}`  ",
        f"Hardware: {harness.hardware()}.  ",
        "Figures: **real compute**, one process, one torch thread.",
        "",
        f"### Hooks: a stage's step ({args.microbatches} micro-batches of {ROWS}x{TOKENS} tokens, width "
        f"{WIDTH}; medians over {args.rounds} alternating pairs)",
        "",
        "| model | blocks | without hooks (ms) | with the layer timer (ms) | added | added per block call "
        "(ms) | inside the hooks' bodies (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (model, count), row in hook_rows.items():
        added = row["hooked_ms"] - row["bare_ms"]
        per_call = added / (count * args.microbatches)
        lines.append(
            f"| {model} | {count} | {row['bare_ms']:.1f} | {row['hooked_ms']:.1f} "
            f"| {added / row['bare_ms']:+.1%} | {per_call:.3f} | {row['inside_ms']:.2f} |"
        )
    lines += [
        "",
        f"### After an idle of {args.idle_ms:g} ms: one action of N of our GPT's blocks' forward and "
        f"backward (medians over {args.rounds} rounds of 4)",
        "",
        "| work (blocks) | back to back (ms) | after the idle (ms) | extra (ms) | ratio |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in idle_rows:
        lines.append(
            f"| {row['work']} | {row['hot_ms']:.2f} | {row['idle_ms']:.2f} | {row['extra_ms']:+.2f} "
            f"| {row['idle_ms'] / row['hot_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = harness.argument_parser(__doc__, "2 rounds", "rounds")
    parser.add_argument("--microbatches", type=int, default=4, help="forward and backward calls a step")
    parser.add_argument("--idle-ms", type=float, default=30.0, help="sleep before each after-idle action")
    args = parser.parse_args(argv)
    out = results_path("hook_cost", args.out, args.force)
    args.rounds = args.rounds or (2 if args.quick else 30)
    args.argv = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(1)
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    if cores is not None:
        os.sched_setaffinity(0, {min(cores)})
    try:
        hook_rows = {}
        for model in models():
            stage = blocks(7, model)
            for n in (1, 4, 7):
                hook_rows[model, n] = hooks(stage[:n], args.microbatches, args.rounds)
        idle_rows = after_idle(blocks(1, "gpt")[0], (1, 3, 6), args.idle_ms, args.rounds)
    finally:
        if cores is not None:  # a caller in this process (the tests) gets its cores back
            os.sched_setaffinity(0, cores)
    write_report(report(args, hook_rows, idle_rows), "hook_cost", out)


if __name__ == "__main__":
    main()
