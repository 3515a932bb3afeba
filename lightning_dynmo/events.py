"""The public dynamism event API: "the model just changed", told to whoever balances the pipeline.

Dynamism components (pruning, freezing, routing, ...) and user code call :func:`notify_dynamism` when
they change the model; the :class:`~lightning_dynmo.DynMoCallback` subscribes to the bus and profiles
and rebalances at the next step, as in the paper's Algorithm 1. Every rank of a pipeline publishes
its own events on its own, process-local bus; the callback makes the ranks agree (any rank's event
triggers a rebalance on all of them). Torch-free: events are plain data and pickle cleanly.

Example::

    from lightning_dynmo.events import notify_dynamism
    notify_dynamism("pruned", layers=(3, 4, 5), step=trainer.global_step, detail="sparsity 0.5")
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

EVENT_KINDS: tuple[str, ...] = ("pruned", "frozen", "unfrozen", "routing", "custom")

Subscriber = Callable[["DynamismEvent"], None]


@dataclass(frozen=True)
class DynamismEvent:
    """One change of the model that may change what its layers cost.

    Attributes:
        kind: What happened: ``"pruned"``, ``"frozen"``, ``"unfrozen"``, ``"routing"`` (MoE/MoD routing
            changed the work per layer) or ``"custom"``.
        layers: Global indices of the layers affected; empty means "unknown or all".
        step: The global training step at which it happened, if known.
        detail: Free text for logs (e.g. ``"sparsity 0.5"``).
    """

    kind: str
    layers: tuple[int, ...] = ()
    step: int | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in EVENT_KINDS:
            raise ValueError(f"kind={self.kind!r} is not a dynamism event kind; use one of {EVENT_KINDS}.")
        layers = tuple(self.layers)
        object.__setattr__(self, "layers", layers)
        bad = [i for i in layers if not isinstance(i, int) or isinstance(i, bool) or i < 0]
        if bad:
            raise ValueError(
                f"layers={layers!r} has entries {bad!r}; give global layer indices as integers >= 0 "
                "(or no layers for 'unknown or all')."
            )
        if self.step is not None and (not isinstance(self.step, int) or self.step < 0):
            raise ValueError(f"step={self.step!r} must be a global step >= 0 or None.")
        if not isinstance(self.detail, str):
            raise ValueError(f"detail={self.detail!r} must be a string (it goes into logs and checkpoints).")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict for checkpoints."""
        return {"kind": self.kind, "layers": list(self.layers), "step": self.step, "detail": self.detail}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DynamismEvent:
        """Rebuild an event saved with :meth:`to_dict`."""
        return cls(kind=data["kind"], layers=tuple(data["layers"]), step=data["step"], detail=data["detail"])


class EventBus:
    """A process-local publish/subscribe channel for :class:`DynamismEvent`.

    Subscribers are called synchronously, in subscription order, in the publishing thread. The module
    has one default bus (:func:`default_bus`); tests and embedded uses can make their own.
    """

    def __init__(self) -> None:
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()

    def subscribe(self, subscriber: Subscriber) -> Callable[[], None]:
        """Call ``subscriber(event)`` for every event published from now on.

        Returns:
            A function that unsubscribes it (calling it twice is harmless).
        """
        if not callable(subscriber):
            raise TypeError(f"subscriber={subscriber!r} is not callable; pass a function taking one event.")
        with self._lock:
            self._subscribers.append(subscriber)

        def unsubscribe() -> None:
            with self._lock:
                if subscriber in self._subscribers:
                    self._subscribers.remove(subscriber)

        return unsubscribe

    @property
    def num_subscribers(self) -> int:
        """How many subscribers are listening."""
        return len(self._subscribers)

    def publish(self, event: DynamismEvent) -> None:
        """Hand ``event`` to every subscriber."""
        if not isinstance(event, DynamismEvent):
            raise TypeError(f"event={event!r} is not a DynamismEvent; build one or call notify_dynamism().")
        with self._lock:
            subscribers = list(self._subscribers)
        for subscriber in subscribers:
            subscriber(event)


_DEFAULT_BUS = EventBus()


def default_bus() -> EventBus:
    """The process-wide bus that :func:`notify_dynamism` publishes on by default."""
    return _DEFAULT_BUS


def notify_dynamism(
    kind: str,
    layers: Iterable[int] = (),
    step: int | None = None,
    detail: str = "",
    bus: EventBus | None = None,
) -> DynamismEvent:
    """Tell the balancer that the model changed; returns the published event.

    Args:
        kind: ``"pruned"``, ``"frozen"``, ``"unfrozen"``, ``"routing"`` or ``"custom"``.
        layers: Global indices of the affected layers (empty: unknown or all).
        step: The global step, if known.
        detail: Free text for logs.
        bus: Where to publish; the default bus if ``None``.
    """
    event = DynamismEvent(kind=kind, layers=tuple(layers), step=step, detail=detail)
    (bus or _DEFAULT_BUS).publish(event)
    return event
