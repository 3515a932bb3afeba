"""The single-process training step of a contract model, computed as a pipeline computes it (the reference).

Both the GPT and the Hugging Face adapter train single-process through :func:`reference_training_loss`:
the batch is cut into the pipeline's micro-batches, their losses averaged, and each micro-batch's
auxiliary losses added and logged under the pipeline's names, so a pipelined run can be compared with it
exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch import Tensor

from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses

__all__ = ["reference_training_loss"]


def reference_training_loss(
    module: pl.LightningModule,
    rows: int,
    microbatches: int,
    micro_losses: Callable[[], list[Tensor]],
    *,
    owner: str,
    model_name: str,
) -> Tensor:
    """The micro-batches' mean loss plus their auxiliary losses; logs ``train_loss`` and ``train_aux/*``.

    Args:
        module: The LightningModule (its ``pipeline_aux_losses``, the names it may add, and ``log``).
        rows: Rows of the batch.
        microbatches: Equal pieces the batch is cut into.
        micro_losses: Computes each piece's main loss, in order (called while auxiliary losses are
            collected).
        owner: How the error names the model's constructor, e.g. ``"GPT"``.
        model_name: How auxiliary-loss errors name the model.

    Raises:
        ValueError: ``rows`` is not a multiple of ``microbatches``.
    """
    n = microbatches
    if rows % n:
        raise ValueError(
            f"a batch of {rows} rows cannot be cut into {owner}(microbatches={n}) equal "
            f"pieces; use a batch size that is a multiple of {n}."
        )
    allowed: tuple[str, ...] = tuple(getattr(module, "pipeline_aux_losses", ()))
    with collect_aux_losses(attach=False, allowed=allowed, model_name=model_name) as aux:
        main = torch.stack(micro_losses()).mean()
    module.log("train_loss", main.detach(), prog_bar=True)
    totals = aux.totals()
    for name in allowed:
        module.log(f"train_aux/{name}", totals[name] / n if name in totals else torch.zeros(()))
    return main + aux.total() / n
