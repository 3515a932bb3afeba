"""Checkpoint pieces: the full state rebuilt from a Lightning checkpoint, and bad checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynmo.pipeline.checkpoint.contents import (
    full_state_from_checkpoint,
    layout_record,
    unit_of_key,
)
from lightning_dynmo.pipeline.checkpoint.state import load_local_state, local_full_state


def _units() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"embed": nn.Embedding(4, 3), "layers.0": nn.Linear(3, 3), "layers.1": nn.Linear(3, 3)}


def test_units_of_keys() -> None:
    assert unit_of_key("layers.12.fc1.weight") == "layers.12"
    assert unit_of_key("tok_emb.weight") == "tok_emb"


def test_a_checkpoint_round_trips_into_another_split() -> None:
    units = _units()
    opt = torch.optim.AdamW([p for u in units.values() for p in u.parameters()])
    sum(p.sum() for u in units.values() for p in u.parameters()).backward()
    opt.step()
    full = local_full_state(units, [opt])
    checkpoint = {"state_dict": full["model"], "optimizer_states": full["optimizer"]}
    rebuilt = full_state_from_checkpoint(checkpoint, with_optimizer=True)
    assert rebuilt["units"] == ["embed", "layers.0", "layers.1"]
    # A rank owning only layers.1 loads exactly its part.
    mine = {"layers.1": nn.Linear(3, 3)}
    my_opt = torch.optim.AdamW(mine["layers.1"].parameters())
    load_local_state(rebuilt, mine, [my_opt])
    assert torch.equal(mine["layers.1"].weight, units["layers.1"].weight)
    assert torch.equal(
        my_opt.state[mine["layers.1"].weight]["exp_avg"], opt.state[units["layers.1"].weight]["exp_avg"]
    )


def test_a_checkpoint_without_model_state_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"checkpoint\['state_dict'\] is dict with 0 entries"):
        full_state_from_checkpoint({"state_dict": {}}, with_optimizer=False)


def test_torch_format_optimizer_state_is_rejected_with_the_fix() -> None:
    units = _units()
    opt = torch.optim.AdamW(units["embed"].parameters())
    checkpoint = {"state_dict": local_full_state(units, [])["model"], "optimizer_states": [opt.state_dict()]}
    with pytest.raises(
        ValueError, match=r"optimizer_states'\]\[0\] has keys \['param_groups', 'state'\].*weights only"
    ):
        full_state_from_checkpoint(checkpoint, with_optimizer=True)
    # Weights alone still load from such a checkpoint.
    assert full_state_from_checkpoint(checkpoint, with_optimizer=False)["optimizer"] == []


def test_layout_record_is_plain_data() -> None:
    record = layout_record("0-2|3-5", 2, 1, "1F1B", (0, 1))
    assert record == {
        "format": "lightning_dynmo.layout/1",
        "placement": "0-2|3-5",
        "pipeline_size": 2,
        "data_parallel_size": 1,
        "schedule": "1F1B",
        "active_ranks": [0, 1],
    }
