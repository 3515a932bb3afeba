"""DynMoStrategy's arguments are validated when it is built, before any process starts."""

from __future__ import annotations

import inspect
from datetime import timedelta

import lightning.pytorch as pl
import pytest

from lightning_dynmo.balancing import Placement
from lightning_dynmo.pipeline.placement.groups import DEFAULT_CONTROL_TIMEOUT, control_timeout_of
from lightning_dynmo.strategy import DynMoStrategy


def test_registered_as_dynmo() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="dynmo", logger=False)
    assert isinstance(trainer.strategy, DynMoStrategy)
    assert trainer.strategy.schedule_name == "1F1B"
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_data_parallel_sampler_shards_by_replica() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=DynMoStrategy(pipeline_size=2), logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy, DynMoStrategy)
    assert (strategy.pipeline_size, strategy.data_parallel_size) == (2, 2)


def test_pipeline_size_not_dividing_world_size() -> None:
    with pytest.raises(ValueError, match=r"pipeline_size=3 does not divide the world size 4"):
        pl.Trainer(accelerator="cpu", devices=4, strategy=DynMoStrategy(pipeline_size=3), logger=False)


def test_unknown_schedule() -> None:
    with pytest.raises(ValueError, match=r"schedule='Looped' is not a pipeline schedule; use one of"):
        DynMoStrategy(schedule="Looped")


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_num_microbatches_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match=r"num_microbatches=.* must be an integer >= 1"):
        DynMoStrategy(num_microbatches=bad)  # type: ignore[arg-type]


def test_malformed_placement_string_fails_at_construction() -> None:
    with pytest.raises(ValueError, match=r"placement='0-3\|3-5': stage 1 \('3-5'\) starts at layer 3"):
        DynMoStrategy(placement="0-3|3-5")


def test_placement_of_wrong_type() -> None:
    with pytest.raises(ValueError, match=r"placement=3 must be 'uniform', 'parameters', a placement string"):
        DynMoStrategy(placement=3)  # type: ignore[arg-type]


def test_placement_object_and_policies_accepted() -> None:
    for placement in ("uniform", "parameters", "0-1|2-3", Placement.from_sizes([2, 2])):
        DynMoStrategy(placement=placement)


def test_start_method_is_checked() -> None:
    with pytest.raises(ValueError, match=r"start_method='thread' is not one of"):
        DynMoStrategy(start_method="thread")  # type: ignore[arg-type]


def test_data_parallel_sharding_fails_early() -> None:
    with pytest.raises(
        ValueError, match=r"data_parallel_sharding='zero3' is not one of \('replicate', 'fsdp'\)"
    ):
        DynMoStrategy(data_parallel_sharding="zero3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"save_distributed_checkpoint=False.*export_full_checkpoint"):
        DynMoStrategy(data_parallel_sharding="fsdp", save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match=r"compile_blocks=True: compiled blocks are not sharded yet"):
        DynMoStrategy(data_parallel_sharding="fsdp", compile_blocks=True)
    strategy = DynMoStrategy(pipeline_size=2, data_parallel_sharding="fsdp")
    with pytest.raises(
        ValueError, match=r"world_size=2 with pipeline_size=2 runs 1 replica.*pipeline_size of at most"
    ):
        pl.Trainer(accelerator="cpu", devices=2, strategy=strategy)


def test_by_default_the_control_timeout_bounds_dynmos_agreements_not_the_groups_half_hour() -> None:
    # tests/distributed/test_faults.py shows a short control timeout ending a stalled agreement while the
    # groups keep their 30 minutes; these defaults make DEFAULT_CONTROL_TIMEOUT that bound out of the box.
    parameters = inspect.signature(DynMoStrategy).parameters
    timeout, control = parameters["timeout"].default, parameters["control_timeout"].default
    assert timeout == timedelta(minutes=30) and control == DEFAULT_CONTROL_TIMEOUT
    assert control_timeout_of(timeout, control) == DEFAULT_CONTROL_TIMEOUT
