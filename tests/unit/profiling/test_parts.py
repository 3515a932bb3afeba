"""The first-stage and last-stage parts (embedding; final norm, head, loss) are profiled like blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.pipeline.model.contract import check_model_contract
from lightning_dynmo.pipeline.step.stage import StageModule, part_modules
from lightning_dynmo.profiling import LayerProfiler
from lightning_dynmo.profiling.layer_timer import module_has_hooks

from .models import Block, SleepFn

VOCAB, WIDTH, TOKENS = 32, 16, 6
HEAD_MS, LOSS_MS, BLOCK_MS = (32.0, 64.0), (16.0, 32.0), (1.0, 2.0)  # (forward, backward) per call


class _Sleep(nn.Module):
    def __init__(self, ms: tuple[float, float]) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x: Tensor) -> Tensor:
        return SleepFn.apply(x, *self.ms)


class HeavyHead(nn.Module):
    """A contract model whose head and loss cost much more than a block (emulated: they sleep)."""

    pipeline_first_parts = ("emb",)
    pipeline_last_parts = ("head",)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleDict({str(i): Block(WIDTH, *BLOCK_MS) for i in range(2)})
        self.head = nn.Sequential(nn.Linear(WIDTH, VOCAB), _Sleep(HEAD_MS))

    def pipeline_batch(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        return batch[:, :-1], batch[:, 1:]

    def pipeline_first(self, idx: Tensor) -> Tensor:
        return self.emb(idx)

    def pipeline_last(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)

    def pipeline_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        return SleepFn.apply(loss, *LOSS_MS)


def _profile(model: HeavyHead, stage: StageModule, microbatches: int = 2) -> Any:
    profiler = LayerProfiler(
        {int(k): b for k, b in model.layers.items()},
        warmup_steps=1,
        profile_steps=2,
        parts=part_modules([stage]),
    )
    profiler.start()
    while not profiler.done:
        profiler.begin_step()
        for _ in range(microbatches):
            tokens = torch.randint(0, VOCAB, (2, TOKENS + 1))
            inputs, target = model.pipeline_batch(tokens)
            assert stage.loss is not None
            stage.loss(stage(inputs), target).backward()
        profiler.end_step()
    return profiler.result()


def test_the_head_the_loss_and_the_embedding_are_timed_and_sized():
    model = HeavyHead()
    stage = StageModule(model, check_model_contract(model), [0, 1], first=True, last=True)
    result = _profile(model, stage)
    assert set(result.parts) == {"first", "last"}
    last, block = result.parts["last"], result.layers[0]
    # Two micro-batches per step: the head and the loss sleep 2 x (32 + 16) ms forward, 2 x (64 + 32) back
    # (48x a block forward: a late wake-up of its 1 ms sleep on a loaded machine stays under a third).
    assert last.fwd_time_s >= 0.95 * 2 * (HEAD_MS[0] + LOSS_MS[0]) / 1e3
    assert last.bwd_time_s >= 0.95 * 2 * (HEAD_MS[1] + LOSS_MS[1]) / 1e3
    assert last.fwd_time_s > 3 * block.fwd_time_s and last.bwd_time_s > 3 * block.bwd_time_s
    head_params = WIDTH * VOCAB + VOCAB
    assert last.num_params == head_params
    assert last.memory.param_bytes == 4 * head_params
    # The loss saves its log-softmax over the vocabulary: one float per token and class at least.
    assert last.memory.activation_bytes_per_microbatch >= 4 * 2 * TOKENS * VOCAB
    first = result.parts["first"]
    assert first.memory.param_bytes == 4 * VOCAB * WIDTH
    assert first.fwd_time_s > 0 and first.bwd_time_s > 0
    costs = result.part_costs({"first": 3, "last": 1})
    assert costs["last"].memory_bytes == last.memory.total_bytes(1)
    assert costs["first"].memory_bytes == first.memory.total_bytes(3)
    assert costs["last"].time_s == pytest.approx(last.fwd_time_s + last.bwd_time_s)
    assert not any(module_has_hooks(m) for m in (model, stage, stage.loss))


def test_a_middle_stage_has_no_parts_and_a_last_stage_without_last_parts_still_times_its_loss():
    model = HeavyHead()
    spec = check_model_contract(model)
    middle = StageModule(model, spec, [0], first=False, last=False)
    assert part_modules([middle]) == {}
    bare = type("Bare", (HeavyHead,), {"pipeline_last_parts": ()})
    loss_only = StageModule(bare(), spec.__class__(**{**spec.__dict__, "last_parts": ()}), [1], False, True)
    parts = part_modules([loss_only])
    assert list(parts) == ["last"] and parts["last"] == [loss_only.loss]
