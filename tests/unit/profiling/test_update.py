"""The optimizer update is timed inside a window only and shared among the units by updated entries."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.profiling import LayerProfiler

UPDATE_S = 0.03


class SlowSGD(torch.optim.SGD):
    """SGD whose update also sleeps ``UPDATE_S`` (a known update time; sleeping uses no CPU)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(UPDATE_S)
        return super().step(closure)


def _units() -> dict[int, nn.Module]:
    torch.manual_seed(0)
    units: dict[int, nn.Module] = {0: nn.Linear(16, 16), 1: nn.Linear(16, 32), 2: nn.Linear(32, 16)}
    units[2].requires_grad_(False)  # frozen: the update skips it
    return units


def _window(
    units: dict[int, nn.Module],
    optimizer: torch.optim.Optimizer,
    announce: bool = True,
    outside: nn.Parameter | None = None,
) -> Any:
    profiler = LayerProfiler(units, warmup_steps=1, profile_steps=2, optimizer=optimizer)
    assert not optimizer._optimizer_step_post_hooks  # nothing before the window
    profiler.start()
    while not profiler.done:
        profiler.begin_step()
        units[2](units[1](units[0](torch.randn(4, 16)))).square().mean().backward()
        if outside is not None:
            outside.grad = torch.ones_like(outside)  # a parameter no unit holds, with a gradient
        if announce:
            profiler.before_update()  # Lightning's on_before_optimizer_step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        profiler.end_step()
    return profiler


def _params(units: dict[int, nn.Module]) -> list[nn.Parameter]:
    return [p for u in units.values() for p in u.parameters()]


def test_the_update_is_timed_in_the_window_and_shared_by_entries_with_a_gradient():
    units = _units()
    optimizer = SlowSGD(_params(units), lr=0.1)
    profiler = _window(units, optimizer)
    result = profiler.result()
    assert UPDATE_S <= result.update_time_s < 10 * UPDATE_S
    shares = {i: p.update_time_s for i, p in result.layers.items()}
    # 272 and 544 entries get a gradient; the frozen unit's 528 do not.
    assert shares[2] == 0.0
    assert shares[1] == pytest.approx(2 * shares[0], rel=1e-9)
    assert shares[0] + shares[1] == pytest.approx(result.update_time_s, rel=1e-9)
    assert result.layer_costs(1)[1].update_time_s == shares[1]  # carried into the balancer's records
    # No hook left after the window: a later step is not timed, and the optimizer has no post-hook.
    assert not optimizer._optimizer_step_post_hooks
    assert not profiler.active


def test_entries_outside_every_unit_keep_their_share_and_an_unannounced_update_is_not_timed():
    units = _units()
    outside = nn.Parameter(torch.zeros(816))  # as many entries as the two trainable units
    optimizer = SlowSGD([*_params(units), outside], lr=0.1)
    result = _window(units, optimizer, outside=outside).result()
    on_units = sum(p.update_time_s for p in result.layers.values())
    assert on_units == pytest.approx(result.update_time_s / 2, rel=1e-9)  # negative control: not all of it
    # Without on_before_optimizer_step the update has no start: nothing is timed (never a remainder).
    unannounced = _window(_units(), SlowSGD(_params(_units()), lr=0.1), announce=False).result()
    assert unannounced.update_time_s == 0.0


def test_without_an_optimizer_nothing_is_timed():
    units = _units()
    profiler = LayerProfiler(units, warmup_steps=0, profile_steps=1)
    profiler.start()
    profiler.begin_step()
    units[1](units[0](torch.randn(4, 16))).sum().backward()
    profiler.before_update()
    profiler.end_step()
    assert profiler.result().update_time_s == 0.0
    assert all(p.update_time_s == 0.0 for p in profiler.result().layers.values())
