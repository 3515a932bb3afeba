"""The dynamism event API: validation, publish/subscribe, round trip for checkpoints, torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_dynmo.events import DynamismEvent, EventBus, default_bus, notify_dynamism


def test_subscribers_receive_events_in_order():
    bus = EventBus()
    seen_a: list[DynamismEvent] = []
    seen_b: list[DynamismEvent] = []
    bus.subscribe(seen_a.append)
    bus.subscribe(seen_b.append)
    first = notify_dynamism("pruned", layers=[3, 4], step=10, detail="sparsity 0.5", bus=bus)
    second = notify_dynamism("frozen", layers=(0,), bus=bus)
    assert seen_a == seen_b == [first, second]
    assert first == DynamismEvent("pruned", (3, 4), 10, "sparsity 0.5")


def test_unsubscribe_stops_delivery_and_is_idempotent():
    bus = EventBus()
    seen: list[DynamismEvent] = []
    unsubscribe = bus.subscribe(seen.append)
    notify_dynamism("routing", bus=bus)
    unsubscribe()
    unsubscribe()
    notify_dynamism("routing", bus=bus)
    assert len(seen) == 1
    assert bus.num_subscribers == 0


def test_default_bus_is_used_without_an_explicit_one():
    seen: list[DynamismEvent] = []
    unsubscribe = default_bus().subscribe(seen.append)
    try:
        event = notify_dynamism("custom", detail="user code")
    finally:
        unsubscribe()
    assert seen == [event]


def test_buses_are_independent():
    ours, other = EventBus(), EventBus()
    seen: list[DynamismEvent] = []
    ours.subscribe(seen.append)
    notify_dynamism("pruned", bus=other)
    assert seen == []


def test_round_trip_through_a_dict():
    event = DynamismEvent("frozen", (0, 1), 42, "first two layers")
    assert DynamismEvent.from_dict(event.to_dict()) == event


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "shrunk"}, r"kind='shrunk' is not a dynamism event kind; use one of"),
        ({"kind": "pruned", "layers": (1, -2)}, r"layers=\(1, -2\) has entries \[-2\]"),
        ({"kind": "pruned", "layers": ("3",)}, r"has entries \['3'\]"),
        ({"kind": "pruned", "step": -1}, r"step=-1 must be a global step >= 0"),
        ({"kind": "pruned", "detail": 5}, r"detail=5 must be a string"),
    ],
)
def test_bad_event_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DynamismEvent(**kwargs)


def test_bad_subscriber_and_bad_event_are_rejected():
    bus = EventBus()
    with pytest.raises(TypeError, match=r"subscriber=3 is not callable"):
        bus.subscribe(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"event='pruned' is not a DynamismEvent"):
        bus.publish("pruned")  # type: ignore[arg-type]


def test_events_module_is_torch_free():
    # Importable where torch/lightning are missing (they raise ModuleNotFoundError, as when uninstalled).
    # With them installed, `import lightning_dynmo` loads the strategy to register "dynmo"; that is fine.
    code = (
        "import builtins\n"
        "real = builtins.__import__\n"
        "def blocked(name, *a, **k):\n"
        "    if name.split('.')[0] in {'torch', 'lightning'}:\n"
        "        raise ModuleNotFoundError(f'blocked {name}', name=name)\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = blocked\n"
        "import sys, lightning_dynmo.events as e\n"
        "e.notify_dynamism('pruned', layers=[1])\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, sorted(sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
