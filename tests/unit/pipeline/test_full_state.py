"""local_full_state / merge_full_states / load_local_state in one process: exactness and bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynmo.pipeline.checkpoint.state import (
    FULL_STATE_FORMAT,
    load_local_state,
    local_full_state,
    merge_full_states,
)


class Counted(nn.Module):
    """A unit with extra (non-tensor) state declared through torch's get/set_extra_state protocol."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.frozen = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def get_extra_state(self) -> dict[str, bool]:
        return {"frozen": self.frozen}

    def set_extra_state(self, state: dict[str, bool]) -> None:
        self.frozen = state["frozen"]


def _units(seed: int) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    return {"layers.0": Counted(), "layers.1": Counted()}


def _optimizer(units: dict[str, nn.Module]) -> torch.optim.Optimizer:
    weights = [u.lin.weight for u in units.values()]
    biases = [u.lin.bias for u in units.values()]
    return torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.5}], lr=0.1)


def _train(units: dict[str, nn.Module], opt: torch.optim.Optimizer, only: str | None = None) -> None:
    opt.zero_grad()
    for name, unit in units.items():
        if only in (None, name):
            unit(torch.ones(2, 3)).pow(2).sum().backward()
    opt.step()


@pytest.fixture
def saved():
    units = _units(0)
    opt = _optimizer(units)
    _train(units, opt, only="layers.0")  # layers.1 has no optimizer state yet
    units["layers.1"].frozen = True
    return local_full_state(units, [opt]), units, opt


def test_round_trip_is_exact_and_keeps_missing_state_missing(saved):
    full, units, opt = saved
    fresh = _units(1)
    fresh_opt = _optimizer(fresh)
    _train(fresh, fresh_opt)  # gives layers.1 state that the load must remove

    load_local_state(full, fresh, [fresh_opt])

    for name in units:
        for (k, v), (k2, v2) in zip(
            units[name].state_dict().items(), fresh[name].state_dict().items(), strict=True
        ):
            assert k == k2 and (torch.equal(v, v2) if isinstance(v, torch.Tensor) else v == v2)
    assert fresh["layers.1"].frozen is True
    assert torch.equal(
        fresh_opt.state[fresh["layers.0"].lin.weight]["exp_avg"],
        opt.state[units["layers.0"].lin.weight]["exp_avg"],
    )
    assert fresh["layers.1"].lin.weight not in fresh_opt.state
    assert [g["lr"] for g in fresh_opt.param_groups] == [0.1, 0.5]
    assert full["format"] == FULL_STATE_FORMAT and "layers.1._extra_state" in full["model"]


def test_saved_state_does_not_alias_live_tensors(saved):
    full, units, opt = saved
    _train(units, opt)
    assert not torch.equal(full["model"]["layers.0.lin.weight"], units["layers.0"].lin.weight)


def test_merge_takes_first_part_for_duplicate_keys(saved):
    full, _, _ = saved
    other = local_full_state({"layers.0": Counted()}, [])
    other["optimizer"] = [{"param_groups": [{}, {}], "param_group_of": {}, "state": {}}]
    merged = merge_full_states([full, other])
    assert torch.equal(merged["model"]["layers.0.lin.weight"], full["model"]["layers.0.lin.weight"])
    assert merged["units"] == ["layers.0", "layers.1"]


def test_bad_format_is_rejected(saved):
    full, units, opt = saved
    with pytest.raises(
        ValueError, match=r"full state format 'something/9' is not 'lightning_dynmo.full_state/1'"
    ):
        load_local_state({**full, "format": "something/9"}, units, [opt])


def test_unit_missing_from_full_state_is_rejected(saved):
    full, _, _ = saved
    with pytest.raises(
        ValueError, match=r"no entries for unit 'layers.7' \(it holds units \['layers.0', 'layers.1'\]\)"
    ):
        load_local_state(full, {"layers.7": Counted()}, [])


def test_shape_mismatch_is_rejected(saved):
    full, _, _ = saved
    with pytest.raises(
        ValueError,
        match=r"unit 'layers.0' does not match the saved state: (?s:.*)size mismatch for lin.weight",
    ):
        load_local_state(full, {"layers.0": Counted(dim=4)}, [])


def test_optimizer_count_mismatch_is_rejected(saved):
    full, units, _ = saved
    with pytest.raises(ValueError, match=r"the full state has 1 optimizer\(s\) but 0 were passed"):
        load_local_state(full, units, [])


def test_param_group_count_mismatch_is_rejected(saved):
    full, units, _ = saved
    one_group = torch.optim.Adam([p for u in units.values() for p in u.parameters()])
    with pytest.raises(ValueError, match=r"optimizers\[0\] has 1 param_groups but the full state has 2"):
        load_local_state(full, units, [one_group])


def test_param_in_other_group_is_rejected(saved):
    full, units, _ = saved
    swapped = torch.optim.Adam(
        [{"params": [u.lin.bias for u in units.values()]}, {"params": [u.lin.weight for u in units.values()]}]
    )
    with pytest.raises(
        ValueError, match=r"'layers.0.lin.bias' is in optimizers\[0\].param_groups\[0\] but was saved"
    ):
        load_local_state(full, units, [swapped])


def test_optimizer_param_outside_units_is_rejected():
    units = _units(0)
    stray = nn.Parameter(torch.zeros(5))
    opt = torch.optim.SGD([*units["layers.0"].parameters(), stray], lr=0.1)
    with pytest.raises(
        ValueError, match=r"holds a parameter of shape \(5,\) that belongs to none of local_units"
    ):
        local_full_state(units, [opt])


def test_merge_rejects_empty_and_mismatched_parts(saved):
    full, _, _ = saved
    with pytest.raises(ValueError, match=r"needs at least one part"):
        merge_full_states([])
    with pytest.raises(ValueError, match=r"different formats or optimizer layouts"):
        merge_full_states([full, local_full_state({}, [])])
