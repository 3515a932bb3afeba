"""The scripted dynamics used by demos and benchmarks change the right blocks and announce it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_dynmo.demos import DemoGPT, RoutingNoise, ScheduledCostChange
from lightning_dynmo.events import default_bus


def _trainer(step: int) -> SimpleNamespace:
    return SimpleNamespace(global_step=step)


def test_scheduled_change_scales_owned_blocks_once_and_announces_it():
    model = DemoGPT(num_layers=4, sleep_ms=[2.0] * 4)
    del model.layers["3"]  # another rank owns block 3
    seen = []
    unsubscribe = default_bus().subscribe(seen.append)
    try:
        change = ScheduledCostChange(at_step=5, scale={2: 0.5, 3: 0.5}, bwd_scale={0: 0.0}, kind="frozen")
        change.on_train_batch_start(_trainer(4), model, None, 0)
        assert model.layers["2"].cost.fwd_ms == 2.0 and not seen  # not yet
        for _ in range(2):  # the same step twice (gradient accumulation): applied once
            change.on_train_batch_start(_trainer(5), model, None, 0)
    finally:
        unsubscribe()
    assert (model.layers["2"].cost.fwd_ms, model.layers["2"].cost.bwd_ms) == (1.0, 2.0)
    assert (model.layers["0"].cost.fwd_ms, model.layers["0"].cost.bwd_ms) == (2.0, 0.0)
    assert (model.layers["1"].cost.fwd_ms, model.layers["1"].cost.bwd_ms) == (2.0, 4.0)
    assert [(e.kind, e.layers, e.step) for e in seen] == [("frozen", (0, 2, 3), 5)]
    assert change.state_dict() == {"done": True}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"at_step": -1, "scale": {}}, r"at_step=-1 must be an integer step >= 0"),
        ({"at_step": 1, "scale": {0: -2.0}}, r"entries \{0: -2.0\} must map block indices >= 0 to factors"),
        ({"at_step": 1, "scale": {}, "kind": "melted"}, r"kind='melted' is not a dynamism event kind"),
    ],
)
def test_scheduled_change_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ScheduledCostChange(**kwargs)


def test_routing_noise_depends_only_on_step_and_block():
    noise = RoutingNoise(amplitude=0.5, seed=3)
    a, b = DemoGPT(num_layers=3, sleep_ms=[2.0] * 3), DemoGPT(num_layers=3, sleep_ms=[2.0] * 3)
    del b.layers["0"]  # a different rank's share: the draws of the blocks it has are the same
    for step in (0, 1, 1, 7):
        noise.on_train_batch_start(_trainer(step), a, None, 0)
        noise.on_train_batch_start(_trainer(step), b, None, 0)
        for name in b.layers:
            assert a.layers[name].cost.fwd_ms == b.layers[name].cost.fwd_ms
            factor = noise.factor(step, int(name))
            assert 0.5 <= factor <= 1.5
            assert a.layers[name].cost.fwd_ms == pytest.approx(2.0 * factor)  # from the base, not compounded
            assert a.layers[name].cost.bwd_ms == pytest.approx(4.0 * factor)
    assert len({noise.factor(s, 1) for s in range(20)}) == 20  # it really varies


def test_routing_noise_can_announce_events_and_rejects_bad_amplitude():
    seen = []
    unsubscribe = default_bus().subscribe(seen.append)
    try:
        RoutingNoise(announce=True).on_train_batch_start(_trainer(2), DemoGPT(num_layers=1), None, 0)
    finally:
        unsubscribe()
    assert [(e.kind, e.step) for e in seen] == [("routing", 2)]
    with pytest.raises(ValueError, match=r"amplitude=1.5 must be within \[0, 1\]"):
        RoutingNoise(amplitude=1.5)
