"""Per-layer forward and backward time, measured inside a real pipeline schedule step.

How a layer's time is taken (one record per forward call, i.e. per micro-batch):

- **Forward**: a forward pre-hook and a forward hook on the layer take a mark each. The pre-hook runs
  first, before the layer's other pre-hooks: a unit sharded with FSDP2 (``data_parallel_sharding="fsdp"``)
  all-gathers its parameters in its own pre-hook, so the gather is inside the unit's forward window (in
  the step's first micro-batch only: the gathered parameters stay until the step's end).
- **Backward**: the forward hook registers a tensor hook on the layer's output, which fires when the
  gradient of the output is complete, i.e. when the layer's backward starts, and one on the layer's
  input, which fires when the gradient reaching the input is complete, i.e. when the layer's backward
  ends. Layers run in order inside a stage, so these intervals do not overlap. If the layer's input
  needs no gradient (the first layer of a stage whose input is data), there is no input gradient to
  wait for; the backward then ends with the last parameter gradient the layer produces.
- **Deferred weight gradients** (zero-bubble schedules split backward into an input-gradient pass,
  timed as above, and a weight-gradient pass run later): the stage's weight pass is wrapped, and the
  time between consecutive parameter-gradient hooks inside it is charged to the layer owning the
  parameter whose gradient just arrived (the first interval starts when the pass starts). The weight
  pass re-enters the layers' output hooks; each record takes only its first start and end, so the
  re-entry is ignored. torch runs the first stage's backward unsplit, inside its weight pass (its input
  needs no gradient): there every layer's backward is all weight-gradient time, which the step model
  reads as unsplit (:func:`~lightning_dynmo.balancing.step_prediction.predict_step`).
- **Sharded units** (FSDP2): outside its forward and backward a unit holds its parameters' shards
  (DTensors), which never receive a gradient through autograd; during them FSDP2 swaps in the gathered
  parameters, which do. So a sharded unit's parameter-gradient hooks go on the gathered parameters: the
  forward hook (which runs before FSDP2's, so before any re-shard) hooks the parameters the unit holds
  then, once per step (FSDP2 keeps one gathered parameter object per shard), as step handles.

A layer's time in a step is its **median call times its number of calls**, not the sum of its calls.
The first call after a stage waited (for its peer's activation or gradient, or at the start of a step)
runs on a core that just woke up and on cold caches; on CPU that call reads up to 2x the others. The
excess belongs to the stage boundary: it stays with whichever layer is first there, so charging it to
the layer would make the balancer mispredict after moving it. Costs that vary from micro-batch to
micro-batch (token routing) are estimated by their median, and the profiler's window median over steps
follows on top.

Hooks are attached by :meth:`LayerTimer.attach` and removed by :meth:`LayerTimer.detach`, including
tensor hooks on pipeline receive buffers and on gathered parameters (they outlive a step, so they are
removed at every step end). They are marked as runtime hooks (``lightning_dynmo.runtime_hooks``):
migration leaves them behind, whereas a user's hooks make it refuse the unit. Method wrappers on stages
are undone last-in first-out with the :class:`StageBusyTimer`'s: each puts back what it found.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_dynmo.profiling.clock import Mark, StepClock
from lightning_dynmo.runtime_hooks import runtime_hook

_WEIGHT_PASS_METHOD = "backward_weight_one_chunk"
_MISSING = object()


@dataclass(frozen=True)
class StepLayerTime:
    """Time one layer took in one training step: its median call times its calls (see the module doc).

    Attributes:
        fwd_time_s: Forward seconds.
        bwd_time_s: Backward seconds, including deferred weight-gradient time (that part is summed: a
            weight pass is split over parameters, not over calls).
        bwd_weight_time_s: The part of ``bwd_time_s`` spent in a deferred weight-gradient pass.
        num_calls: Forward calls (micro-batches) seen.
    """

    fwd_time_s: float
    bwd_time_s: float
    bwd_weight_time_s: float
    num_calls: int


@dataclass
class _Call:
    """One forward call of one layer, with the marks of its forward and backward."""

    fwd_start: Mark
    fwd_end: Mark | None = None
    bwd_start: Mark | None = None
    bwd_end: Mark | None = None
    waits_for_input_grad: bool = False


@dataclass
class _LayerState:
    calls: list[_Call] = field(default_factory=list)
    open_call: _Call | None = None  # the call whose backward is running (started, not ended)
    weight_marks: list[tuple[Mark, Mark]] = field(default_factory=list)


class LayerTimer:
    """Hooks that time each layer's forward and backward inside whatever runs the layers.

    Args:
        layers: The layers this rank owns, by global layer index.
        clock: Where marks come from (perf_counter on CPU, CUDA events on GPU).

    Use ``attach()``, then ``begin_step()`` / ``end_step()`` around each training step, then
    ``detach()``. ``end_step`` returns the step's per-layer times.
    """

    def __init__(self, layers: Mapping[int, nn.Module], clock: StepClock) -> None:
        self._layers = dict(layers)
        self._clock = clock
        self._states: dict[int, _LayerState] = {i: _LayerState() for i in self._layers}
        self._module_handles: list[RemovableHandle] = []
        self._step_handles: list[RemovableHandle] = []
        self._patched: list[tuple[Any, Any]] = []  # (stage, what its instance dict held before)
        self._sharded: set[int] = set()  # layers holding FSDP2-sharded parameters
        self._hooked_at_attach: set[int] = set()  # ids of the parameters hooked by attach()
        self._hooked_this_step: set[int] = set()  # ids of the gathered parameters hooked in this step
        self._in_weight_pass = False
        self._weight_pass_last: Mark | None = None
        self.hook_time_s = 0.0  # CPU seconds spent inside our own hooks since the last begin_step

    @property
    def attached(self) -> bool:
        """Whether hooks are currently attached."""
        return bool(self._module_handles)

    # -- lifecycle ---------------------------------------------------------------------------

    def attach(self, stages: Sequence[Any] = ()) -> None:
        """Attach the hooks; ``stages`` (this rank's ``PipelineStage`` objects) let weight passes be timed."""
        if self.attached:
            raise RuntimeError("LayerTimer.attach() called twice; call detach() first.")
        for index, layer in self._layers.items():
            # First of the pre-hooks: a unit sharded with FSDP2 gathers its parameters in its own pre-hook,
            # which then falls inside the unit's forward time.
            self._module_handles.append(layer.register_forward_pre_hook(self._pre_hook(index), prepend=True))
            self._module_handles.append(
                layer.register_forward_hook(self._post_hook(index), prepend=True, always_call=True)
            )
            for p in layer.parameters():
                # A sharded parameter (a DTensor under FSDP2) never receives a gradient through autograd:
                # its gathered copy does, and is hooked once per step by the forward hook instead.
                if p.requires_grad and not isinstance(p, DTensor):
                    self._module_handles.append(p.register_hook(self._param_hook(index)))  # type: ignore[no-untyped-call]
                    self._hooked_at_attach.add(id(p))
            if any(isinstance(m, FSDPModule) for m in layer.modules()):
                self._sharded.add(index)
        for stage in stages:
            if hasattr(stage, _WEIGHT_PASS_METHOD):
                self._wrap_weight_pass(stage)

    def detach(self) -> None:
        """Remove every hook and restore every wrapped method (safe to call twice)."""
        for handle in self._module_handles + self._step_handles:
            handle.remove()
        self._module_handles.clear()
        self._step_handles.clear()
        self._sharded.clear()
        self._hooked_at_attach.clear()
        self._hooked_this_step.clear()
        for stage, previous in reversed(self._patched):
            # Put back whatever the instance had before (another timer's wrapper, or nothing).
            if previous is _MISSING:
                vars(stage).pop(_WEIGHT_PASS_METHOD, None)
            else:
                setattr(stage, _WEIGHT_PASS_METHOD, previous)
        self._patched.clear()

    def begin_step(self) -> None:
        """Forget partial records and start a new step."""
        for state in self._states.values():
            state.calls.clear()
            state.open_call = None
            state.weight_marks.clear()
        self.hook_time_s = 0.0

    def end_step(self) -> dict[int, StepLayerTime]:
        """Resolve the step's marks (one device synchronise, not one per layer) into per-layer times."""
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        self._hooked_this_step.clear()
        self._clock.synchronize()
        return {i: self._resolve(state) for i, state in self._states.items()}

    # -- hooks -------------------------------------------------------------------------------

    def _pre_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            t0 = time.perf_counter()
            self._states[index].calls.append(_Call(fwd_start=self._clock.mark()))
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)

    def _post_hook(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            t0 = time.perf_counter()
            state = self._states[index]
            if state.calls and state.calls[-1].fwd_end is None:
                call = state.calls[-1]
                call.fwd_end = self._clock.mark()
                if torch.is_grad_enabled():
                    self._watch_backward(index, call, module, args, output)
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)

    def _watch_backward(
        self, index: int, call: _Call, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        out = _first_grad_tensor(output)
        if out is None:
            return  # nothing downstream needs this layer's gradient: no backward (e.g. frozen prefix)
        self._step_handles.append(out.register_hook(self._bwd_start_hook(index, call)))  # type: ignore[no-untyped-call]
        inp = _first_grad_tensor(args)
        if inp is not None:
            call.waits_for_input_grad = True
            self._step_handles.append(inp.register_hook(self._bwd_end_hook(index, call)))  # type: ignore[no-untyped-call]
        if index in self._sharded:
            self._hook_gathered_params(index, module)

    def _hook_gathered_params(self, index: int, module: nn.Module) -> None:
        """Hook the parameters a sharded layer holds right now: the gathered ones, which get the gradients.

        This runs in the forward hook, before FSDP2's own (which may put the sharded parameters back).
        FSDP2 keeps one gathered parameter object per sharded one for the module's life, so each is hooked
        once per step; the hooks are step handles, removed at the step's end.
        """
        for p in module.parameters():
            key = id(p)
            if (
                p.requires_grad
                and not isinstance(p, DTensor)
                and key not in self._hooked_at_attach
                and key not in self._hooked_this_step
            ):
                self._step_handles.append(p.register_hook(self._param_hook(index)))  # type: ignore[no-untyped-call]
                self._hooked_this_step.add(key)

    def _bwd_start_hook(self, index: int, call: _Call) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if call.bwd_start is not None or self._in_weight_pass:
                return  # a re-entry from the deferred weight pass, not a new backward
            t0 = time.perf_counter()
            call.bwd_start = self._clock.mark()
            self._states[index].open_call = call
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)

    def _bwd_end_hook(self, index: int, call: _Call) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if call.bwd_end is not None or self._in_weight_pass:
                return
            t0 = time.perf_counter()
            call.bwd_end = self._clock.mark()
            state = self._states[index]
            if state.open_call is call:
                state.open_call = None
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)

    def _param_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            t0 = time.perf_counter()
            state = self._states[index]
            if self._in_weight_pass:
                now = self._clock.mark()
                state.weight_marks.append((self._weight_pass_last, now))
                self._weight_pass_last = now
            elif state.open_call is not None and not state.open_call.waits_for_input_grad:
                # No input gradient will come: the last parameter gradient ends this backward.
                state.open_call.bwd_end = self._clock.mark()
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)

    def _wrap_weight_pass(self, stage: Any) -> None:
        original = getattr(stage, _WEIGHT_PASS_METHOD)
        self._patched.append((stage, vars(stage).get(_WEIGHT_PASS_METHOD, _MISSING)))

        def timed_weight_pass(*args: Any, **kwargs: Any) -> Any:
            with self.weight_pass():
                return original(*args, **kwargs)

        setattr(stage, _WEIGHT_PASS_METHOD, timed_weight_pass)

    @contextmanager
    def weight_pass(self) -> Iterator[None]:
        """Mark a deferred weight-gradient pass run by hand (``attach(stage)`` does this for a stage)."""
        self._in_weight_pass = True
        self._weight_pass_last = self._clock.mark()
        try:
            yield
        finally:
            self._in_weight_pass = False
            self._weight_pass_last = None

    # -- resolution --------------------------------------------------------------------------

    def _resolve(self, state: _LayerState) -> StepLayerTime:
        elapsed = self._clock.elapsed_s
        fwd = _per_step([elapsed(c.fwd_start, c.fwd_end) for c in state.calls if c.fwd_end is not None])
        bwd = _per_step(
            [
                elapsed(c.bwd_start, c.bwd_end)
                for c in state.calls
                if c.bwd_start is not None and c.bwd_end is not None
            ]
        )
        weight = sum(elapsed(a, b) for a, b in state.weight_marks)
        return StepLayerTime(
            fwd_time_s=fwd, bwd_time_s=bwd + weight, bwd_weight_time_s=weight, num_calls=len(state.calls)
        )


def _per_step(call_times_s: list[float]) -> float:
    """A step's time from its calls' times: the median call times the number of calls."""
    return len(call_times_s) * statistics.median(call_times_s) if call_times_s else 0.0


def _first_grad_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in ``value`` (a tensor or a nested tuple/list/dict) that requires grad."""
    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _first_grad_tensor(item)
        if found is not None:
            return found
    return None


def module_has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` or any submodule or parameter still carries a hook (used to test cleanup)."""
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            return True
    return any(p._backward_hooks for p in module.parameters())
