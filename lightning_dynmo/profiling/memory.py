"""Per-layer memory model and the measured per-stage peak.

A layer on a stage needs its parameters, their gradients, the optimizer state of those parameters,
and the activations it saved for backward, once per micro-batch the schedule keeps in flight on that
stage. The first three are read from the tensors themselves; the saved activations are measured with
``torch.autograd.graph.saved_tensors_hooks`` while the layer runs forward, so whatever the layer really
saves (including what a custom ``autograd.Function`` saves) is counted, and parameters it saves for
backward are not counted twice.

In-flight micro-batches per stage (stage ``s`` of ``p``, ``m`` micro-batches): 1F1B holds up to
``min(p - s, m)``; GPipe holds all ``m``; for other schedules we assume ``m`` (an upper bound).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from lightning_dynmo.runtime_hooks import runtime_hook

_ONE_F_ONE_B = {"1f1b"}
_ALL_IN_FLIGHT = {"gpipe", "loopedbfs"}


def inflight_microbatches(schedule: str, stage_index: int, num_stages: int, num_microbatches: int) -> int:
    """How many micro-batches' activations a stage holds at once under a schedule.

    Args:
        schedule: A ``torch.distributed.pipelining`` schedule name (case-insensitive), e.g. ``"1F1B"``.
        stage_index: The stage, ``0 .. num_stages - 1``.
        num_stages: Stages in the pipeline.
        num_microbatches: Micro-batches per step.

    Returns:
        ``min(num_stages - stage_index, num_microbatches)`` for 1F1B, ``num_microbatches`` otherwise
        (exact for GPipe, an upper bound for interleaved and zero-bubble schedules).
    """
    if num_stages < 1 or not 0 <= stage_index < num_stages:
        raise ValueError(
            f"stage_index={stage_index} with num_stages={num_stages}: need num_stages >= 1 and "
            "0 <= stage_index < num_stages."
        )
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1.")
    if schedule.lower() in _ONE_F_ONE_B:
        return min(num_stages - stage_index, num_microbatches)
    return num_microbatches


@dataclass(frozen=True)
class LayerMemory:
    """Memory one layer needs, split by kind (bytes).

    Attributes:
        param_bytes: Parameters (and buffers).
        grad_bytes: Gradients of the parameters that require grad.
        optimizer_state_bytes: Tensors in the optimizer's state for the layer's parameters (0 before
            the optimizer's first step, or without an optimizer).
        activation_bytes_per_microbatch: Bytes saved for backward by one forward call.
        output_bytes_per_microbatch: Bytes of the output the layer passes on, per micro-batch.
    """

    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_bytes_per_microbatch: int
    output_bytes_per_microbatch: int

    def total_bytes(self, inflight_microbatches: int) -> int:
        """Bytes on the owning stage when it holds ``inflight_microbatches`` micro-batches' activations."""
        static = self.param_bytes + self.grad_bytes + self.optimizer_state_bytes
        return static + self.activation_bytes_per_microbatch * inflight_microbatches


def static_memory(layer: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int, int]:
    """Bytes of (parameters + buffers, gradients, optimizer state) of ``layer``."""
    params = list(layer.parameters())
    param_bytes = sum(_nbytes(p) for p in params) + sum(_nbytes(b) for b in layer.buffers())
    grad_bytes = sum(_nbytes(p) for p in params if p.requires_grad)
    return param_bytes, grad_bytes, optimizer_state_bytes(optimizer, params)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, params: Iterable[nn.Parameter]) -> int:
    """Bytes of the tensors the optimizer keeps for ``params`` (e.g. Adam's two moments and step)."""
    if optimizer is None:
        return 0
    total = 0
    for p in params:
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                total += _nbytes(value)
    return total


def count_nonzero_params(layer: nn.Module) -> int:
    """Non-zero parameter entries: after magnitude pruning, the parameters that still cost work."""
    with torch.no_grad():
        return sum(int(torch.count_nonzero(p)) for p in layer.parameters())


