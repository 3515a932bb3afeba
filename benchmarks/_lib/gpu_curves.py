"""Per-step costs at the paper's shape from a GPU kernel check's cost curves (``kernels.json``).

``python -m lightning_dynmo.gpu_check.kernels`` times, per micro-batch at the paper's GPT shape, each
case's block forward + backward at measured values of its statistic, the head + loss and the embedding
(the ``cost_curves`` part, read by :func:`~lightning_dynmo.gpu_check.kernels.curves.read_cost_curves`).
:func:`gpu_cost_trace` turns a trace's statistics into per-step costs through those curves:

- **Statistic mapping** (:data:`CURVE_OF`, trace case -> the JSON's curve and its statistic): ``mod``
  (tokens sent through the routed block / sequence tokens) -> ``mod`` at ``processed_fraction``;
  ``early_exit`` (tokens still active in the layer) -> ``early_exit`` at ``active_fraction``;
  ``sparse_attention`` (active tile pairs / causal tile pairs) -> ``sparse_attention`` at
  ``active_fraction`` (the fraction as recorded, not re-derived for the paper's sequence length);
  ``dense`` -> ``dense_and_freezing`` at ``trainable_fraction`` 1; ``synthetic`` (the quick mode's
  MoD-like stand-in) -> ``mod``. MoD's even layers (dense blocks between the routed ones) cost the dense
  block, and so does every layer of the model without the dynamism (a ``StatisticTrace.uniform``
  trace, its case renamed ``"<case> (no dynamism)"``). **Freezing** (AutoFreeze, front to back: a frozen
  block sits in a prefix and runs no backward at all) takes the dense block's forward and ``value`` x its
  backward; the curve's frozen point (forward + the input's gradient) is not what a frozen prefix costs,
  so it is not used. **MoE and pruning** have no curve in the part: the dense block times the case's
  stand-in curve of :data:`benchmarks._lib.trace_cases.CASES` (MoE: proportional to busiest / mean load;
  pruning: the linear weights' multiply-add share scales with the density); the label says so.
- **Split rule**: the curves record forward + backward totals only, so every measured total (block, head
  + loss, embedding) is split forward : backward = 1 : 2, the multiply-add rule (a backward computes the
  input's and the weights' gradients, each as many multiply-adds as the forward). The JSON has no
  forward-only measurement to take a ratio from (its frozen point still runs the input's gradient).
- **Head**: the head + loss as measured (GPT-2's 50,257 columns), or with ``head`` =
  ``"head_and_loss_padded_vocab"`` the same padded to a multiple of 128 (:data:`HEADS`). Early exit's
  exit heads follow: padded, the ``early_exit_padded_vocab`` curve (:data:`PADDED_CURVE`), in JSONs that
  have it; an older JSON's early-exit curve has only unpadded exit heads, and the trace's label says
  which it took.
- **Range**: a value outside a curve's measured range is refused (:class:`ValueError` naming the case,
  the layer, the value and the range), or with ``clamp`` set to the nearest measured end, counted in the
  trace's label.

Seconds per step = milliseconds per micro-batch x 1e-3 x the micro-batch count
(:func:`gpu_cost_trace`); :func:`relative_cost_trace` gives the same costs in units of the dense block's
forward, for :mod:`benchmarks.replay` (which scales a dense block to its own ``--block-ms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._lib.trace_cases import CASES, DENSE_FWD
from lightning_dynmo.balancing import LayerCost
from lightning_dynmo.balancing.trace import CostTrace, StatisticTrace, StepCosts
from lightning_dynmo.gpu_check.kernels.curves import CostCurve, read_cost_curves

__all__ = [
    "CURVE_OF",
    "DENSE_CURVE",
    "FWD_SHARE",
    "HEADS",
    "PADDED_CURVE",
    "KernelCosts",
    "add_kernel_arguments",
    "gpu_cost_trace",
    "kernels_from_args",
    "read_kernels",
    "relative_cost_trace",
]

#: Trace case -> (the JSON's curve, the statistic it must be measured against); ``None``: no curve.
CURVE_OF: dict[str, tuple[str, str] | None] = {
    "mod": ("mod", "processed_fraction"),
    "synthetic": ("mod", "processed_fraction"),
    "early_exit": ("early_exit", "active_fraction"),
    "sparse_attention": ("sparse_attention", "active_fraction"),
    "freezing": ("dense_and_freezing", "trainable_fraction"),
    "dense": ("dense_and_freezing", "trainable_fraction"),
    "moe": None,
    "pruning": None,
}
DENSE_CURVE = "dense_and_freezing"
#: The head + loss as measured (GPT-2's 50,257 columns), and with the vocabulary padded to a multiple of
#: 128 (Megatron-LM's default, the paper's code base): the kernel check times both.
HEADS = ("head_and_loss", "head_and_loss_padded_vocab")
#: With the padded head, a curve whose blocks hold a vocabulary-wide head of their own -> that curve with
#: the head padded as well (in JSONs from the kernel check that times it).
PADDED_CURVE = {"early_exit": "early_exit_padded_vocab"}
#: A measured forward + backward total's forward share (forward : backward = 1 : 2 by multiply-adds).
FWD_SHARE = 1 / 3
#: The paper's shape (d_model, sequence, sequences per micro-batch) a JSON is checked against.
PAPER = {"d_model": 1024, "seq_len": 2048, "micro_batch": 2}


@dataclass(frozen=True)
class KernelCosts:
    """A kernel check's cost curves and parts, in milliseconds per micro-batch (forward + backward).

    Attributes:
        curves: The block curves by name (:func:`read_cost_curves`).
        head_ms: The head + loss's forward + backward.
        embedding_ms: The embedding's forward + backward.
        device: The device the JSON records.
        file: The JSON's path as given.
        shape: The JSON's shape record.
        head: Which head + loss :attr:`head_ms` is (one of :data:`HEADS`).
    """

    curves: dict[str, CostCurve]
    head_ms: float
    embedding_ms: float
    device: str
    file: str
    shape: dict[str, object]
    head: str = HEADS[0]

    @property
    def dense_ms(self) -> float:
        """A trainable dense block's forward + backward."""
        return self.curves[DENSE_CURVE].ms_at(1.0)

    @property
    def label(self) -> str:
        """Where the costs come from, the split rule and the shape (flagged when not the paper's)."""
        paper = all(self.shape.get(k) == v for k, v in PAPER.items())
        shape = ", ".join(f"{k} {self.shape.get(k)}" for k in (*PAPER, "dtype"))
        return (
            f"GPU cost curves ({self.device}, {self.file}); shape {shape}"
            f"{'' if paper else ' (NOT the paper shape: not figures)'}; dense block {self.dense_ms:.3f} ms, "
            f"head + loss {self.head_ms:.3f} ms ({self._head_words}), embedding {self.embedding_ms:.3f} ms "
            "forward + backward per micro-batch, each split forward : backward = 1 : 2 (multiply-adds; "
            "the JSON records totals only); MoE and pruning: the dense block x their stand-in curves (no "
            "GPU curve); freezing: a frozen prefix block runs the dense forward only"
        )

    @property
    def _head_words(self) -> str:
        if self.head == HEADS[0]:
            return f"vocabulary {self.shape.get('vocab_size')}"
        return f"vocabulary padded to a multiple of 128, {self.shape.get('vocab_size')} real"


