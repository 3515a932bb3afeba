"""Lightning's ``ThroughputMonitor``, made aware of pipeline parallelism.

Lightning's monitor multiplies rank 0's rates by ``trainer.world_size`` to report global samples per
second. Under pipeline parallelism the ranks of one pipeline all work on the *same* batch, so that
overstates throughput by the pipeline size. :class:`PipelineThroughputMonitor` counts one "device" per
pipeline replica instead (the data-parallel size), so each sample is counted once; everything else is
Lightning's own implementation. The ``device/...`` metrics therefore describe one whole pipeline replica.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ThroughputMonitor
from typing_extensions import override


def replica_count(strategy: Any) -> int:
    """Number of independent pipeline replicas (data-parallel size); ``world_size`` for other strategies."""
    size = getattr(strategy, "data_parallel_size", None)
    return int(size) if size is not None else int(strategy.world_size)


class PipelineThroughputMonitor(ThroughputMonitor):
    """``ThroughputMonitor`` that counts each sample once under pipeline parallelism.

    Takes exactly the arguments of :class:`lightning.pytorch.callbacks.ThroughputMonitor`
    (``batch_size_fn``, ``length_fn``, ``window_size``, ...). With ``DynMoStrategy`` the global rates are
    scaled by the number of pipeline replicas rather than by the number of ranks; with any other
    strategy it behaves exactly like Lightning's monitor.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        replicas = replica_count(trainer.strategy)
        for throughput in self._throughputs.values():
            throughput.world_size = replicas
