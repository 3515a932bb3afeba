"""fp16 loss scaling under the pipeline (``lightning_dynmo.pipeline.step.loss_scaling``), on 2 gloo ranks.

Two setups, both with Lightning's ``MixedPrecision`` plugin and a CPU ``GradScaler``:

- ``ScaledFloat64``: the scaler's whole mechanism (scale, unscale, skip on overflow, grow and back off)
  on a float64 model without autocast, so that pipelined training can equal the single-process run
  with the same scaler to 1e-9. An overflow injected on stage 0 only must make every rank skip that
  step and lower the scale on every rank, as one process does.
- Real ``16-mixed`` (float16 autocast on CPU) with a loss so small that its gradients underflow in
  float16 unless the backward runs on the scaled loss: the pipeline's gradients must match the
  single-process ones, and without scaling inside the pipeline they vanish.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor

from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import TOL, LossRecorder, local_state
from tests.distributed.harness import run_distributed
from tests.quiet_trainer import quiet_trainer

pytestmark = pytest.mark.distributed

STEPS, BATCH = 6, 8


class ScaledFloat64(MixedPrecision):
    """16-mixed's loss scaling on a float64 model without autocast (the scale is a power of two: exact)."""

    def __init__(self) -> None:
        super().__init__(
            "16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        )

    def autocast_context_manager(self) -> Any:
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.double()


class OverflowGPT(DemoGPT):
    """Makes one gradient of block 0 infinite at optimizer step ``overflow_at`` (on stage 0's rank only)."""

    def __init__(self, overflow_at: int | None, loss_factor: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overflow_at = overflow_at
        self.loss_factor = loss_factor

    def pipeline_loss(self, logits: Tensor, target: Tensor) -> Tensor:
        return super().pipeline_loss(logits, target) * self.loss_factor

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.overflow_at and "0" in self.layers:
            self.layers["0"].mlp.fc_in.weight.grad[0, 0] = float("inf")


class Recorder(LossRecorder):
    """Per step: the scale after it, this rank's parameter sum, and the unscaled gradients of the step."""

    def __init__(self) -> None:
        super().__init__()
        self.scales: list[float] = []
        self.param_sums: list[float] = []
        self.grads: dict[str, Tensor] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        self.param_sums.append(sum(float(p.detach().double().sum()) for p in pl_module.parameters()))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if not self.grads:  # the first step's, after Lightning unscaled them
            self.grads = {
                n: p.grad.detach().float().clone()
                for n, p in pl_module.named_parameters()
                if p.grad is not None
            }


class NoOverflowAgreement(DynMoStrategy):
    """Negative control: each rank decides about overflows from its own stage, as before."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        vars(self._pipeline.loss_scaling.scaler).pop("unscale_", None)


class UnscaledPipelineBackward(DynMoStrategy):
    """Negative control: the schedule's backward runs on the unscaled loss, as before."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        self._pipeline.loss_scaling.scaled_backward = lambda pipe: contextlib.nullcontext()  # type: ignore[method-assign]


def _plugin(kind: str) -> MixedPrecision:
    return (
        ScaledFloat64()
        if kind == "float64"
        else MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    )


def _fit(
    world_size: int, kind: str, overflow_at: int | None, strategy_cls: type | None, steps: int
) -> dict[str, Any]:
    recorder = Recorder()
    trainer = quiet_trainer(
        devices=world_size,
        strategy=strategy_cls(num_microbatches=4) if strategy_cls else "auto",
        plugins=[_plugin(kind)],
        max_steps=steps,
        use_distributed_sampler=False,
        callbacks=[recorder],
    )
    model = OverflowGPT(
        overflow_at, loss_factor=1.0 if kind == "float64" else 1e-5, num_layers=4, lr_gamma=0.9
    )
    trainer.fit(model, RandomTokenDataModule(BATCH, BATCH * steps))
    return {
        "losses": recorder.losses,
        "scales": recorder.scales,
        "param_sums": recorder.param_sums,
        "grads": recorder.grads,
        "state": local_state(model),
    }


def _worker(rank: int, world_size: int, kind: str, overflow_at: int | None, cls: type, steps: int) -> Any:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    return _fit(world_size, kind, overflow_at, cls, steps)


def _pipelined(
    tmp_path: Any, kind: str, overflow_at: int | None, cls: type = DynMoStrategy, steps: int = STEPS
) -> Any:
    return run_distributed(_worker, 2, tmp_path, timeout_s=120, args=(kind, overflow_at, cls, steps))


def _param_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    merged = {k: v for res in results for k, v in res["state"].items()}
    return max((merged[k] - v).abs().max().item() for k, v in ref["state"].items())


@pytest.mark.parametrize("overflow_at", [None, 3], ids=["no-overflow", "overflow-on-stage-0"])
def test_pipelined_loss_scaling_equals_one_process_with_the_same_scaler(
    overflow_at: int | None, tmp_path: Any
) -> None:
    ref = _fit(1, "float64", overflow_at, None, STEPS)
    results = _pipelined(tmp_path, "float64", overflow_at)
    for rank, res in enumerate(results):
        assert res["scales"] == ref["scales"], f"rank {rank}: scales {res['scales']} != {ref['scales']}"
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"], strict=True))
        assert diff < TOL, f"rank {rank}: losses differ from the reference by {diff:.3e}"
    assert _param_diff(results, ref) < TOL
    if overflow_at is not None:
        assert ref["scales"][overflow_at] == ref["scales"][overflow_at - 1] / 2  # backed off
        for res in results:  # every rank skipped the step: its parameters did not move
            assert res["param_sums"][overflow_at] == res["param_sums"][overflow_at - 1]


def test_ranks_that_decide_overflows_alone_drift_apart(tmp_path: Any) -> None:
    # Negative control for the test above: stage 1 takes the step stage 0 skips, and keeps its scale.
    ref = _fit(1, "float64", 3, None, STEPS)
    results = _pipelined(tmp_path, "float64", 3, NoOverflowAgreement)
    assert results[0]["scales"] != results[1]["scales"]
    assert results[1]["param_sums"][3] != results[1]["param_sums"][2]
    assert _param_diff(results, ref) > 1e-4


def _relative_errors(results: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, float]:
    grads = {k: v for res in results for k, v in res["grads"].items()}
    assert set(grads) == set(ref["grads"])
    return {k: float((grads[k] - g).norm() / g.norm()) for k, g in ref["grads"].items() if g.norm() > 0}


def test_float16_gradients_do_not_underflow_inside_the_pipeline(tmp_path: Any) -> None:
    # The loss is scaled down 1e5x: unscaled, its float16 gradients underflow to zero.
    ref = _fit(1, "float16", None, None, 1)
    errors = _relative_errors(_pipelined(tmp_path, "float16", None, steps=1), ref)
    assert max(errors.values()) < 0.05, errors
    unscaled = _relative_errors(_pipelined(tmp_path, "float16", None, UnscaledPipelineBackward, steps=1), ref)
    assert max(unscaled.values()) > 0.5, unscaled


class AuxUnscaled(DynMoStrategy):
    """Negative control: auxiliary losses get gradient 1 while the main loss's backward is scaled."""

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        scaling = self._pipeline.loss_scaling
        scaling.__class__ = type("Unscaled", (type(scaling),), {"scale": property(lambda _: 1.0)})


def _aux_worker(rank: int, world_size: int, strategy_cls: type) -> dict[str, Any]:
    from tests.distributed.test_stage_interface import Recorder as AuxRecorder
    from tests.distributed.test_stage_interface import Setup

    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    setup, recorder = Setup(steps=4), AuxRecorder()
    kwargs = {k: v for k, v in setup.trainer_kwargs().items() if k != "precision"}
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy_cls(num_microbatches=setup.num_microbatches),
        plugins=[ScaledFloat64()],
        use_distributed_sampler=False,
        callbacks=[recorder],
        **kwargs,
    )
    model = setup.model()
    trainer.fit(model, setup.replica_loader(0))
    return {
        "losses": recorder.losses,
        "state": local_state(model),
    }


def test_auxiliary_losses_get_the_loss_scale_too(tmp_path: Any) -> None:
    from tests.distributed.test_stage_interface import Recorder as AuxRecorder
    from tests.distributed.test_stage_interface import Setup

    setup, recorder = Setup(steps=4), AuxRecorder()
    kwargs = {k: v for k, v in setup.trainer_kwargs().items() if k != "precision"}
    trainer = pl.Trainer(devices=1, plugins=[ScaledFloat64()], callbacks=[recorder], **kwargs)
    model = setup.model()
    trainer.fit(model, setup.reference_loader())
    ref = {"losses": recorder.losses, "state": model.state_dict()}
    results = run_distributed(_aux_worker, 2, tmp_path, timeout_s=120, args=(DynMoStrategy,))
    for res in results:
        diff = max(
            max(abs(a - c), abs(b - d)) for (a, b), (c, d) in zip(res["losses"], ref["losses"], strict=True)
        )
        assert diff < TOL, f"main/aux losses differ from the reference by {diff:.3e}"
    assert _param_diff(results, ref) < TOL
    unscaled = run_distributed(_aux_worker, 2, tmp_path, timeout_s=120, args=(AuxUnscaled,))
    assert _param_diff(unscaled, ref) > 1e-4
