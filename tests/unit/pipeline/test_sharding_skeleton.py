"""What a sharded unit sends ahead of its shards (its skeleton), and the checks a sharded run makes first.

The skeleton of a unit sharded with ``fully_shard`` is exercised by every migration of
``tests/distributed/test_sharded_fit.py``; here the parts that need no process group: classes, plain
attributes, ``meta`` tensors of the whole shape, sharing, hooks.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.pipeline.sharding import StageSharding, check_shardable_ties, unit_skeleton
from lightning_dynmo.strategy.args import check_data_parallel_sharding, check_sharding_fits


class Pruned(nn.Module):
    """A unit that changed while training: a narrower layer, a plain flag, a buffer, a shared weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3, dtype=torch.float64)
        self.again = self.fc  # the same submodule twice
        self.register_buffer("mask", torch.ones(3))
        self.frozen = True
        self.fc.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.mask


def _saved_hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    state_dict[prefix + "note"] = torch.zeros(1)


def test_skeleton_keeps_classes_shapes_and_attributes_on_meta() -> None:
    unit = Pruned()
    unit.register_forward_hook(lambda *args: None)  # runtime hooks are left behind
    unit._register_state_dict_hook(_saved_hook)  # state_dict hooks travel
    skeleton = pickle.loads(pickle.dumps(unit_skeleton(unit)))  # it travels pickled
    assert type(skeleton) is Pruned and skeleton.frozen is True
    assert skeleton.again is skeleton.fc  # sharing survives
    assert skeleton.fc.weight.is_meta and skeleton.fc.weight.shape == (3, 4)
    assert skeleton.fc.weight.dtype == torch.float64 and skeleton.mask.is_meta
    assert not skeleton.fc.bias.requires_grad and skeleton.fc.weight.requires_grad
    assert not skeleton._forward_hooks
    assert len(skeleton._state_dict_hooks) == 1
    assert not unit.fc.weight.is_meta  # the unit itself is untouched
    skeleton.to_empty(device="cpu")
    assert set(skeleton.state_dict()) == set(unit.state_dict()) >= {"fc.weight", "mask", "note"}


def test_tied_parameters_are_refused_under_sharding() -> None:
    check_shardable_ties(())
    with pytest.raises(ValueError, match=r"does not support parameters shared by the first and last stages"):
        check_shardable_ties(("tok_emb.weight~head.weight",))


def test_no_data_parallel_group_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"has none \(data_parallel_size=1\).*data_parallel_sharding='replicate'"
    ):
        StageSharding.over_group(None, device_type="cpu", precision="64-true")


def test_sharding_argument_checks() -> None:
    assert (
        check_data_parallel_sharding("fsdp", save_distributed_checkpoint=True, compile_blocks=False) == "fsdp"
    )
    assert check_data_parallel_sharding("replicate", save_distributed_checkpoint=False, compile_blocks=True)
    with pytest.raises(
        ValueError, match=r"data_parallel_sharding='zero3' is not one of \('replicate', 'fsdp'\)"
    ):
        check_data_parallel_sharding("zero3", save_distributed_checkpoint=True, compile_blocks=False)
    with pytest.raises(ValueError, match=r"save_distributed_checkpoint=False.*export_full_checkpoint"):
        check_data_parallel_sharding("fsdp", save_distributed_checkpoint=False, compile_blocks=False)
    with pytest.raises(ValueError, match=r"compile_blocks=True: compiled blocks are not sharded yet"):
        check_data_parallel_sharding("fsdp", save_distributed_checkpoint=True, compile_blocks=True)
    check_sharding_fits("fsdp", world_size=4, pipeline_size=2)
    check_sharding_fits("replicate", world_size=2, pipeline_size=2)
    with pytest.raises(ValueError, match=r"world_size=2 with pipeline_size=2 runs 1 replica"):
        check_sharding_fits("fsdp", world_size=2, pipeline_size=2)
