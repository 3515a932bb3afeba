"""DynMoCallback: notice that the model changed, measure it, rebalance it, and say what it gained.

- :mod:`.dynmo_callback`: :class:`DynMoCallback`, the Lightning hooks and the top-level knobs.
- :mod:`.config`: the grouped knobs (profiling, the ``auto`` trigger, the re-pack), frozen configs.
- :mod:`.window`: the profiling window: open and close, reused activation sizes, nothing-to-gain skipping.
- :mod:`.measure`: every cost the balancer reads, assembled in one place (blocks, parts, links, speeds).
- :mod:`.decision`: the decision on the deciding rank, at once or searched in a helper process, to every rank.
- :mod:`.history`: typed decision records, their checkpoint state, and the measured gain.
- :mod:`.control_plane`: the callback's exchanges between ranks, one collective each.
- :mod:`.averages`: the running means logged beside the per-step metrics, fed in batches.
"""

from lightning_dynmo.callback.config import AutoConfig, ProfilingConfig, RepackConfig
from lightning_dynmo.callback.dynmo_callback import DynMoCallback
from lightning_dynmo.callback.history import DecisionRecord

__all__ = ["AutoConfig", "DecisionRecord", "DynMoCallback", "ProfilingConfig", "RepackConfig"]
