"""Pipelined evaluation pieces that need no process group: micro-batch counts, the forward-only order,
the strategy's evaluation arguments, the released-rank predict error and the contract's step hook."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.pipelining.schedules import _ComputationType

from lightning_dynmo.pipeline.model.contract import call_step_end_hook, check_model_contract
from lightning_dynmo.pipeline.placement.layout import stage_to_pipeline_rank
from lightning_dynmo.pipeline.step.evaluation import eval_microbatches, forward_only_order
from lightning_dynmo.strategy import DynMoStrategy


@pytest.mark.parametrize(
    ("batch_size", "configured", "expected"),
    [(8, 4, 4), (6, 4, 3), (2, 4, 2), (7, 4, 1), (12, 8, 6), (3, 8, 3), (1, 1, 1)],
)
def test_eval_microbatches_is_the_largest_divisor_not_above_the_configured_count(
    batch_size: int, configured: int, expected: int
) -> None:
    assert eval_microbatches(batch_size, configured) == expected


@pytest.mark.parametrize(("batch_size", "configured"), [(0, 4), (4, 0), (-1, 2), (True, 2), (2.0, 2)])
def test_eval_microbatches_rejects_non_positive_counts(batch_size: Any, configured: Any) -> None:
    with pytest.raises(ValueError, match=r"must be an integer >= 1; an evaluation batch needs"):
        eval_microbatches(batch_size, configured)


@pytest.mark.parametrize(
    ("style", "num_stages", "pipeline_size"), [("loop", 4, 2), ("v", 4, 2), ("loop", 6, 3)]
)
def test_forward_only_order_runs_every_stage_once_per_microbatch_on_its_rank(
    style: Any, num_stages: int, pipeline_size: int
) -> None:
    order = forward_only_order(num_stages, pipeline_size, 3, style)
    assert sorted(order) == list(range(pipeline_size))
    seen = [(a.stage_index, a.microbatch_index) for actions in order.values() for a in actions]
    assert sorted(seen) == [(s, mb) for s in range(num_stages) for mb in range(3)]
    for rank, actions in order.items():
        assert all(a.computation_type == _ComputationType.FORWARD for a in actions)
        assert all(
            stage_to_pipeline_rank(a.stage_index, num_stages, pipeline_size, style) == rank for a in actions
        )
        # Stage by stage, micro-batches in order: a rank never waits on a later stage than it runs.
        keys = [(a.stage_index, a.microbatch_index) for a in actions]
        assert keys == sorted(keys)


def test_forward_only_order_v_layout_golden() -> None:
    order = forward_only_order(4, 2, 2, "v")
    assert {r: [str(a) for a in acts] for r, acts in order.items()} == {
        0: ["0F0", "0F1", "3F0", "3F1"],
        1: ["1F0", "1F1", "2F0", "2F1"],
    }


@pytest.mark.parametrize("arg", ["val_loss_log_name", "test_loss_log_name"])
@pytest.mark.parametrize("value", ["", 3])
def test_evaluation_log_names_must_be_names_or_none(arg: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"{arg}={value!r} must be a non-empty metric name"):
        DynMoStrategy(**{arg: value})


def test_evaluation_log_names_accept_none_and_names() -> None:
    strategy = DynMoStrategy(val_loss_log_name=None, test_loss_log_name="holdout/loss")
    assert strategy._eval_log_names == {"validate": None, "test": "holdout/loss"}


def test_a_released_rank_cannot_predict() -> None:
    strategy = DynMoStrategy()
    strategy._ranks.released = True
    with pytest.raises(RuntimeError, match=r"was released by a re-pack .* so it cannot predict"):
        strategy.predict_step(torch.zeros(2, 3), 0)


class _Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})
        self.calls: list[tuple[float, Any, int]] = []

    def pipeline_batch(self, batch: Any) -> Any:
        return batch

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return (output - target).pow(2).mean()

    def on_pipeline_step_end(self, loss: Tensor, batch: Any, batch_idx: int) -> None:
        self.calls.append((loss.item(), batch, batch_idx))


def test_step_end_hook_is_called_with_loss_batch_and_index() -> None:
    model = _Hooked()
    check_model_contract(model)
    call_step_end_hook(model, torch.tensor(2.5), "batch", 7)
    assert model.calls == [(2.5, "batch", 7)]


def test_step_end_hook_is_optional() -> None:
    call_step_end_hook(nn.Linear(2, 2), torch.tensor(1.0), None, 0)  # no hook: nothing to call, no error


def test_step_end_hook_must_be_a_method() -> None:
    model = _Hooked()
    model.on_pipeline_step_end = 3  # type: ignore[assignment,method-assign]
    with pytest.raises(TypeError, match=r"_Hooked.on_pipeline_step_end is 3, not a method; define it as"):
        check_model_contract(model)


def test_broadcast_from_a_source_without_a_tensor_is_an_error(tmp_path) -> None:
    import torch.distributed as dist

    from lightning_dynmo.pipeline.step.evaluation import broadcast_from

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match=r"rank 0 is the source but holds no tensor"):
            broadcast_from(None, 0, group=None, device=torch.device("cpu"))
        out = broadcast_from(torch.arange(3.0), 0, group=None, device=torch.device("cpu"))
        assert out.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()
