"""The module one pipeline stage runs, and how the stage interface reaches its blocks.

Read in this order: :class:`StageModule` (first parts, the stage's blocks in global order, last parts),
its :meth:`StageModule.forward` (what crosses a stage boundary and how blocks are called), then
:func:`guard_shape_inference` (torch's metadata pass, which runs a stage on uninitialised inputs),
:func:`in_shape_inference` (blocks that keep statistics of their forwards skip that pass), and
:class:`StageParts` / :class:`PipelineLoss`, the modules through which a stage calls ``pipeline_first``,
``pipeline_last`` and ``pipeline_loss`` (so the profiler can time them like blocks: :func:`part_modules`).

What crosses a stage boundary: the hidden state alone (the plain contract), or the tuple ``(hidden,
*side_state)`` in the model's ``pipeline_side_state`` order. torch's ``PipelineStage`` sends every tensor
of the tuple and hands them to the next stage as positional arguments; tensors that are not floating
point (a boolean exit mask) travel without gradients. Side inputs (masks, position ids) are keyword
arguments of the schedule step on every rank, cut into micro-batches by torch, so every stage receives
them without any point-to-point transfer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dynmo.pipeline.model.contract import HIDDEN, ModelSpec, block_inputs, check_loss
from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses
from lightning_dynmo.pipeline.step.boundaries import BoundaryRecorder, Specs, check_outputs
from lightning_dynmo.pipeline.step.recompute import recomputing, run_checkpointed

__all__ = [
    "PipelineLoss",
    "StageModule",
    "StageParts",
    "guard_shape_inference",
    "in_shape_inference",
    "part_modules",
    "run_block",
]

State = dict[str, Tensor]

_inference = threading.local()


def in_shape_inference() -> bool:
    """Whether the forward running in this thread now must not count: torch's forward metadata pass of a
    stage, or the second run of a checkpointed block in backward (:mod:`.recompute`).

    The metadata pass runs a stage's blocks once more on zeroed inputs (with gradients enabled in
    training): a block that counts what its forwards do (MoE expert loads, exited tokens) skips it, and
    the second run of a checkpointed block, so its counts are those of the real micro-batches, as in a
    single process.
    """
    return getattr(_inference, "depth", 0) > 0 or recomputing()


class StageModule(nn.Module):
    """What one pipeline stage runs: first parts (stage 0), its blocks in global order, last parts.

    The blocks and parts are the model's own module objects, registered here too so that
    ``parameters()`` is exactly this stage's parameters; the model itself is held unregistered, only to
    call its ``pipeline_first`` / ``pipeline_last``.

    Args:
        model: The contract-abiding model (holding at least this stage's units).
        spec: Its :class:`~lightning_dynmo.pipeline.ModelSpec`.
        layer_ids: The global indices of this stage's blocks.
        first: Whether this is stage 0 (it receives the model inputs).
        last: Whether this is the last stage (it returns what ``pipeline_loss`` takes).
        recompute: Activation checkpointing: each block's forward runs again in backward
            (:mod:`.recompute`).
        recorder: Keeps what crosses each layer boundary in torch's metadata pass (training pipelines:
            :mod:`.boundaries`).
        expected_outputs: The outputs the stage was built for when built from a record: its first
            forward with gradients checks them (:func:`.boundaries.check_outputs`).
    """

    _model: Any  # the contract-abiding model, unregistered (its methods are the contract's, not nn.Module's)

    def __init__(
        self,
        model: nn.Module,
        spec: ModelSpec,
        layer_ids: Sequence[int],
        first: bool,
        last: bool,
        recompute: bool = False,
        recorder: BoundaryRecorder | None = None,
        expected_outputs: Specs | None = None,
    ):
        super().__init__()
        self._recompute = recompute
        self._recorder = recorder
        self._expected_outputs = expected_outputs
        object.__setattr__(self, "_model", model)
        self._spec = spec
        self._is_first, self._is_last = first, last
        self._runs_first, self._runs_last = first and spec.runs_first, last and spec.runs_last
        self.first = StageParts(model, spec.first_parts if self._runs_first else (), "pipeline_first")
        blocks = model.get_submodule("layers")
        self.layers = nn.ModuleDict({str(i): blocks.get_submodule(str(i)) for i in layer_ids})
        self.last = StageParts(model, spec.last_parts if self._runs_last else (), "pipeline_last")
        # What the schedule calls on the last stage's output (a module, so the profiler can time it).
        self.loss = PipelineLoss(model) if last else None
        self._reads = {key: block_inputs(block) for key, block in self.layers.items()}
        # Side-state shapes and dtypes pipeline_first produced, by input shape (see _start).
        self._state_layout: dict[tuple[int, ...], dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        self._inferring = False

    @property
    def runs_first(self) -> bool:
        """Whether this stage calls ``pipeline_first`` (stage 0 of a model with first parts or side state)."""
        return self._runs_first

    @property
    def runs_last(self) -> bool:
        """Whether this stage calls ``pipeline_last`` (the last stage of a model with last parts)."""
        return self._runs_last

    @property
    def model_name(self) -> str:
        """The model's class name, for error messages."""
        return type(self._model).__name__

    def forward(self, *flat: Tensor, **side_inputs: Tensor) -> Tensor | tuple[Tensor, ...]:
        recorder = self._recorder if self._inferring and torch.is_grad_enabled() else None
        if self._inferring:
            _zero_received(flat, self._is_first)
        if recorder is not None and self._is_first:
            recorder.record(None, flat, "first")
        state = self._start(flat, side_inputs) if self._is_first else self._unpack(flat)
        for key, block in self.layers.items():
            state = self._run_block(key, block, state, side_inputs)
            if recorder is not None:
                recorder.record(int(key), self._pack(state))
        out = self._finish(state, side_inputs) if self._is_last else self._pack(state)
        if recorder is not None and self._is_last:
            recorder.record(None, out, "last")
        if self._expected_outputs is not None and torch.is_grad_enabled() and not self._inferring:
            expected, self._expected_outputs = self._expected_outputs, None  # the first forward only
            keys = list(self.layers.keys())
            check_outputs(expected, out, f"the stage of layers {keys[0]}-{keys[-1]}")
        return out

    @contextlib.contextmanager
    def shape_inference(self) -> Iterator[None]:
        """Inside: received inputs are zeroed and auxiliary losses go nowhere (torch's metadata pass)."""
        self._inferring = True
        _inference.depth = getattr(_inference, "depth", 0) + 1
        try:
            with collect_aux_losses(allowed=self._spec.aux_losses, model_name=self.model_name):
                yield
        finally:
            _inference.depth -= 1
            self._inferring = False

    # -- boundaries ------------------------------------------------------------------------------

    def _start(self, flat: tuple[Tensor, ...], side_inputs: Mapping[str, Tensor]) -> State:
        if len(flat) != 1:
            raise TypeError(f"stage 0 of {self.model_name} expects one input tensor, got {len(flat)}.")
        inputs = flat[0]
        if not self._runs_first:
            return {HIDDEN: inputs}
        out = self.first(inputs, **_pick(side_inputs, self._spec.first_inputs, "pipeline_first"))
        if not self._spec.side_state:
            if not isinstance(out, Tensor):
                raise TypeError(
                    f"{self.model_name}.pipeline_first returned a {type(out).__name__}; without side state "
                    "(pipeline_side_state) it returns the hidden tensor."
                )
            return {HIDDEN: out}
        state = self._check_first_state(out)
        layout = {n: (tuple(t.shape), t.dtype) for n, t in state.items() if n != HIDDEN}
        expected = self._state_layout.setdefault(tuple(inputs.shape), layout)
        if layout != expected:
            changed = [n for n in layout if layout[n] != expected[n]]
            raise ValueError(
                f"{self.model_name}.pipeline_first made side state {changed} with shape/dtype "
                f"{[layout[n] for n in changed]}, but earlier steps with the same input shape made "
                f"{[expected[n] for n in changed]}. Side state must keep its shape from step to step "
                "(torch's pipeline stages allocate their receive buffers once); pad it to a fixed size."
            )
        return state

    def _check_first_state(self, out: Any) -> State:
        wanted = (HIDDEN, *self._spec.side_state)
        if not isinstance(out, Mapping) or sorted(out) != sorted(wanted):
            got = sorted(out) if isinstance(out, Mapping) else type(out).__name__
            raise TypeError(
                f"{self.model_name}.pipeline_first returned {got}; with pipeline_side_state="
                f"{self._spec.side_state!r} it must return a dict with exactly the keys {list(wanted)}."
            )
        bad = [n for n, t in out.items() if not isinstance(t, Tensor)]
        if bad:
            raise TypeError(f"{self.model_name}.pipeline_first returned non-tensor entries {bad}.")
        return dict(out)

    def _unpack(self, flat: tuple[Tensor, ...]) -> State:
        names = (HIDDEN, *self._spec.side_state)
        if len(flat) != len(names):
            raise RuntimeError(
                f"a stage of {self.model_name} received {len(flat)} tensors, expected {len(names)} "
                f"({list(names)}); the previous stage sent another structure."
            )
        return dict(zip(names, flat, strict=True))

    def _pack(self, state: State) -> Tensor | tuple[Tensor, ...]:
        if not self._spec.side_state:
            return state[HIDDEN]
        return (state[HIDDEN], *(state[n] for n in self._spec.side_state))

    def _finish(self, state: State, side_inputs: Mapping[str, Tensor]) -> Tensor:
        if not self._runs_last:
            return state[HIDDEN]
        kwargs = {
            n: state[n] if n in state else _get(side_inputs, n, "pipeline_last")
            for n in self._spec.last_inputs
        }
        out: Tensor = self.last(state[HIDDEN], **kwargs)
        return out

    # -- blocks ----------------------------------------------------------------------------------

    def _run_block(
        self, key: str, block: nn.Module, state: State, side_inputs: Mapping[str, Tensor]
    ) -> State:
        def call(state: State, side_inputs: Mapping[str, Tensor]) -> State:
            # run_block updates the dict it gets: a checkpoint's second run must see the inputs unchanged.
            return run_block(
                block,
                dict(state) if self._recompute else state,
                side_inputs,
                reads=self._reads[key],
                side_state=self._spec.side_state,
                who=f"layers.{key}",
                model_name=self.model_name,
            )

        if self._recompute and torch.is_grad_enabled() and not self._inferring:
            return run_checkpointed(call, state, side_inputs)
        return call(state, side_inputs)


