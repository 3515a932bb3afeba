"""DynMoCallback: notice that the model changed, measure it, rebalance it, and say what it gained.

- :mod:`.dynmo_callback`: :class:`DynMoCallback`, the Lightning hooks and knobs.
- :mod:`.control_plane`: the callback's exchanges between ranks, one collective each.
"""

from lightning_dynmo.callback.dynmo_callback import DynMoCallback

__all__ = ["DynMoCallback"]
