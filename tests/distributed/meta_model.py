"""DemoGPT declared on the meta device, with per-unit initialisation (the local-construction contract).

``MetaGPT`` allocates nothing when built; ``pipeline_init_unit`` gives each unit simple
initial values (torch's defaults, and the scaled-down residual projections), seeded per unit by the
caller. ``ConfiguredGPT`` builds the same units in Lightning's ``configure_model`` hook instead.
One process materialises either with :func:`~lightning_dynmo.pipeline.model.construction.materialize_model`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.pipeline.model.construction import materialize_model
from lightning_dynmo.strategy import DynMoStrategy


class MetaGPT(DemoGPT):
    """DemoGPT whose tensors live on the meta device until a rank materialises its units.

    Args:
        dtype: The dtype the tensors are declared (and so initialised) in.
        overrides: :class:`~lightning_dynmo.demos.DemoConfig` fields.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, **overrides: Any) -> None:
        with torch.device("meta"):
            super().__init__(**overrides)
        self.to(dtype)
        self.pipeline_init_seed = self.config.seed

    def pipeline_init_unit(self, name: str, unit: nn.Module) -> None:
        """torch's default initialisation of each layer, then GPT-2's scaled residual projections."""
        for module in unit.modules():
            if isinstance(module, nn.Linear | nn.Embedding | nn.LayerNorm):
                module.reset_parameters()
        std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for pname, param in unit.named_parameters():
            if pname.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(param, std=std)


class ConfiguredGPT(MetaGPT):
    """MetaGPT whose units are created in ``configure_model`` (on the meta device; one process
    materialises them there too, under DynMoStrategy each rank materialises its own).

    Args:
        whole: Materialise the whole model in ``configure_model`` under any strategy, as every rank did
            before local construction (a negative control).
    """

    def __init__(self, dtype: torch.dtype = torch.float32, whole: bool = False, **overrides: Any) -> None:
        super().__init__(dtype, **overrides)  # on the meta device: allocates nothing
        for name in self._unit_attributes():
            delattr(self, name)  # the units come in configure_model
        self._dtype = dtype
        self._whole = whole
        self._overrides = overrides

    def _unit_attributes(self) -> tuple[str, ...]:
        return (*self.pipeline_first_parts, "layers", *self.pipeline_last_parts)

    def configure_model(self) -> None:
        if "layers" in self._modules:
            return
        built = MetaGPT(dtype=self._dtype, **self._overrides)
        for name in self._unit_attributes():
            setattr(self, name, getattr(built, name))
        self.pipeline_init_seed = built.pipeline_init_seed
        if self._whole or not isinstance(self.trainer.strategy, DynMoStrategy):
            materialize_model(self)


def model_bytes(module: nn.Module) -> int:
    """Bytes of the materialised parameters and buffers ``module`` holds (each tensor counted once)."""
    seen = {
        id(t): t.numel() * t.element_size()
        for t in (*module.parameters(), *module.buffers())
        if not t.is_meta
    }
    return sum(seen.values())