def run_block(
    block: nn.Module,
    state: State,
    side_inputs: Mapping[str, Tensor],
    *,
    reads: Sequence[str],
    side_state: Sequence[str],
    who: str,
    model_name: str,
) -> State:
    """Call ``block`` the way a stage does, and return the updated state (``state`` itself, updated).

    Models use it for their single-process forward, so both paths call blocks identically.

    Args:
        block: The block.
        state: ``{"hidden": h, <side-state name>: tensor, ...}``.
        side_inputs: This micro-batch's side inputs.
        reads: The names the block reads (its ``pipeline_inputs``).
        side_state: The model's side-state names (the entries a block may update).
        who: The block's name for errors (``"layers.3"``).
        model_name: The model's class name for errors.

    Raises:
        TypeError: the block returned something other than ``hidden`` or ``(hidden, updates)``, or
            updated an undeclared entry.
        ValueError: an update changes an entry's shape or dtype.
        KeyError: the block reads a side input the batch does not provide.
    """
    kwargs = {n: state[n] if n in state else _get(side_inputs, n, who) for n in reads}
    out = block(state[HIDDEN], **kwargs)
    if isinstance(out, Tensor):
        state[HIDDEN] = out
        return state
    if not (
        isinstance(out, tuple)
        and len(out) == 2
        and isinstance(out[0], Tensor)
        and isinstance(out[1], Mapping)
    ):
        raise TypeError(
            f"{model_name}: {who} ({type(block).__name__}) returned {_describe(out)}; a block returns the "
            "new hidden tensor, or (hidden, updates) with updates a dict of side-state entries. Wrap blocks "
            "that return more (e.g. Hugging Face blocks return a tuple: take its first element)."
        )
    hidden, updates = out
    for name, value in updates.items():
        _check_update(who, block, model_name, side_state, state, name, value)
        state[name] = value
    state[HIDDEN] = hidden
    return state


