"""Strategies that break one thing on purpose: the negative controls of the equivalence tests."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_dynmo.strategy import DynMoStrategy


class SpoilOnArrival(DynMoStrategy):
    """Negative controls: after each migration, :meth:`spoil` every block that arrived on this rank."""

    def spoil(self, block: torch.nn.Module) -> None:
        raise NotImplementedError

    @override
    def apply_placement(self, new: Any) -> Any:
        report = super().apply_placement(new)
        module = self.lightning_module
        assert module is not None
        for move in report.moves:
            if move.dst == self.global_rank:
                self.spoil(module.get_submodule(move.unit))
        return report


class ForgetOnResume(DynMoStrategy):
    """Negative controls: resume everything but the tensors whose key ends with ``forget`` (zeroed)."""

    forget = ""

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        for key, value in checkpoint["state_dict"].items():
            if key.endswith(self.forget):
                value.zero_()
        return checkpoint