def read_kernels(path: Path | str, head: str = HEADS[0]) -> KernelCosts:
    """The cost curves and the head + loss and embedding of ``path`` (a ``kernels.json``).

    Args:
        path: The kernel check's JSON.
        head: Which head + loss to take (one of :data:`HEADS`; the padded one only in JSONs from
            ``1c14e37`` on).

    Raises:
        ValueError: an unknown ``head``; no measured cost curves, no dense curve, or no timed head + loss
            or embedding.
    """
    if head not in HEADS:
        raise ValueError(f"head={head!r} is not one of {HEADS}.")
    curves = read_cost_curves(path)
    if DENSE_CURVE not in curves:
        raise ValueError(f"{path}: cost_curves has no {DENSE_CURVE!r} curve; rerun the kernel check.")
    report = json.loads(Path(path).read_text())
    parts = report["parts"]["cost_curves"]["result"].get("head_loss_and_embedding", {})
    timed = parts.get("timed", {})
    for name in (head, "embedding"):
        if name not in timed:
            raise ValueError(
                f"{path}: cost_curves.head_loss_and_embedding has no timed {name!r} "
                f"(failed: {parts.get('failed', {}).get(name, 'missing')}); rerun the kernel check."
            )
    device = next(iter(curves.values())).device
    return KernelCosts(
        curves,
        float(timed[head]["median_ms"]),
        float(timed["embedding"]["median_ms"]),
        device,
        str(path),
        dict(report.get("shape", {})),
        head,
    )