def _check_update(
    who: str,
    block: nn.Module,
    model_name: str,
    side_state: Sequence[str],
    state: State,
    name: str,
    value: Any,
) -> None:
    if name not in side_state:
        raise TypeError(
            f"{model_name}: {who} ({type(block).__name__}) updates side state {name!r}, which the model does "
            f"not declare (pipeline_side_state={tuple(side_state)!r}); declare it there."
        )
    old = state[name]
    if not isinstance(value, Tensor) or value.shape != old.shape or value.dtype != old.dtype:
        got = f"shape {tuple(value.shape)} {value.dtype}" if isinstance(value, Tensor) else _describe(value)
        raise ValueError(
            f"{model_name}: {who} ({type(block).__name__}) replaced side state {name!r} (shape "
            f"{tuple(old.shape)} {old.dtype}) with {got}. Side state keeps its shape and dtype (torch's "
            "pipeline stages allocate their buffers once); pad or cast it."
        )


class StageParts(nn.Module):
    """The first-stage (or last-stage) parts of a stage, called through the model's own method.

    The parts are registered under their attribute names (so a stage's state-dict keys read
    ``first.tok_emb.weight``), and calling this module calls ``model.<method>``, which uses them. It lets
    the profiler time and meter ``pipeline_first`` / ``pipeline_last`` like a block.

    Args:
        model: The contract-abiding model (held unregistered).
        names: The part attribute names this stage holds.
        method: ``"pipeline_first"`` or ``"pipeline_last"``.
    """

    _model: Any

    def __init__(self, model: nn.Module, names: Sequence[str], method: str) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)
        self._method = method
        for name in names:
            self.add_module(name, getattr(model, name))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._model, self._method)(*args, **kwargs)


