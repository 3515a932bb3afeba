"""Bad input that only shows once processes exist fails early, on every rank, with a clear message."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.harness import run_distributed
from tests.quiet_trainer import quiet_trainer

pytestmark = pytest.mark.distributed


class _ApplyPerRank(pl.Callback):
    """Calls apply_placement with a different placement on each rank (a user bug)."""

    def __init__(self, per_rank: list[str]) -> None:
        self.per_rank = per_rank

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            trainer.strategy.apply_placement(self.per_rank[trainer.global_rank])


class _NoContract(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self.net(batch).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_and_catch(rank: int, world_size: int, case: dict[str, Any]) -> tuple[str, str] | None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    model = _NoContract() if case.get("no_contract") else DemoGPT(num_layers=case.get("num_layers", 4))
    if case.get("tie_blocks"):
        model.layers["1"].ln_1.weight = model.layers["0"].ln_1.weight
    if case.get("compile_block"):
        model.layers["2"].compile(backend="eager")
    trainer = quiet_trainer(
        devices=world_size,
        strategy=DynMoStrategy(**case.get("strategy", {})),
        max_steps=3,
        use_distributed_sampler=False,
        callbacks=[_ApplyPerRank(case["per_rank"])] if "per_rank" in case else [],
    )
    try:
        trainer.fit(model, RandomTokenDataModule(batch_size=case.get("batch_size", 8), num_samples=32))
    except (ValueError, TypeError) as err:
        return type(err).__name__, str(err)
    return None


def _raise_as_on_every_rank(case: dict[str, Any], tmp_path: Any) -> None:
    outcomes = run_distributed(_fit_and_catch, 2, tmp_path, timeout_s=60, args=(case,))
    assert all(o is not None for o in outcomes), f"some rank did not fail: {outcomes}"
    assert len({o[0] for o in outcomes}) == 1, outcomes
    kind, message = outcomes[0]
    raise {"ValueError": ValueError, "TypeError": TypeError}[kind](message)


def test_more_stages_than_layers(tmp_path: Any) -> None:
    case = {"num_layers": 3, "strategy": {"schedule": "ZBVZeroBubble"}}  # 2 ranks x 2 virtual stages
    with pytest.raises(ValueError, match="4 pipeline stages but the model has only 3 layers"):
        _raise_as_on_every_rank(case, tmp_path)


def test_microbatch_count_the_schedule_rejects(tmp_path: Any) -> None:
    case = {"strategy": {"schedule": "1F1B", "num_microbatches": 1}}
    with pytest.raises(ValueError, match=r"num_microbatches=1 is rejected by schedule '1F1B'"):
        _raise_as_on_every_rank(case, tmp_path)


def test_placement_that_does_not_cover_the_model(tmp_path: Any) -> None:
    case = {"num_layers": 4, "strategy": {"placement": "0-1|2-2"}}
    with pytest.raises(ValueError, match="covers 3 layers but the model has 4"):
        _raise_as_on_every_rank(case, tmp_path)


def test_model_without_the_contract(tmp_path: Any) -> None:
    with pytest.raises(TypeError, match=r"_NoContract has no `layers: nn.ModuleDict`"):
        _raise_as_on_every_rank({"no_contract": True}, tmp_path)


def test_apply_placement_with_different_placements_per_rank(tmp_path: Any) -> None:
    case = {"per_rank": ["0-0|1-3", "0-1|2-3"]}
    with pytest.raises(
        ValueError,
        match=r"different placements \(or micro-batch counts\) on different ranks \(rank 0: '0-0\|1-3'",
    ):
        _raise_as_on_every_rank(case, tmp_path)


def test_apply_placement_cannot_grow_the_pipeline(tmp_path: Any) -> None:
    case = {"per_rank": ["0-0|1-1|2-3", "0-0|1-1|2-3"]}
    with pytest.raises(ValueError, match=r"has 3 stages but the pipeline runs 2 .* never grows it"):
        _raise_as_on_every_rank(case, tmp_path)


def test_batch_not_divisible_into_microbatches(tmp_path: Any) -> None:
    case = {"batch_size": 6, "strategy": {"num_microbatches": 4}}
    with pytest.raises(ValueError, match="a batch of 6 samples cannot be cut into num_microbatches=4"):
        _raise_as_on_every_rank(case, tmp_path)


def test_blocks_sharing_a_parameter_fail_before_training(tmp_path: Any) -> None:
    with pytest.raises(
        TypeError, match=r"shares one parameter between pipeline units: layers.0.ln_1.weight is"
    ):
        _raise_as_on_every_rank({"tie_blocks": True}, tmp_path)


def test_a_compiled_block_is_refused_before_training(tmp_path: Any) -> None:
    with pytest.raises(
        TypeError, match=r"cannot train modules compiled by the user: \['layers\.2'\].*uncompiled"
    ):
        _raise_as_on_every_rank({"compile_block": True}, tmp_path)
