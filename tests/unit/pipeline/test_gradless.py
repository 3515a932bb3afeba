"""pipeline/gradless.py: a chunk whose inputs need no gradient runs its whole backward in the input pass."""

from __future__ import annotations

from typing import Any

import torch

from lightning_dynmo.pipeline.step.gradless import guard_gradless_inputs, inputs_need_grad


class FakeStage:
    """Records the calls torch's zero-bubble schedules make on a stage."""

    def __init__(self, is_first: bool, inputs: dict[int, tuple[Any, ...]]) -> None:
        self.is_first = is_first
        self.has_backward = True
        self.fwd_cache = {chunk: (None, list(tensors)) for chunk, tensors in inputs.items()}
        self.calls: list[tuple[str, int, bool | None]] = []

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        self.calls.append(("input", bwd_chunk_id, full_backward))

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        self.calls.append(("weight", bwd_chunk_id, None))


def inputs() -> dict[int, tuple[Any, ...]]:
    needs = torch.ones(2, requires_grad=True)
    return {0: (torch.ones(2), 3), 1: (needs,)}  # chunk 0: gradless input (and a non-tensor)


def test_gradless_chunks_run_whole_in_the_input_pass_and_skip_the_weight_pass() -> None:
    stage = FakeStage(is_first=False, inputs=inputs())
    assert [inputs_need_grad(stage, c) for c in (0, 1)] == [False, True]
    guard_gradless_inputs(stage)
    for chunk in (0, 1):
        stage.backward_one_chunk(chunk, full_backward=False)
    for chunk in (0, 1):
        stage.backward_weight_one_chunk(chunk)
    assert stage.calls == [("input", 0, True), ("input", 1, False), ("weight", 1, None)]


def test_first_stage_and_full_backward_schedules_are_untouched() -> None:
    first = FakeStage(is_first=True, inputs=inputs())
    guard_gradless_inputs(first)
    first.backward_one_chunk(0, full_backward=False)
    first.backward_weight_one_chunk(0)
    assert first.calls == [("input", 0, False), ("weight", 0, None)]  # torch defers stage 0 itself
    later = FakeStage(is_first=False, inputs=inputs())
    guard_gradless_inputs(later)
    later.backward_one_chunk(0)  # 1F1B & co.: always a full backward, no weight pass
    assert later.calls == [("input", 0, True)]
