"""DynMoStrategy: pipeline-parallel training inside Lightning, with live re-placement of layers.

``import lightning_dynmo.strategy`` registers the strategy as ``"dynmo"``.

- :mod:`.dynmo_strategy`: :class:`DynMoStrategy`, the Lightning glue over :mod:`lightning_dynmo.pipeline`.
- :mod:`.state`: the run's state in two typed objects the strategy owns and passes to the modules below
  (:class:`~.state.RankState`: ranks and groups; :class:`~.state.PipelineState`: what this rank runs).
- :mod:`.args`: its constructor arguments, checked when it is built (before any process starts).
- :mod:`.trainer_checks`: Trainer setups the strategy cannot honour, refused with the alternative.
- :mod:`.connection`: the process groups (the control group with its own timeout), failure board, stall watch.
- :mod:`.replacement`: the initial placement, and live re-placement (migrate, re-pack, release).
- :mod:`.steps`: the training, evaluation and predict steps as Lightning calls them.
- :mod:`.checkpointing`: what a rank saves and loads of a Lightning checkpoint; repairs of killed saves.
- :mod:`.loop_state`: a checkpoint saved between epochs set to resume at the next epoch's first batch.
- :mod:`.collectives`: Lightning's collectives over the active ranks, guarded.
- :mod:`.sigterm`: SIGTERM noted in the handler and agreed by every rank at a batch start.
- :mod:`.child_watch`: Lightning's script launcher, naming a child rank that died (and the signal).
- :mod:`.view`: :class:`PipelineView`, the typed snapshot of the pipeline that callbacks read.
"""

from lightning_dynmo.strategy.dynmo_strategy import DynMoStrategy

__all__ = ["DynMoStrategy"]