def _split(total_ms: float, microbatches: int, bwd_share: float = 1.0) -> LayerCost:
    s = total_ms * 1e-3 * microbatches
    return LayerCost(fwd_time_s=FWD_SHARE * s, bwd_time_s=(1 - FWD_SHARE) * s * bwd_share)


def _at(curve: CostCurve, case: str, layer: int, step: int, value: float, clamp: bool, file: str) -> float:
    lo, hi = curve.points[0][0], curve.points[-1][0]
    if lo <= value <= hi:
        return curve.ms_at(value)
    if clamp:
        return curve.ms_at(min(hi, max(lo, value)))
    raise ValueError(
        f"case {case!r}, layer {layer}, step {step}: {curve.statistic} = {value} is outside the "
        f"{curve.case!r} curve's measured range [{lo}, {hi}] in {file}; measure that value (rerun the "
        "kernel check with it) or pass --clamp-curves to clamp to the range (the label says so)."
    )


def gpu_cost_trace(
    stats: StatisticTrace,
    kernels: KernelCosts,
    microbatches: int,
    clamp: bool = False,
    num_params: Sequence[int] | None = None,
) -> CostTrace:
    """Per-step costs of ``stats`` through ``kernels``'s curves (see the module for the rules).

    Args:
        stats: The statistics, one value per layer and row (a dense-model trace: ``stats.uniform``).
        kernels: The kernel check's costs (:func:`read_kernels`).
        microbatches: Micro-batches per step (each costs what the JSON measured per micro-batch).
        clamp: Clamp values outside a curve's measured range to its ends (``False``: refuse them).
        num_params: Parameters per layer (the static parameter split); ``None``: all alike.

    Raises:
        ValueError: an unknown case, a curve missing or measured against another statistic, or a value
            outside the measured range without ``clamp``.
    """
    case = stats.case.split(" ")[0]  # ``StatisticTrace.uniform`` appends to the case's name
    if case not in CURVE_OF:
        raise ValueError(f"case {case!r} has no GPU cost-curve mapping; known: {sorted(CURVE_OF)}.")
    target = CURVE_OF[case]
    curve, exit_heads = None, ""
    if target is not None:
        name, statistic = target
        if kernels.head == HEADS[1] and name in PADDED_CURVE:
            padded = PADDED_CURVE[name] in kernels.curves
            name = PADDED_CURVE[name] if padded else name
            exit_heads = (
                "; exit heads padded as the head"
                if padded
                else f"; exit heads unpadded ({kernels.file} has no {PADDED_CURVE[name]!r} curve)"
            )
        curve = kernels.curves.get(name)
        if curve is None or curve.statistic != statistic:
            found = "missing" if curve is None else f"measured against {curve.statistic!r}"
            raise ValueError(
                f"case {case!r} needs the {name!r} curve against {statistic!r} in {kernels.file} ({found}); "
                "rerun the kernel check's cost_curves part."
            )
    dense_ms, standin = kernels.dense_ms, CASES[case].curve()
    odd_only, m, clamped = CASES[case].odd_layers_only, microbatches, 0
    no_dynamism = stats.case != case  # ``StatisticTrace.uniform``'s trace: the dense model
    params = list(num_params) if num_params is not None else [1] * stats.num_layers
    rows = []
    for step, values in zip(stats.steps, stats.values, strict=True):
        layers = []
        for i, v in enumerate(values):
            if no_dynamism or case in ("freezing", "dense") or (odd_only and i % 2 == 0):
                cost = _split(dense_ms, m, bwd_share=v if case == "freezing" else 1.0)
            elif curve is None:  # the dense block x the stand-in (dense-forward units, backward 2x)
                f, b = standin.at(v)
                cost = LayerCost(
                    fwd_time_s=f * FWD_SHARE * dense_ms * 1e-3 * m,
                    bwd_time_s=b * FWD_SHARE * dense_ms * 1e-3 * m,
                )
            else:
                lo, hi = curve.points[0][0], curve.points[-1][0]
                clamped += not lo <= v <= hi
                cost = _split(_at(curve, case, i, step, v, clamp, kernels.file), m)
            layers.append(dataclasses.replace(cost, num_params=params[i]))
        rows.append(StepCosts(tuple(layers), _split(kernels.embedding_ms, m), _split(kernels.head_ms, m)))
    if case == "freezing":
        how = "GPU dense block (trainable point): forward always, backward x the trainable value"
    elif curve is None:
        how = f"GPU dense block x the stand-in curve ({standin.label})"
    else:
        how = f"GPU curve {curve.case!r} at {curve.statistic}"
    label = (f"{how}; {clamped} values clamped to the measured range" if clamped else how) + exit_heads
    return CostTrace(stats.case, label, stats.steps, tuple(rows))


