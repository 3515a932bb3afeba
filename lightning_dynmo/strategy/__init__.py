"""DynMoStrategy: pipeline-parallel training inside Lightning, with live re-placement of layers.

``import lightning_dynmo.strategy`` registers the strategy as ``"dynmo"``.

- :mod:`.dynmo_strategy`: :class:`DynMoStrategy`, the Lightning glue over :mod:`lightning_dynmo.pipeline`.
- :mod:`.args`: its constructor arguments, checked when it is built (before any process starts).
- :mod:`.trainer_checks`: Trainer setups the strategy cannot honour, refused with the alternative.
"""

from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["DynMoStrategy"]