class PipelineLoss(nn.Module):
    """``model.pipeline_loss``, checked to return a scalar on the gradient path (see ``check_loss``).

    A module rather than a function so that the profiler can time the loss with the last-stage parts.
    """

    _model: Any

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_model", model)

    def forward(self, output: Any, target: Any) -> Tensor:
        name = type(self._model).__name__
        return check_loss(name, self._model.pipeline_loss(output, target), needs_grad=torch.is_grad_enabled())


def part_modules(stage_modules: Sequence[Any]) -> dict[str, list[nn.Module]]:
    """The modules that run this rank's first-stage and last-stage parts, for the profiler.

    Args:
        stage_modules: This rank's :class:`StageModule` objects (torch ``PipelineStage.submod``).

    Returns:
        ``{"first": [the first parts]}`` on the rank that runs ``pipeline_first``, ``{"last": [the last
        parts (if any), the loss]}`` on the rank of the last stage; empty elsewhere.
    """
    parts: dict[str, list[nn.Module]] = {}
    for module in stage_modules:
        if not isinstance(module, StageModule):
            continue
        if module.runs_first:
            parts["first"] = [module.first]
        if module.loss is not None:
            parts["last"] = ([module.last] if module.runs_last else []) + [module.loss]
    return parts


def guard_shape_inference(stage: Any, module: StageModule) -> None:
    """Run torch's forward metadata pass of ``stage`` inside ``module.shape_inference()``.

    Before its first step, torch's ``PipelineStage`` runs the stage once to learn its output shapes; a
    stage after the first one then receives ``torch.empty`` tensors (uninitialised memory). Zeroing them
    keeps blocks that index or branch on side state (routing indices, exit masks) well defined, and the
    auxiliary losses of that pass are not recorded.
    """
    original = stage._prepare_forward_infra

    def prepare_forward_infra(*args: Any, **kwargs: Any) -> Any:
        with module.shape_inference():
            return original(*args, **kwargs)

    stage._prepare_forward_infra = prepare_forward_infra


def _zero_received(flat: tuple[Tensor, ...], is_first: bool) -> None:
    if is_first:
        return  # stage 0 infers from the real first micro-batch
    with torch.no_grad():
        for t in flat:
            t.zero_()


def _pick(side_inputs: Mapping[str, Tensor], names: Sequence[str], who: str) -> dict[str, Tensor]:
    return {n: _get(side_inputs, n, who) for n in names}


def _get(side_inputs: Mapping[str, Tensor], name: str, who: str) -> Tensor:
    if name not in side_inputs:
        raise KeyError(
            f"{who} asks for the side input {name!r}, but this step's batch does not provide it (got "
            f"{sorted(side_inputs)}); return it from pipeline_batch as (inputs, target, {{{name!r}: ...}})."
        )
    return side_inputs[name]


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"
