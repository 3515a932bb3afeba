"""What crosses every layer boundary, recorded once, so that a new placement's stages skip torch's
metadata pass.

Read in this order: :class:`BoundaryRecord` (what one rank saw in the metadata pass of its stages),
:class:`BoundaryRecorder` (the record a rank keeps between builds), then :func:`stage_metadata` (the
record of every rank, merged: the inputs and outputs of each stage of a new placement, or ``None``).

Why: torch's ``PipelineStage`` learns the tensors its stage receives and sends by running the stage
once before its first step (forward and backward of one micro-batch, every stage in turn along the
pipeline): after a migration that is one micro-batch's full forward and backward through the whole
model, sequentially, on top of the step. Given its inputs and outputs (``input_args``,
``output_args``), a stage skips that pass. Under the stage contract (:mod:`.stage`) what crosses the
boundary after layer ``i`` is the same tensors whatever the placement: ``(hidden, *side_state)`` as
layer ``i`` returned them. So the metadata pass of one placement, which runs every layer once, tells
every boundary of every other placement: each rank records, in that pass, the tensors after each of
its blocks, stage 0's input and the last stage's output.

A record holds only while what it was made under holds: the batch shapes and micro-batch count (the
tensors' shapes) and the set of frozen parameters (whether a boundary tensor requires gradients). Any
difference, or a boundary nobody recorded, and :func:`stage_metadata` says ``None``: torch's metadata
pass runs, as on the first build. A stage built from a record checks its first outputs against it
(:func:`check_outputs`) and names the difference rather than send a tensor its
neighbour cannot receive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_dynmo.balancing.placement import Placement

__all__ = [
    "BoundaryRecord",
    "BoundaryRecorder",
    "Specs",
    "StageTensors",
    "TensorSpec",
    "check_outputs",
    "frozen_names",
    "specs_of",
    "stage_metadata",
]


class TensorSpec(NamedTuple):
    """A tensor's shape, strides, dtype and whether it requires gradients (picklable, device-free)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.requires_grad)

    def example(self) -> Tensor:
        """A meta tensor with this spec (what torch's ``PipelineStage`` reads its metadata from)."""
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        return t.requires_grad_(self.requires_grad) if t.is_floating_point() else t


Specs = tuple[TensorSpec, ...]


def specs_of(value: Tensor | Sequence[Tensor]) -> Specs:
    """The specs of a stage's input or output (one tensor, or a tuple of them)."""
    tensors = (value,) if isinstance(value, Tensor) else tuple(value)
    return tuple(TensorSpec.of(t) for t in tensors)


@dataclass
class BoundaryRecord:
    """What one rank saw in the metadata pass of its stages.

    Attributes:
        batch_shape: The micro-batch count and batch shapes it ran with
            (:attr:`~lightning_dynmo.pipeline.step.microbatches.MicrobatchCount.batch_shape`).
        frozen: This rank's parameters that did not require gradients then (their names in the model).
        after: Layer ``i`` -> the tensors its stage carried after it (what a boundary after ``i`` sends).
        first_inputs: Stage 0's inputs (on the rank that ran stage 0).
        last_outputs: The last stage's outputs, what the loss takes (on the rank that ran it).
    """

    batch_shape: tuple[Any, ...] | None
    frozen: frozenset[str]
    after: dict[int, Specs] = field(default_factory=dict)
    first_inputs: Specs | None = None
    last_outputs: Specs | None = None


