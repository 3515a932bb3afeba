"""Balancing what the head and loss cost: every 2-stage placement of a large-vocabulary GPT, measured.

The GPT of :mod:`lightning_dynmo.models` with a vocabulary large enough that its last-stage parts (final
LayerNorm, vocabulary head and cross-entropy) cost two blocks of work or more trains on a real 2-stage
CPU pipeline (2 gloo ranks, 1F1B, real compute, one torch thread per rank). Runs, each one job started by
torch's elastic launcher, interleaved over ``--rounds`` rounds:

- every fixed contiguous split of the blocks (the candidates; the embedding always sits on stage 0, the
  head and loss on stage 1);
- ``DynMoCallback(every_n_steps=steps // 2 + 1)`` from the uniform split: it profiles the blocks and the
  first/last-stage parts in its one window, decides with both, migrates, and trains on at the placement
  it chose;
- the same callback measuring only at every candidate (``min_gain=0.99``: the same window and decision,
  never applied), so DynMo's steps after its move can be set against its placement with the callback's
  own per-step cost in both.

A run's step time is the median of its steps after ``--skip`` (past the DynMo run's profiling window
and rebalance); ratios are taken within a round (:mod:`benchmarks._lib.harness`), each round's ideal being
the candidate fastest in the other rounds. The report gives every candidate's step time and its paired
ratios to the uniform split and the ideal, names the callback's choice and the block-only optimum
(the exact partition of the same measured block costs without the parts, which is what a head-blind
balancer picks), and the callback's own run. The head's measured cost in blocks comes
from the callback's last window. Its steps after the move are also set against the placement it ended at,
run fixed in the same round, without and with the callback measuring only (issue 19: does a move
deliver its placement's speed?).

    python -m benchmarks.head_cost                # vocabularies 3072 and 6144: ~8 minutes, 2 quiet cores
    python -m benchmarks.head_cost --vocab 3072   # one vocabulary
    python -m benchmarks.head_cost --quick        # a smoke run (tiny sizes, one round): checks it works

Each vocabulary is its own section of the report (the head grows with it: ~2.5 blocks of measured work at
3072, about twice that at 6144).

The report goes to ``benchmarks/results/head_cost-<date>.md`` with the command (``--out`` elsewhere;
an existing dated file is kept unless ``--force``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from benchmarks._lib import harness
from benchmarks._lib.common import StepTimer, benchmark_trainer, results_path
from lightning_dynmo.balancing import BalanceProblem, partition
from lightning_dynmo.balancing.placement import Placement


@dataclass(frozen=True)
class Sizes(harness.ModelSizes):
    """Model and batch sizes of one benchmark mode, with the vocabulary that sets the head's cost."""

    vocab_size: int

    def gpt(self) -> Any:
        from lightning_dynmo.models import GPTConfig

        return GPTConfig(vocab_size=self.vocab_size, **self.shape)


# A block costs ~28 d^2 flops per token forward at seq_len = d (24 d^2 of matmuls, 4 T d of attention),
# the head 2 d V: V = 3072 at d = 64 is ~3.4 blocks of matmul (the profiler measured head + loss at ~1.9
# blocks with V = 2304 on the 2-core VM, so ~2.6 here). Blocks alone balance at 3 | 3; with the head on
# the last stage 4 | 2 (4 vs ~4.6 blocks) should be fastest.
FULL = Sizes.extend(harness.FULL_SIZES, num_layers=6, d_model=64, num_heads=2, vocab_size=3072)
QUICK = Sizes.extend(harness.QUICK_SIZES, seq_len=16, vocab_size=1536)


@dataclass(frozen=True)
class Job:
    """One 2-rank training job."""

    label: str
    sizes: Sizes
    steps: int
    placement: str
    window_at: int = 0  # the DynMo run profiles from this step (every_n_steps: once in the run)
    dynmo: bool = False
    measuring_only: bool = False  # the callback profiles and decides as DynMo's does, but never moves