def _nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t``: a sharded tensor (FSDP2's DTensor) counts its local shard only."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


class ActivationMeter:
    """Measures the bytes each layer saves for backward, per forward call.

    A saved tensor counts its own bytes (a micro-batch that is a view of the whole batch counts the
    micro-batch, not the batch). Saved tensors are deduplicated within one call, and tensors living in a
    parameter's storage are skipped (a matmul saves its weight, which is already counted as a parameter;
    a unit sharded with FSDP2 saves its gathered parameters, which the layer holds while it runs). A
    tensor saved by two consecutive layers (one's output, the next one's input) is counted for both:
    the model errs on the safe side.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        self._layers = dict(layers)
        self._handles: list[RemovableHandle] = []
        self._active: list[Any] = []  # entered saved_tensors_hooks contexts, innermost last
        self._saved_bytes: dict[int, list[int]] = {i: [] for i in self._layers}
        self._output_bytes: dict[int, list[int]] = {i: [] for i in self._layers}
        self._param_storages: set[int] = set()
        self.hook_time_s = 0.0

    def attach(self) -> None:
        """Attach forward hooks to every layer (before any timing hook, so its time is excluded)."""
        self._param_storages = {_storage_of(p) for layer in self._layers.values() for p in layer.parameters()}
        for index, layer in self._layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._enter(index), prepend=True))
            self._handles.append(layer.register_forward_hook(self._exit(index), always_call=True))

    def detach(self) -> None:
        """Remove the hooks (safe to call twice)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget what was measured so far."""
        for i in self._layers:
            self._saved_bytes[i].clear()
            self._output_bytes[i].clear()
        self.hook_time_s = 0.0

    def per_microbatch(self, index: int) -> tuple[int, int]:
        """(saved-activation bytes, output bytes) of one forward call of layer ``index``, the max seen."""
        return max(self._saved_bytes[index], default=0), max(self._output_bytes[index], default=0)

    def _enter(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            t0 = time.perf_counter()
            seen: set[tuple[int, int, int]] = set()
            total = [0]
            params: list[set[int]] = []  # taken at the first saved tensor, once FSDP2 gathered the layer

            def pack(t: torch.Tensor) -> torch.Tensor:
                t1 = time.perf_counter()
                if not params:
                    params.append(self._param_storages | {_storage_of(p) for p in module.parameters()})
                key = _storage_key(t)
                if key not in seen and key[0] not in params[0]:
                    seen.add(key)
                    total[0] += _nbytes(t)
                self.hook_time_s += time.perf_counter() - t1
                return t

            context = torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
            context.__enter__()
            self._active.append((context, total))
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)

    def _exit(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            t0 = time.perf_counter()
            if self._active:
                context, total = self._active.pop()
                context.__exit__(*sys.exc_info())
                if torch.is_grad_enabled():
                    self._saved_bytes[index].append(total[0])
                    self._output_bytes[index].append(_tensor_bytes(output))
            self.hook_time_s += time.perf_counter() - t0

        return runtime_hook(hook)


def _storage_of(param: torch.Tensor) -> int:
    """The address of a parameter's storage (of its local shard if it is sharded)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return int(local.untyped_storage().data_ptr())


def _storage_key(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage address, offset, size): the same saved tensor seen twice has the same key."""
    try:
        return t.untyped_storage().data_ptr(), int(t.storage_offset()), int(t.numel())
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
        return id(t), 0, t.numel()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return _nbytes(value)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class PeakMemory:
    """A stage's measured peak memory and where the figure comes from.

    Attributes:
        peak_bytes: The peak.
        source: ``"cuda.max_memory_allocated"`` (device memory allocated by tensors since the profiling
            window started) or ``"ru_maxrss"`` (CPU: the process's peak resident set size over its
            whole life, including the Python interpreter and libraries; it cannot be reset, so it is
            an upper bound and not a per-window figure).
    """

    peak_bytes: int
    source: str


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; the CPU figure cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> PeakMemory:
    """The measured peak since :func:`reset_peak_memory` (CUDA) or since the process started (CPU)."""
    if device.type == "cuda":
        return PeakMemory(int(torch.cuda.max_memory_allocated(device)), "cuda.max_memory_allocated")
    # ru_maxrss is in kilobytes on Linux and bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return PeakMemory(int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * scale, "ru_maxrss")