class StageTensors(NamedTuple):
    """A stage's inputs and outputs, as :func:`stage_metadata` merged them."""

    inputs: Specs
    outputs: Specs

    def examples(self) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Meta tensors for ``PipelineStage(input_args=..., output_args=...)``."""
        return tuple(s.example() for s in self.inputs), tuple(s.example() for s in self.outputs)


class BoundaryRecorder:
    """The record a rank keeps between pipeline builds: opened by a build that runs torch's metadata
    pass (:meth:`start`), filled by that pass (:class:`~lightning_dynmo.pipeline.step.stage.StageModule`
    calls :meth:`record`), kept across builds made from it.

    Args:
        batch_shape: The batch shapes and micro-batch count the pipeline runs now (read at the first
            record of a pass: the pass runs in the first step of a build).
        frozen: This rank's frozen parameter names now (read then too).

    Attributes:
        record_now: What this rank recorded since the last :meth:`start` (``None``: nothing yet).
    """

    def __init__(
        self,
        batch_shape: Callable[[], tuple[Any, ...] | None] = lambda: None,
        frozen: Callable[[], Iterable[str]] = frozenset,
    ) -> None:
        self._batch_shape, self._frozen = batch_shape, frozen
        self._open = False
        self.record_now: BoundaryRecord | None = None

    def start(self) -> None:
        """A build that runs torch's metadata pass: forget the record; the pass records anew."""
        self.record_now, self._open = None, True

    def record(self, layer: int | None, value: Tensor | Sequence[Tensor], where: str = "after") -> None:
        """Keep the specs of ``value``: the tensors after ``layer`` (``where="after"``), stage 0's inputs
        (``"first"``) or the last stage's outputs (``"last"``). Nothing unless a build opened a record."""
        if not self._open:
            return
        record = self.record_now
        if record is None:
            record = self.record_now = BoundaryRecord(self._batch_shape(), frozenset(self._frozen()))
        specs = specs_of(value)
        if where == "first":
            record.first_inputs = specs
        elif where == "last":
            record.last_outputs = specs
        elif layer is not None:
            record.after[layer] = specs


def check_outputs(expected: Specs, value: Tensor | Sequence[Tensor], who: str) -> None:
    """Raise when a stage built from a record sends other tensors than the record said.

    Raises:
        RuntimeError: naming both, and what would have made them differ.
    """
    got = specs_of(value)
    if [(s.shape, s.dtype, s.requires_grad) for s in got] != [
        (s.shape, s.dtype, s.requires_grad) for s in expected
    ]:
        raise RuntimeError(
            f"{who} sends {_describe(got)} but its stage was built for {_describe(expected)}, which "
            "DynMo recorded in an earlier metadata pass at this layer boundary. A block changed what "
            "it returns between steps (shape, dtype, or whether it requires gradients) without a new "
            "batch shape or a freezing change; boundary tensors must keep their shapes from step to "
            "step."
        )


def stage_metadata(
    records: Sequence[BoundaryRecord | None],
    frozen_now: Iterable[str],
    batch_shape: tuple[Any, ...] | None,
    placement: Placement,
    stages: Sequence[int],
) -> dict[int, StageTensors] | None:
    """The inputs and outputs of ``stages`` under ``placement``, from every rank's record; ``None`` when
    torch's metadata pass must run instead.

    Args:
        records: Every rank's record (``None`` where a rank has none), gathered over the pipeline's ranks.
        frozen_now: Every rank's frozen parameter names now (the union over the ranks).
        batch_shape: The batch shapes and micro-batch count the new stages will run.
        placement: The new placement.
        stages: The stages to give (callers pass every stage, so that every rank decides alike between
            the record and torch's pass: torch's stages vote, and all must agree).

    Returns:
        ``{stage: StageTensors}`` for each of ``stages``, or ``None`` when a rank has no record, the
        records were made under other batch shapes or another set of frozen parameters than now, or a
        boundary the new placement cuts at was never recorded.
    """
    if not records or any(r is None for r in records) or batch_shape is None:
        return None
    made = [r for r in records if r is not None]
    if any(r.batch_shape != batch_shape for r in made):
        return None
    if frozenset().union(*(r.frozen for r in made)) != frozenset(frozen_now):
        return None
    after: dict[int, Specs] = {}
    first = next((r.first_inputs for r in made if r.first_inputs is not None), None)
    last = next((r.last_outputs for r in made if r.last_outputs is not None), None)
    for r in made:
        after.update(r.after)
    if first is None or last is None:
        return None
    out: dict[int, StageTensors] = {}
    for s in stages:
        layers = placement.layers_of(s)
        inputs = first if s == 0 else after.get(layers[0] - 1)
        outputs = last if s == placement.num_stages - 1 else after.get(layers[-1])
        if inputs is None or outputs is None:
            return None
        out[s] = StageTensors(inputs, outputs)
    return out


def frozen_names(module: torch.nn.Module) -> frozenset[str]:
    """The names of ``module``'s parameters that do not require gradients."""
    return frozenset(n for n, p in module.named_parameters() if not p.requires_grad)


def _describe(specs: Specs) -> str:
    return ", ".join(
        f"{tuple(s.shape)} {str(s.dtype).removeprefix('torch.')}{' (grad)' if s.requires_grad else ''}"
        for s in specs
    )