def train(job: Job) -> dict[str, Any]:
    """Body of one rank (started by the elastic launcher): fit, report rank 0's step times and choice."""
    from lightning_dynmo.callback.dynmo_callback import DynMoCallback
    from lightning_dynmo.demos import RandomTokenDataModule
    from lightning_dynmo.models import GPT
    from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

    torch.set_num_threads(1)
    sizes, timer = job.sizes, StepTimer()
    # No placement gains 99%: measuring only, the callback decides and never moves.
    measuring: dict[str, Any] = {"min_gain": 0.99} if job.measuring_only else {}
    dynmo = DynMoCallback(every_n_steps=job.window_at, **measuring) if job.dynmo else None
    strategy = DynMoStrategy(num_microbatches=sizes.microbatches, schedule="1F1B", placement=job.placement)
    trainer = benchmark_trainer(strategy, [timer] + ([dynmo] if dynmo else []), job.steps)
    data = RandomTokenDataModule(
        batch_size=sizes.batch_size,
        num_samples=sizes.batch_size * job.steps,
        seq_len=sizes.seq_len,
        vocab_size=sizes.vocab_size,
    )
    trainer.fit(GPT(sizes.gpt()), data)
    out: dict[str, Any] = {"step_s": timer.step_s, "placement": str(strategy.placement)}
    if dynmo is not None and dynmo.last_costs is not None and dynmo.last_hardware is not None:
        costs, hardware = dynmo.last_costs, dynmo.last_hardware
        block_s = statistics.fmean(c.time_s for c in costs)
        last = hardware.last_stage_extra
        first = hardware.first_stage_extra
        out["block_only"] = str(partition(BalanceProblem(costs), 2))
        out["head_blocks"] = last.time_s / block_s if last is not None else float("nan")
        out["embedding_blocks"] = first.time_s / block_s if first is not None else float("nan")
        out["decisions"] = [
            f"{r.new} ({'applied' if r.applied else 'not applied'}: {r.why})" for r in dynmo.rebalances
        ]
    return out


def candidates(num_layers: int) -> list[str]:
    """Every contiguous 2-stage split of ``num_layers`` blocks (at least one block per stage)."""
    return [str(Placement.from_sizes([n, num_layers - n])) for n in range(1, num_layers)]


def compare(sizes: Sizes, steps: int, skip: int, rounds: int, window_at: int) -> dict[str, Any]:
    """Every candidate and the DynMo run in interleaved rounds (:mod:`benchmarks._lib.harness`), compared."""
    half = sizes.num_layers // 2
    uniform = str(Placement.from_sizes([half, sizes.num_layers - half]))
    jobs = {f"fixed `{p}`": Job(f"fixed `{p}`", sizes, steps, p) for p in candidates(sizes.num_layers)}
    label = f"DynMoCallback(every_n_steps={window_at}) from {uniform}"
    jobs[label] = Job(label, sizes, steps, uniform, window_at=window_at, dynmo=True)
    for p in candidates(sizes.num_layers):  # the callback's own cost, at every placement DynMo may end at
        name = f"measuring only `{p}`"
        jobs[name] = Job(name, sizes, steps, p, window_at=window_at, dynmo=True, measuring_only=True)
    runs = harness.run_rounds(jobs, train, rounds, "head_cost", start_method="fork")
    per_round = {name: harness.step_ms(reports, skip) for name, reports in runs.items()}
    fixed = [name for name, job in jobs.items() if not job.dynmo]
    comparison = harness.compare_runs(per_round, [f"fixed `{uniform}`"], [label], fixed)
    dynmo_reports = runs[label]
    chosen = [str(r["placement"]) for r in dynmo_reports]
    return {
        "rows": harness.rows_of(runs, per_round),
        "comparison": comparison,
        "chosen": chosen,
        # Issue 19: DynMo's steps after its move / the placement it ended at, run fixed in the same round.
        "after_move": [per_round[label][i] / per_round[f"fixed `{p}`"][i] for i, p in enumerate(chosen)],
        # ... and against it run with the callback measuring only (what the callback costs by itself).
        "after_move_measuring": [
            per_round[label][i] / per_round[f"measuring only `{p}`"][i] for i, p in enumerate(chosen)
        ],
        "block_only": [r.get("block_only", "?") for r in dynmo_reports],
        "head_blocks": [r.get("head_blocks", float("nan")) for r in dynmo_reports],
        "embedding_blocks": [r.get("embedding_blocks", float("nan")) for r in dynmo_reports],
        "decisions": [d for r in dynmo_reports for d in r.get("decisions", [])],
    }


