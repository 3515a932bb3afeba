"""One benchmark harness: jobs run in rotated interleaved rounds, compared by paired ratios, reported.

Read in this order: :class:`ModelSizes` (a mode's sizes, as data), :func:`run_rounds` (the one loop every
measured comparison runs), :func:`step_ms` (a job's figure per round), :func:`compare_runs` (the one
statistic, :func:`benchmarks._lib.paired.compare`: ratios within a round, the ideal held out of the round it
judges), :func:`table` and :func:`verdict` (how a comparison is written), :func:`compare_placements` (all
of it for fixed 2-stage splits against DynMo, jobs of :func:`benchmarks._lib.gpt_pipeline.run_job` built by
:func:`fixed_job`), then the report: :func:`argument_parser` (the options every script shares),
:func:`header` (what every report starts with) and :func:`finish` (how it ends and is written).

Every figure a report shows carries one of three labels: :data:`REAL` (the model's real blocks computed
on this machine), :data:`EMULATED` (blocks that sleep a measured or chosen cost) or :data:`PROJECTED`
(the pipeline simulator fed measured costs). An ideal computed from known emulated costs (the exact
partition) is not chosen by measurement: it is compared with ``held_out=False`` and labelled so.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Self, TypeVar

import torch

from benchmarks._lib import paired
from benchmarks._lib.common import launch, write_report
from benchmarks._lib.gpt_pipeline import JobSpec, run_job
from lightning_dynmo.balancing import Placement
from lightning_dynmo.models import GPTConfig, OptimizerConfig

J = TypeVar("J")

REAL = "real compute"
EMULATED = "emulated"
PROJECTED = "projected"
LABELS = (REAL, EMULATED, PROJECTED)
IMBALANCE_GAP = 0.05  # a static split within 5% of the ideal (at the median) is "not imbalanced"


@dataclass(frozen=True)
class ModelSizes:
    """A GPT's shape and how a step feeds it: what each benchmark mode (full, ``--quick``) chooses.

    Scripts subclass it with their own fields (a case's experts, a run's steps) and build their modes
    from :data:`FULL_SIZES` and :data:`QUICK_SIZES` with :meth:`extend`.
    """

    num_layers: int
    d_model: int
    num_heads: int
    seq_len: int
    batch_size: int
    microbatches: int

    @property
    def shape(self) -> dict[str, int]:
        """The GPT's shape keywords (``GPTConfig`` and the ready case configurations take them)."""
        return {k: getattr(self, k) for k in ("num_layers", "d_model", "num_heads", "seq_len")}

    @property
    def rows(self) -> int:
        """Tokens of one micro-batch: what a Linear multiplies per call."""
        return self.batch_size // self.microbatches * self.seq_len

    @classmethod
    def extend(cls, base: ModelSizes, **changes: Any) -> Self:
        """``base``'s sizes with ``changes`` (and the subclass's own fields)."""
        return cls(**{**asdict(base), **changes})


FULL_SIZES = ModelSizes(num_layers=8, d_model=128, num_heads=4, seq_len=64, batch_size=8, microbatches=4)
QUICK_SIZES = ModelSizes(num_layers=4, d_model=32, num_heads=2, seq_len=32, batch_size=4, microbatches=2)


def rotated(names: Sequence[str], round_index: int) -> list[str]:
    """Round ``r``'s job order: the list started at job ``r``, so every job takes every slot in turn."""
    shift = round_index % len(names) if names else 0
    return [*names[shift:], *names[:shift]]


