"""group_for: a migrated parameter joins the group with its hyper-parameters; schedulers follow new groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynmo.pipeline.migration.param_groups import group_for, same_hyper


def _optimizer(lrs: list[float]) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [nn.Parameter(torch.ones(2))], "lr": lr} for lr in lrs], lr=1.0)


def _hyper(optimizer: torch.optim.Optimizer, index: int) -> dict[str, object]:
    return {k: v for k, v in optimizer.param_groups[index].items() if k != "params"}


def test_the_same_index_is_kept_when_it_matches() -> None:
    sender, receiver = _optimizer([0.1, 0.2]), _optimizer([0.1, 0.2])
    assert group_for(receiver, 1, _hyper(sender, 1), [], "p") is receiver.param_groups[1]


def test_another_index_with_the_same_hyper_parameters_is_joined() -> None:
    sender, receiver = _optimizer([0.3, 0.2]), _optimizer([0.2, 0.1])
    assert group_for(receiver, 1, _hyper(sender, 1), [], "p") is receiver.param_groups[0]


@pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)` before")
def test_a_new_group_is_created_and_every_scheduler_follows_it() -> None:
    sender = _optimizer([0.4, 0.8])
    torch.optim.lr_scheduler.ExponentialLR(sender, gamma=0.5).step()  # lr 0.2 / 0.4, initial 0.4 / 0.8
    receiver = _optimizer([0.1])
    exponential = torch.optim.lr_scheduler.ExponentialLR(receiver, gamma=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(receiver, min_lr=1e-4)
    lam = torch.optim.lr_scheduler.LambdaLR(receiver, lambda step: 1.0)
    group = group_for(receiver, 1, _hyper(sender, 1), [exponential, plateau, lam], "p")
    assert group is receiver.param_groups[1] and group["params"] == []
    assert same_hyper(group, _hyper(sender, 1))
    assert exponential.base_lrs == [0.1, 0.8] and exponential.get_last_lr()[1] == 0.4
    assert plateau.min_lrs == [1e-4, 1e-4] and len(lam.lr_lambdas) == 2
    group["params"].append(nn.Parameter(torch.ones(2)))
    exponential.step()
    assert receiver.param_groups[1]["lr"] == pytest.approx(0.2)  # where the sender's group is now too


def test_a_scheduler_with_one_lambda_per_group_cannot_follow_a_foreign_group() -> None:
    sender, receiver = _optimizer([0.3]), _optimizer([0.1, 0.2])
    lam = torch.optim.lr_scheduler.LambdaLR(receiver, [lambda s: 1.0, lambda s: 0.5])
    with pytest.raises(
        ValueError,
        match=r"parameter 'w' migrates into a parameter group \(lr=0.3\) .* LambdaLR"
        r" holds one lr_lambda per group",
    ):
        group_for(receiver, 0, _hyper(sender, 0), [lam], "parameter 'w'")


def test_hyper_parameters_must_agree_in_every_key() -> None:
    group = {"params": [], "lr": 0.1, "betas": (0.9, 0.99)}
    assert same_hyper(group, {"lr": 0.1, "betas": (0.9, 0.99)})
    assert not same_hyper(group, {"lr": 0.1, "betas": (0.9, 0.999)})
    assert not same_hyper(group, {"lr": 0.1})
    assert not same_hyper({"params": [], "lr": torch.tensor(0.1)}, {"lr": 0.1})
