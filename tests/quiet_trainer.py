"""A CPU ``pl.Trainer`` without logger, checkpoints, progress bar or model summary, as most tests want."""

from typing import Any

import lightning.pytorch as pl


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    """``pl.Trainer(accelerator="cpu", **kwargs)`` with logging, checkpointing and summaries off."""
    quiet: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return pl.Trainer(**{**quiet, **kwargs})