def run_rounds(
    jobs: Mapping[str, J],
    body: Callable[[J], dict[str, Any]],
    rounds: int,
    tag: str,
    *,
    nproc: int = 2,
    start_method: str = "spawn",
    log: Callable[[dict[str, Any]], Sequence[str]] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Launch every job once per round, in :func:`rotated` order; per job, rank 0's report of each round.

    Each job is a fresh ``nproc``-rank launch (:func:`benchmarks._lib.common.launch`, ranks pinned to cores
    where there are enough): timing placements one after the other inside one job favours the later ones.

    Args:
        jobs: Per job name, the spec ``body`` runs.
        body: The body of each rank (module level, so spawned ranks can import it).
        rounds: How many times each job runs.
        tag: Prefix of the progress lines (stderr).
        nproc: Ranks per job.
        start_method: ``"spawn"`` or ``"fork"`` (see :func:`benchmarks._lib.common.launch`).
        log: Lines worth printing after a job (its decisions, say).
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: a comparison needs at least 1 round; pass --rounds 1 or more")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in jobs}
    for r in range(rounds):
        for name in rotated(list(jobs), r):
            print(f"[{tag}] round {r + 1}/{rounds}: {name} ...", file=sys.stderr, flush=True)
            run = launch(body, jobs[name], nproc=nproc, start_method=start_method)
            runs[name].append(run)
            for line in log(run) if log is not None else ():
                print(f"    {line}", file=sys.stderr)
    return runs


def step_ms(runs: Sequence[dict[str, Any]], skip: int) -> list[float]:
    """Per round, the median step time (ms) of a job's steps after the first ``skip``."""
    return [1e3 * statistics.median(run["step_s"][skip:]) for run in runs]


def compare_runs(
    per_round: Mapping[str, Sequence[float]],
    statics: Sequence[str],
    dynmo: Sequence[str],
    candidates: Sequence[str],
    *,
    held_out: bool = True,
    gap: float = IMBALANCE_GAP,
) -> paired.PairedComparison:
    """The paired comparison of the named runs of ``per_round`` (see :func:`.paired.compare`)."""
    return paired.compare(
        statics={k: per_round[k] for k in statics},
        dynmo={k: per_round[k] for k in dynmo},
        candidates={k: per_round[k] for k in candidates},
        gap=gap,
        held_out=held_out,
    )


def rows_of(
    runs: Mapping[str, Sequence[dict[str, Any]]], per_round: Mapping[str, Sequence[float]]
) -> dict[str, dict[str, Any]]:
    """Table rows of measured jobs: median over rounds, per-round figures, placements, DynMo's work."""
    rows: dict[str, dict[str, Any]] = {}
    for name, reports in runs.items():
        row: dict[str, Any] = {
            "ms": statistics.median(per_round[name]),
            "per_round": list(per_round[name]),
            "placement": ", ".join(dict.fromkeys(str(r["placement"]) for r in reports)),
        }
        if any(r.get("rebalances") or r.get("overhead_s") for r in reports):  # DynMo's work
            row["rebalances"] = [r.get("rebalances", len(r.get("moved_to", []))) for r in reports]
            row["overhead_s"] = [r["overhead_s"] for r in reports if "overhead_s" in r]
        rows[name] = row
    return rows


def _ratios(values: Sequence[float], digits: int = 2) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def table(
    rows: Mapping[str, Mapping[str, Any]], comparison: paired.PairedComparison | None = None
) -> list[str]:
    """Median step of each run and its ratios to the better static run and the ideal.

    With a comparison (measured figures) the ratio columns are medians of per-round ratios against the
    better static run and the ideal of the same round (held out of it where chosen by measurement);
    without one (projected figures, one value per run), ratios of the single figures, the ideal being the
    ``ideal`` row (computed, not measured).
    """

    def ratio(base: Sequence[float] | float, row: Mapping[str, Any]) -> float:
        if isinstance(base, float):
            return base / float(row["ms"])
        return float(statistics.median(b / t for b, t in zip(base, row["per_round"], strict=True)))

    static: Sequence[float] | float
    ideal: Sequence[float] | float
    if comparison is not None:
        static, ideal = comparison.static_ms, comparison.ideal_ms
    else:
        static = min(rows["static uniform"]["ms"], rows["static params"]["ms"])
        ideal = float(rows["ideal"]["ms"])
    out = [
        "| run | step (ms) | better static / run | run achieves of ideal | placement | rebalances "
        "| DynMo cost (s) |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for name, row in rows.items():
        rebalances = ", ".join(str(n) for n in row.get("rebalances", [])) or "-"
        overhead = ", ".join(f"{s:.2f}" for s in row.get("overhead_s", [])) or "-"
        out.append(
            f"| {name} | {row['ms']:.1f} | {ratio(static, row):.2f} | {ratio(ideal, row):.0%} "
            f"| `{row['placement']}` | {rebalances} | {overhead} |"
        )
    return out


def verdict(comparison: paired.PairedComparison, gap: float = IMBALANCE_GAP) -> tuple[list[str], bool | None]:
    """Paired ratios against the better static split and the ideal; ``None`` when not imbalanced.

    Every ratio is a median over rounds of a ratio taken within one round (see :mod:`benchmarks._lib.paired`).
    """
    c = comparison
    ideal = "the ideal held out of each round" if c.held_out else "the ideal"
    source = (
        "each round's ideal: the candidate fastest in the other rounds"
        if c.held_out
        else "the ideal is not chosen by measurement here: computed from known costs, or one round only"
    )
    lines = [
        f"Better static split ({c.static}) / ideal: {statistics.median(c.imbalance):.2f}x. "
        f"Best DynMo variant ({c.best}): **{c.median_speedup():.2f}x** the better static split, "
        f"**{c.median_of_ideal():.0%}** of the ideal (medians over {c.rounds} round(s) of ratios "
        f"taken within a round; {source}).",
    ]
    if c.rounds > 1:
        lines += [
            f"Per round: better static / ideal {_ratios(c.imbalance)}; better static / {c.best} "
            f"{_ratios(c.speedup[c.best])}; ideal / {c.best} {_ratios(c.of_ideal[c.best])}; "
            f"{ideal}: {', '.join(f'`{p}`' for p in c.ideal)}.",
        ]
    slower = (
        f" DynMo ({c.best}) is slower than the better static split in every one of {c.rounds} rounds: "
        "**slower beyond noise**."
        if c.slower_beyond_noise()
        else ""
    )
    if not c.imbalanced:
        return [
            *lines,
            f"Not imbalanced here: the better static split is not slower than {ideal} in every round by "
            f"more than {gap:.0%} at the median.{slower}",
        ], None
    ok = c.meets_target()
    return [
        *lines,
        f"Imbalanced (slower than {ideal} in every round); DynMo >= 1.0x the better static and >= 90% "
        f"of the ideal: **{'yes' if ok else 'NO'}**.{slower}",
    ], ok


def comparison_section(
    runs: Mapping[str, Sequence[dict[str, Any]]],
    per_round: Mapping[str, Sequence[float]],
    comparison: paired.PairedComparison,
) -> str:
    """A measured comparison as a report section: its table, then its verdict."""
    verdict_lines, _ = verdict(comparison)
    return "\n".join([*table(rows_of(runs, per_round), comparison), "", *verdict_lines])


def fixed_job(
    sizes: ModelSizes, config: GPTConfig, steps: int, optimizer: OptimizerConfig, **extra: Any
) -> JobSpec:
    """A ``fixed`` job of ``config`` fed ``sizes``' batches: the base :func:`compare_placements` varies.

    Args:
        sizes: Batch rows and micro-batches.
        config: The GPT.
        steps: Steps of every job.
        optimizer: Its learning rate and weight decay (a rate that learns, unless the case needs it still).
        extra: Further :class:`~benchmarks._lib.gpt_pipeline.JobSpec` fields (the case's callbacks, its data).
    """
    return JobSpec(
        kind="fixed",
        config=config,
        steps=steps,
        batch_size=sizes.batch_size,
        num_microbatches=sizes.microbatches,
        lr=optimizer.lr,
        weight_decay=optimizer.weight_decay,
        **extra,
    )


def two_stage_splits(num_layers: int, spread: int, below: int | None = None) -> list[str]:
    """The 2-stage splits whose first stage holds from ``below`` (default ``spread``) blocks fewer than
    half to ``spread`` blocks more, at least one block per stage."""
    half = num_layers // 2
    low = half - (spread if below is None else below)
    return [
        str(Placement.from_sizes([k, num_layers - k]))
        for k in range(max(1, low), min(num_layers - 1, half + spread) + 1)
    ]


#: The DynMo variant most comparisons run: ``DynMoCallback(balancer="partition", cost="time")``.
PARTITION_TIME: dict[str, dict[str, Any]] = {
    "DynMo partition/time": {"balancer": "partition", "cost": "time"}
}

#: Prefix of the jobs that run a fixed split with the callback attached, measuring only.
MEASURING = "measuring only, at "


def compare_placements(
    base: JobSpec,
    static: str,
    candidates: Sequence[str],
    dynmo: Mapping[str, dict[str, Any]],
    rounds: int,
    skip: int,
    tag: str,
    static_label: str = "static uniform",
    after_move: bool = False,
) -> str:
    """A real-compute 2-stage comparison as a report section: fixed splits and DynMo variants, in rounds.

    One :func:`~benchmarks._lib.gpt_pipeline.run_job` job per fixed split (``static`` under ``static_label``,
    every other candidate as ``fixed <placement>``) and per DynMo variant (starting at ``static``), all
    ``base`` otherwise; each round's ideal is the fixed split fastest in the other rounds.

    Args:
        base: The job every run shares (model, steps, batches, the case's own callbacks).
        static: The static split (a candidate of the ideal too).
        candidates: The fixed splits the ideal is chosen among.
        dynmo: Per DynMo variant's label, its ``DynMoCallback`` keywords.
        rounds: Interleaved rounds.
        skip: Steps of each job not measured (start-up, the dynamism settling).
        tag: Prefix of the progress lines.
        static_label: The static split's row.
        after_move: Also run every fixed split with ``DynMoCallback(balancer="static")`` attached (it
            profiles and measures as DynMo does, never moves; not a candidate of the ideal), and report
            whether a move delivers its placement's speed: per DynMo variant, its steps against the
            same placement run fixed, with and without the callback (:func:`after_move_lines`).
    """
    fixed = {static_label: static, **{f"fixed {p}": p for p in candidates if p != static}}
    jobs = {name: replace(base, kind="fixed", placement=p) for name, p in fixed.items()}
    jobs |= {name: replace(base, kind="dynmo", placement=static, callback=kw) for name, kw in dynmo.items()}
    if after_move:
        jobs |= {
            f"{MEASURING}{p}": replace(base, kind="dynmo", placement=p, callback={"balancer": "static"})
            for p in fixed.values()
        }
    runs = run_rounds(jobs, run_job, rounds, tag, start_method="fork")
    per_round = {name: step_ms(reports, skip) for name, reports in runs.items()}
    comparison = compare_runs(per_round, [static_label], list(dynmo), list(fixed))
    section = comparison_section(runs, per_round, comparison)
    if not after_move:
        return section
    return "\n".join([section, "", *after_move_lines(runs, per_round, fixed, list(dynmo))])


def after_move_lines(
    runs: Mapping[str, Sequence[dict[str, Any]]],
    per_round: Mapping[str, Sequence[float]],
    fixed: Mapping[str, str],
    dynmo: Sequence[str],
) -> list[str]:
    """Whether a move delivers its placement's speed: each DynMo variant's measured steps over those of
    the placement it ended at, run fixed (no callback) and run with the callback measuring only, in the
    same round; medians of the per-round ratios (a round where DynMo ended elsewhere is left out)."""
    by_placement = {p: name for name, p in fixed.items()}
    lines = [
        "**After the move** (issue 19: a move must deliver its placement's speed): DynMo's step / the same "
        "placement's step in the same round, fixed without a callback and fixed with "
        '`DynMoCallback(balancer="static")` measuring only (what the callback costs by itself).',
        "",
        "| DynMo variant | rounds at one placement | / fixed, per round | median "
        "| / measuring only, per round | median |",
        "|---|---|---|---:|---|---:|",
    ]
    for name in dynmo:
        plain, measured = [], []
        for i, report in enumerate(runs[name]):
            placement = str(report["placement"])
            if placement not in by_placement:
                continue
            plain.append(per_round[name][i] / per_round[by_placement[placement]][i])
            measured.append(per_round[name][i] / per_round[f"{MEASURING}{placement}"][i])
        ends = ", ".join(dict.fromkeys(f"`{r['placement']}`" for r in runs[name]))
        if not plain:
            lines.append(f"| {name} | none (ended at {ends}, not a fixed split here) | - | - | - | - |")
            continue
        lines.append(
            f"| {name} ({ends}) | {len(plain)} of {len(runs[name])} | {_ratios(plain, 3)} "
            f"| {statistics.median(plain):.3f} | {_ratios(measured, 3)} | {statistics.median(measured):.3f} |"
        )
    return lines


OPTIONS = {  # the options several benchmarks share (default None: the mode's, --quick or full)
    "rounds": "interleaved rounds of the measured jobs",
    "steps": "steps per job",
    "skip": "first steps of a job not measured",
    "settle": "steps after the dynamism's change not measured",
    "measure": "measured steps per job",
    "repeats": "timed repeats of each micro-measurement",
    "spread": "fixed 2-stage candidates within this many layers of uniform",
}


def argument_parser(doc: str | None, quick: str, *options: str) -> argparse.ArgumentParser:
    """A benchmark's parser: ``--quick`` (a smoke run, help ``quick``), ``options``, ``--out``, ``--force``.

    Raises:
        ValueError: if an option is not one of :data:`OPTIONS` (add it there, or to the script's parser).
    """
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        raise ValueError(f"options {unknown} are not shared ones {sorted(OPTIONS)}; add them in the script")
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"smoke run, not figures: {quick}")
    for name in options:
        parser.add_argument(f"--{name}", type=int, default=None, help=OPTIONS[name])
    parser.add_argument("--out", type=Path, default=None, help="report path (default: dated results file)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing report")
    return parser


def command(script: str, argv: Sequence[str] | None) -> str:
    """The command line that reproduces this run (``argv`` as given, else this process's)."""
    args = list(argv) if argv is not None else sys.argv[1:]
    return f"python -m benchmarks.{script} {shlex.join(args)}".strip()


def hardware() -> str:
    """One line about the machine: CPU cores, processor, torch and its threads, the load at start."""
    load = os.getloadavg()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} CPU cores ({platform.machine()} {platform.processor()}".rstrip()
        + f"), {gpu}, torch {torch.__version__}, load average at start "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min)"
    )


def header(title: str, script: str, argv: Sequence[str] | None, labels: Sequence[str]) -> str:
    """A report's opening lines: title and date, the command, the hardware, the kind of figures.

    Raises:
        ValueError: if a label is not one of :data:`LABELS`.
    """
    unknown = [label for label in labels if label not in LABELS]
    if unknown or not labels:
        raise ValueError(f"labels {list(labels)}: each must be one of {LABELS}; name at least one")
    return "\n".join(
        [
            f"## {title} ({dt.date.today().isoformat()})",
            "",
            f"Command: `{command(script, argv)}`  ",
            f"Hardware: {hardware()}.  ",
            f"Figures: {', '.join(f'**{label}**' for label in labels)}.",
        ]
    )


def rounds_note(rounds: int, steps: int, skip: int) -> str:
    """How a measured section's jobs ran, for its heading."""
    return f"{rounds} interleaved rounds, {steps} steps per run, medians of steps {skip}+"


def finish(name: str, out: Path, sections: Sequence[str], started: float) -> Path:
    """Join a report's sections, end it with the wall time since ``started``, print and write it."""
    wall = f"Wall time of the whole benchmark: {time.perf_counter() - started:.0f} s."
    return write_report("\n\n".join([*sections, wall]), name, out)
