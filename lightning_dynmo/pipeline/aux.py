"""Old path (0.1) of :mod:`lightning_dynmo.pipeline.step.aux_loss`, kept so existing code still imports.

Import :func:`~lightning_dynmo.pipeline.add_aux_loss` from :mod:`lightning_dynmo.pipeline`.
"""

from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses

__all__ = ["add_aux_loss", "collect_aux_losses"]
