"""Old path (0.1) of :mod:`lightning_dynmo.pipeline.checkpoint.sharded`, kept so existing code still imports.

Import :func:`~lightning_dynmo.pipeline.export_full_checkpoint` from :mod:`lightning_dynmo.pipeline`.
"""

from lightning_dynmo.pipeline.checkpoint.sharded import export_full_checkpoint, is_sharded_checkpoint

__all__ = ["export_full_checkpoint", "is_sharded_checkpoint"]