def relative_cost_trace(stats: StatisticTrace, kernels: KernelCosts, clamp: bool = False) -> CostTrace:
    """:func:`gpu_cost_trace` of one micro-batch in units of the GPU dense block's forward
    (:data:`~benchmarks._lib.trace_cases.DENSE_FWD`), the units of
    :func:`benchmarks._lib.trace_cases.cost_trace`: what the replay scales to its own block time."""
    unit = FWD_SHARE * kernels.dense_ms * 1e-3
    return gpu_cost_trace(stats, kernels, 1, clamp=clamp).scaled(DENSE_FWD / unit)


def add_kernel_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--kernels PATH``, ``--clamp-curves`` and ``--padded-vocab-head``; ``what``: the costs they set."""
    parser.add_argument(
        "--kernels",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"{what} from this GPU kernel check's cost curves (kernels.json)",
    )
    parser.add_argument(
        "--clamp-curves",
        action="store_true",
        help="with --kernels: clamp statistics outside a curve's measured range (default: refuse)",
    )
    parser.add_argument(
        "--padded-vocab-head",
        action="store_true",
        help="with --kernels: the head + loss with its vocabulary padded to a multiple of 128 (as "
        "Megatron-LM pads it) instead of as measured, and early exit's exit heads too where the JSON "
        "times them",
    )


def kernels_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> KernelCosts | None:
    """The kernel check ``--kernels`` names (``None`` without it); a flag that needs it is an error."""
    if args.kernels is None:
        for flag in ("clamp_curves", "padded_vocab_head"):
            if getattr(args, flag):
                name = "--" + flag.replace("_", "-")
                parser.error(f"{name} applies to --kernels PATH only; pass --kernels or drop it.")
        return None
    return read_kernels(args.kernels, HEADS[1] if args.padded_vocab_head else HEADS[0])
