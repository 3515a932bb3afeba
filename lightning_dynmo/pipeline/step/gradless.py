"""Stages whose inputs need no gradient (behind a frozen prefix) keep weight gradients in split backward.

Read :func:`guard_gradless_inputs` (what :func:`~lightning_dynmo.pipeline.build_pipeline` calls on
every stage).

Why. When every parameter upstream of a stage boundary is frozen (layer freezing,
:mod:`lightning_dynmo.dynamism.freezing`), the activation crossing it needs no gradient: torch's
``PipelineStage`` learns that in its metadata pass, the receiving stage's input does not require grad, and
no gradient is computed or sent back across the boundary, so a frozen prefix runs no backward at all. The
zero-bubble schedules (``InterleavedZeroBubble``, ``ZBVZeroBubble``, ``DualPipeV``) split a stage's backward
into an input pass (``backward_one_chunk(full_backward=False)``, :func:`stage_backward_input`) and a later
weight pass (``backward_weight_one_chunk``). In torch 2.13 the weight pass of a stage other than stage 0
only revisits the parameters the input pass reached by walking back from the stage's *inputs*; when the
inputs need no gradient it reaches none, and the stage's trainable parameters silently get no gradient
(measured: a 2-rank ZBV pipeline with the first two of eight layers frozen trains layers 2-3 not at all).
torch handles stage 0, whose inputs are data, by running its whole backward in the weight pass.

What this module does. For a stage after the first, a chunk whose inputs all need no gradient runs its
whole backward in the input pass (it has no input gradient to hurry back anyway) and its weight pass is
skipped. Stages whose inputs need a gradient, and stage 0, keep torch's split exactly.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["guard_gradless_inputs", "inputs_need_grad"]


def inputs_need_grad(stage: Any, chunk: int) -> bool:
    """Whether any input tensor of ``stage``'s forward of micro-batch ``chunk`` requires grad."""
    _, inputs = stage.fwd_cache[chunk]
    return any(isinstance(t, Tensor) and t.requires_grad for t in inputs)


def guard_gradless_inputs(stage: Any) -> None:
    """Run a gradless-input chunk's backward whole in the input pass, and skip its weight pass.

    A no-op for stage 0 (torch already defers its whole backward to the weight pass) and for schedules
    that never split backward (they always pass ``full_backward=True``).
    """
    if stage.is_first:
        return
    backward, weight_pass = stage.backward_one_chunk, stage.backward_weight_one_chunk
    done_whole: set[int] = set()

    def backward_one_chunk(
        bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> Any:
        if not full_backward and stage.has_backward and not inputs_need_grad(stage, bwd_chunk_id):
            done_whole.add(bwd_chunk_id)
            full_backward = True
        return backward(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False) -> Any:
        if bwd_chunk_id in done_whole:
            done_whole.discard(bwd_chunk_id)
            return None
        return weight_pass(bwd_chunk_id, last_backward=last_backward)

    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
