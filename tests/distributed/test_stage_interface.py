"""The stage interface trains exactly like one process: side inputs, side state and auxiliary losses.

``MaskedGPT`` (see ``interface_model.py``) needs an attention mask and position ids in every block
(left-padded batches), carries a boolean exit mask and a float score across stage boundaries, and adds
a router z-loss in every block. Each test fits it pipelined on forked gloo ranks and compares the logged
main and auxiliary losses and every parameter with a single-process fit that cuts each batch into the
same micro-batches, in float64. Negative controls show that the mask, the position ids and the
auxiliary gradient each change the result by far more than the tolerance.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import Run, local_state
from tests.distributed.harness import run_distributed
from tests.distributed.interface_model import MaskedGPT, PaddedTokens, exit_fraction

pytestmark = pytest.mark.distributed

TOL = 1e-9
AUX = "train_aux/router_z"


@dataclass(frozen=True)
class Setup(Run):
    """A :class:`Run` of ``MaskedGPT`` on left-padded batches (``batch_size`` per replica)."""

    steps: int = 5

    @property
    def replicas(self) -> int:
        return self.world_size // (self.pipeline_size or self.world_size)

    def dataset(self) -> PaddedTokens:
        return PaddedTokens(self.batch_size * self.replicas * self.steps * self.accumulate)

    def replica_loader(self, replica: int) -> DataLoader[Any]:
        # Replica r trains on rows r, r + R, r + 2R, ...: batch k of every replica together is the
        # reference's batch k.
        data = self.dataset()
        rows = [data[i] for i in range(replica, len(data), self.replicas)]
        return DataLoader(rows, batch_size=self.batch_size, drop_last=True)

    def reference_loader(self) -> DataLoader[Any]:
        loaders = [list(self.replica_loader(r)) for r in range(self.replicas)]
        batches = [
            {k: torch.cat([b[k] for b in group]) for k in group[0]} for group in zip(*loaders, strict=True)
        ]
        return DataLoader(batches, batch_size=None)

    def model(self, **overrides: Any) -> MaskedGPT:  # type: ignore[override]
        kwargs = {
            "num_layers": self.num_layers,
            "reference_microbatches": self.num_microbatches * self.replicas,
        }
        return MaskedGPT(**{**kwargs, **overrides}).double()


class Recorder(pl.Callback):
    def __init__(self, migrations: dict[int, str] | None = None) -> None:
        self.migrations = migrations or {}
        self.losses: list[tuple[float, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx in self.migrations:
            trainer.strategy.apply_placement(self.migrations[batch_idx])  # type: ignore[attr-defined]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int
    ) -> None:
        metrics = trainer.callback_metrics
        self.losses.append((float(metrics["train_loss"]), float(metrics[AUX])))


def _fit_worker(rank: int, world_size: int, setup: Setup) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder = Recorder(dict(setup.migrations))
    strategy = DynMoStrategy(
        pipeline_size=setup.pipeline_size,
        schedule=setup.schedule,
        num_microbatches=setup.num_microbatches,
        placement=setup.placement,
    )
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=False,
        callbacks=[recorder],
        **setup.trainer_kwargs(),
    )
    model = setup.model()
    replica = rank // (setup.pipeline_size or world_size)
    loader = setup.replica_loader(replica)
    trainer.fit(model, loader)
    predictions = trainer.predict(model, DataLoader(list(loader)[:1], batch_size=None))
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "placement": str(strategy.placement),
        "prediction": predictions[0] if predictions else None,
    }


def _fit_reference(setup: Setup, **model_overrides: Any) -> dict[str, Any]:
    recorder = Recorder()
    trainer = pl.Trainer(devices=1, callbacks=[recorder], **setup.trainer_kwargs())
    model = setup.model(**model_overrides)
    trainer.fit(model, setup.reference_loader())
    return {"losses": recorder.losses, "state": model.state_dict(), "model": model}


def _max_param_diff(results: list[dict[str, Any]], ref: dict[str, Any]) -> float:
    merged: dict[str, torch.Tensor] = {}
    for res in results:
        merged.update(res["state"])
    assert set(merged) == set(ref["state"]), set(merged) ^ set(ref["state"])
    return max((merged[k] - ref["state"][k]).abs().max().item() for k in ref["state"])


def _loss_diff(res: dict[str, Any], ref: dict[str, Any]) -> float:
    pairs = zip(res["losses"], ref["losses"], strict=True)
    return max(max(abs(a - c), abs(b - d)) for (a, b), (c, d) in pairs)


def _assert_equal(results: list[dict[str, Any]], ref: dict[str, Any], setup: Setup) -> None:
    for rank, res in enumerate(results):
        assert len(res["losses"]) == setup.steps * setup.accumulate, (
            f"rank {rank}: {len(res['losses'])} losses"
        )
        assert _loss_diff(res, ref) < TOL, (
            f"rank {rank}: main/aux losses differ by {_loss_diff(res, ref):.3e}"
        )
    worst = _max_param_diff(results, ref)
    assert worst < TOL, f"parameters differ from the reference by up to {worst:.3e}"


def test_masks_position_ids_side_state_and_aux_losses_on_a_middle_stage(tmp_path: Any) -> None:
    # Three stages: the middle one adds auxiliary losses and forwards side state it neither made nor ends;
    # a mid-run migration moves blocks (and their aux losses) to other stages.
    setup = Setup(world_size=3, placement="0-0|1-2|3-3", migrations=((2, "0-1|2-2|3-3"),))
    results = run_distributed(_fit_worker, 3, tmp_path, timeout_s=180, args=(setup,))
    ref = _fit_reference(setup)
    assert [r["placement"] for r in results] == ["0-1|2-2|3-3"] * 3
    batch = next(iter(setup.reference_loader()))
    assert 0.1 < exit_fraction(ref["model"], batch) < 0.9, "the test must exercise exited and running tokens"
    _assert_equal(results, ref, setup)
    # Predict with side inputs: every rank returns the whole model's logits for the first batch.
    model: MaskedGPT = ref["model"]
    inputs, _, side = model.pipeline_batch(batch)
    with torch.no_grad():
        expected = model(inputs, side["attention_mask"], side["position_ids"])
    for res in results:
        assert (res["prediction"] - expected).abs().max().item() < TOL

    # Negative controls: without the mask, without position ids, without the aux gradient.
    for overrides, what in (
        ({"ignore_mask": True}, "the attention mask"),
        ({"ignore_positions": True}, "the position ids"),
        ({"aux_grad": False}, "the auxiliary gradient"),
    ):
        control = _fit_reference(setup, **overrides)
        differs = max(_max_param_diff(results, control), *(_loss_diff(r, control) for r in results))
        assert differs > 1e3 * TOL, (
            f"dropping {what} should change the result (it changed it by {differs:.1e})"
        )


def test_aux_losses_with_accumulation_and_2_data_parallel_x_2_pipeline(tmp_path: Any) -> None:
    setup = Setup(world_size=4, pipeline_size=2, accumulate=2, steps=3, migrations=((2, "0-2|3-3"),))
    results = run_distributed(_fit_worker, 4, tmp_path, timeout_s=240, args=(setup,))
    _assert_equal(results, _fit_reference(setup), setup)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "Interleaved1F1B"])
def test_side_state_and_aux_losses_under_multi_stage_schedules(tmp_path: Any, schedule: str) -> None:
    # Two stages per rank: side state crosses same-rank and cross-rank boundaries; zero-bubble splits the
    # backward into input and weight passes, which the auxiliary gradient must survive.
    setup = Setup(schedule=schedule, num_layers=6, steps=4, migrations=((2, "0-0|1-2|3-4|5-5"),))
    results = run_distributed(_fit_worker, 2, tmp_path, timeout_s=180, args=(setup,))
    _assert_equal(results, _fit_reference(setup), setup)