def _quoted(placements: Sequence[str]) -> str:
    return ", ".join(f"`{p}`" for p in placements)


def table(result: dict[str, Any]) -> str:
    """The paired table and verdict, then the callback's choice against the block-only optimum."""
    comparison = result["comparison"]
    ideals = [p.removeprefix("fixed `").removesuffix("`") for p in comparison.ideal]
    verdict, _ = harness.verdict(comparison)
    head = ", ".join(f"{h:.2f}" for h in result["head_blocks"])
    emb = ", ".join(f"{e:.2f}" for e in result["embedding_blocks"])
    after = ", ".join(f"{r:.3f}" for r in result["after_move"])
    measuring = ", ".join(f"{r:.3f}" for r in result["after_move_measuring"])
    return "\n".join(
        [
            *harness.table(result["rows"], comparison),
            "",
            *verdict,
            "Ideal per round (the fastest candidate of the other rounds; with one round, of that round): "
            f"{_quoted(ideals)}. DynMo's choice per round: {_quoted(result['chosen'])}; the block-only "
            f"optimum of the same measured costs: {_quoted(sorted(set(result['block_only'])))}.",
            "",
            "After the move (issue 19): DynMo's step / the step of the placement it ended at, run fixed "
            f"without a callback in the same round: {after} (per round), median "
            f"**{statistics.median(result['after_move']):.3f}**; against it run with "
            f"`DynMoCallback(min_gain=0.99)` measuring only (the same window, no move): {measuring}, "
            f"median **{statistics.median(result['after_move_measuring']):.3f}**.",
            "",
            f"Measured by the callback (per round): head + loss = {head} blocks, embedding = {emb} blocks.",
            "",
            "Decisions of the DynMo runs: " + ("; ".join(result["decisions"]) or "none") + ".",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)  # the ranks are forked from this process (common.launch)
    parser = harness.argument_parser(__doc__, "tiny sizes and one round", "steps", "skip", "rounds")
    parser.add_argument("--vocab", type=int, nargs="+", default=None, help="vocabulary sizes (full mode)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    steps = args.steps or (18 if args.quick else 40)
    # One profiling window in the DynMo run (from steps // 2 + 1: every_n_steps then fires once), then
    # its decision and the gain window: the measured steps all run at the placement it chose.
    window_at = steps // 2 + 1
    skip = args.skip if args.skip is not None else window_at + 6
    rounds = args.rounds or (1 if args.quick else 5)
    vocabs = [QUICK.vocab_size] if args.quick else (args.vocab or [FULL.vocab_size, 2 * FULL.vocab_size])
    if any(v < 2 for v in vocabs):
        parser.error(f"--vocab {vocabs}: every vocabulary size must be at least 2")
    if skip + 2 > steps or window_at < 2:
        parser.error("--steps must leave at least 2 measured steps after --skip, and be >= 2")
    out = results_path("head_cost", args.out, args.force)
    started = time.perf_counter()
    setup = (
        f"GPT: {sizes.num_layers} blocks, d_model {sizes.d_model}, {sizes.num_heads} heads, seq_len "
        f"{sizes.seq_len}; batch {sizes.batch_size}, {sizes.microbatches} micro-batches, 1F1B on 2 CPU "
        "ranks (gloo, one thread each)."
    )
    sections = [
        harness.header("Head- and embedding-aware balancing", "head_cost", argv, [harness.REAL]),
        setup,
    ]
    for vocab in vocabs:
        result = compare(replace(sizes, vocab_size=vocab), steps, skip, rounds, window_at)
        sections += [
            f"### Vocabulary {vocab}: every 2-stage placement, measured ({rounds} interleaved rounds, "
            f"{steps} steps per run, medians of steps {skip}+)",
            table(result),
        ]
    harness.finish("head_cost", out, sections, started)


if __name__ == "__main__":
    main()
