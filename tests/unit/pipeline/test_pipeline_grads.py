"""Gradients carried through the returned loss behave exactly like an ordinary backward."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lightning_dynmo.pipeline.step.grads import clip_grad_norm, loss_carrying_grads, restore_grads, take_grads


def _model_and_loss() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    return model, model(x).pow(2).mean()


def test_carried_grads_equal_autograd_with_accumulation_and_scaling() -> None:
    model, loss = _model_and_loss()
    params = list(model.parameters())
    loss.backward()
    step = take_grads(params)  # what a schedule step leaves in .grad
    earlier = [torch.full_like(p, 0.5) for p in params]  # gradients accumulated by an earlier batch
    restore_grads(params, [e.clone() for e in earlier])
    carried = loss_carrying_grads(loss.detach(), params, step)
    assert carried.item() == loss.item()
    (carried / 2).backward()  # Lightning divides by accumulate_grad_batches
    for p, g, e in zip(params, step, earlier, strict=True):
        assert g is not None
        torch.testing.assert_close(p.grad, e + g / 2, rtol=0, atol=1e-15)


def test_frozen_parameters_get_no_gradient_and_backward_still_works() -> None:
    model, loss = _model_and_loss()
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(False)
    carried = loss_carrying_grads(loss.detach(), params, [None] * len(params))
    carried.backward()
    assert all(p.grad is None for p in params)


def test_clip_without_group_matches_torch() -> None:
    model, loss = _model_and_loss()
    loss.backward()
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        q.grad = p.grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e-3)
    assert expected_norm.item() > 1e-3, "the clip must bite"
    total = clip_grad_norm(list(model.parameters()), 1e-3, group=None)
    torch.testing.assert_close(total, expected_norm, rtol=0, atol=1e-15)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-15)
