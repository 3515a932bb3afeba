"""Placement-independent Lightning checkpoints: the pieces of a checkpoint DynMo writes and reads.

A DynMo checkpoint is an ordinary Lightning checkpoint whose

* ``"state_dict"`` has exactly the keys of the single-process model's ``state_dict()``
  (``layers.7.fc1.weight``, ``tok_emb.weight``, ...), gathered from every stage, so plain
  ``model.load_state_dict(ckpt["state_dict"])`` works on one device;
* ``"optimizer_states"`` holds, per optimizer, the state keyed by those parameter names
  (:class:`~lightning_dynmo.pipeline.state.OptimizerFullState`) instead of torch's positional ids;
* ``"dynmo"`` records how the run was laid out when saving (:func:`layout_record`), for humans and
  tools; loading does not need it, because every rank loads the units it owns under its *own* placement.

Read in this order: :func:`layout_record`, :func:`full_state_from_checkpoint` (rebuild the
:class:`~lightning_dynmo.pipeline.state.FullState` that
:func:`~lightning_dynmo.pipeline.state.load_local_state` takes), :func:`unit_of_key`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_dynmo.pipeline.state import FULL_STATE_FORMAT, FullState

__all__ = ["CHECKPOINT_KEY", "LAYOUT_FORMAT", "full_state_from_checkpoint", "layout_record", "unit_of_key"]

#: Key of the layout record in a checkpoint.
CHECKPOINT_KEY = "dynmo"
LAYOUT_FORMAT = "lightning_dynmo.layout/1"


def layout_record(
    placement: str, pipeline_size: int, data_parallel_size: int, schedule: str, active_ranks: tuple[int, ...]
) -> dict[str, Any]:
    """What a checkpoint stores about the layout it was saved from (plain types only)."""
    return {
        "format": LAYOUT_FORMAT,
        "placement": placement,
        "pipeline_size": pipeline_size,
        "data_parallel_size": data_parallel_size,
        "schedule": schedule,
        "active_ranks": list(active_ranks),
    }


def unit_of_key(key: str) -> str:
    """The unit a model ``state_dict`` key belongs to: ``"layers.7.fc1.weight"`` -> ``"layers.7"``."""
    head, _, rest = key.partition(".")
    if head == "layers":
        index, _, _ = rest.partition(".")
        return f"layers.{index}"
    return head


def full_state_from_checkpoint(checkpoint: Mapping[str, Any], *, with_optimizer: bool) -> FullState:
    """Rebuild the placement-independent full state from a checkpoint DynMo wrote.

    Args:
        checkpoint: A loaded Lightning checkpoint.
        with_optimizer: Include ``"optimizer_states"`` (resuming training) or not (weights only).

    Raises:
        ValueError: if the checkpoint has no model state, or (``with_optimizer``) its optimizer states are
            not keyed by parameter name, i.e. it was not written by ``DynMoStrategy``.
    """
    model = checkpoint.get("state_dict")
    if not isinstance(model, Mapping) or not model:
        raise ValueError(
            f"checkpoint['state_dict'] is {type(model).__name__} with {len(model or ())} entries; a DynMo "
            "checkpoint holds the whole model's state. Save it with trainer.save_checkpoint under "
            "DynMoStrategy (on every rank)."
        )
    optimizers: list[Any] = []
    if with_optimizer:
        optimizers = list(checkpoint.get("optimizer_states", []))
        for k, state in enumerate(optimizers):
            if not (isinstance(state, Mapping) and "param_group_of" in state and "state" in state):
                keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
                raise ValueError(
                    f"checkpoint['optimizer_states'][{k}] has keys {keys}, not the parameter-name keyed "
                    "format DynMoStrategy writes ('param_groups', 'param_group_of', 'state'); it was "
                    "probably saved without DynMoStrategy. Resume its weights only (load_state_dict) or "
                    "save it with DynMoStrategy."
                )
    units = list(dict.fromkeys(unit_of_key(k) for k in model))
    return FullState(format=FULL_STATE_FORMAT, units=units, model=dict(model), optimizer=optimizers)
