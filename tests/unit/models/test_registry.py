"""Block kinds plug in through the registry: by name or by options, per layer, with clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_dynmo.models import (
    GPT,
    DenseBlock,
    GPTConfig,
    block_kinds,
    build_unit,
    register_block,
    resolve_block,
    unregister_block,
)


@dataclass(frozen=True, kw_only=True)
class ScaledOptions:
    """Options of the test kind: the scale of the block's extra, randomly initialised parameter."""

    scale: float = 1.0


class ScaledBlock(nn.Module):
    """A dense block plus a parameter the GPT-2 init does not touch (initialised in the constructor)."""

    def __init__(self, config: GPTConfig, options: ScaledOptions, layer_index: int):
        super().__init__()
        self.inner = DenseBlock(config)
        self.gain = nn.Parameter(torch.randn(config.d_model) * options.scale)
        self.layer_index = layer_index

    def forward(self, hidden: Tensor) -> Tensor:
        out: Tensor = self.inner(hidden) * self.gain
        return out


def build_scaled(config: GPTConfig, layer_index: int, options: ScaledOptions) -> nn.Module:
    return ScaledBlock(config, options, layer_index)


@pytest.fixture
def scaled_kind() -> Iterator[str]:
    register_block("scaled", build_scaled, options_type=ScaledOptions)
    yield "scaled"
    unregister_block("scaled")


TINY: dict[str, Any] = {"num_layers": 3, "d_model": 16, "num_heads": 2, "seq_len": 8}


def test_dense_is_built_in() -> None:
    assert "dense" in block_kinds()
    model = GPT(GPTConfig(**TINY))
    assert all(isinstance(block, DenseBlock) for block in model.layers.values())


def test_a_registered_kind_by_name_or_by_options_per_layer(scaled_kind: str) -> None:
    config = GPTConfig(**TINY, blocks=["dense", ScaledOptions(scale=2.0), scaled_kind])
    model = GPT(config)
    kinds = [type(block).__name__ for block in model.layers.values()]
    assert kinds == ["DenseBlock", "ScaledBlock", "ScaledBlock"]
    assert model.layers["1"].layer_index == 1
    kind, options = resolve_block(scaled_kind)
    assert kind.options_type is ScaledOptions and options == ScaledOptions()
    # Constructor-time randomness is seeded per unit too: a rebuilt unit is identical.
    assert torch.equal(model.layers["2"].gain, build_unit(config, "layers.2").gain)  # type: ignore[union-attr]
    x = torch.randn(2, 8, 16)
    assert model.layers["1"](x).shape == x.shape
    assert config.blocks == ("dense", ScaledOptions(scale=2.0), "scaled"), "a list is stored as a tuple"


def test_registry_errors(scaled_kind: str) -> None:
    with pytest.raises(ValueError, match=r"'nope' is not a registered block kind .*import the module"):
        GPTConfig(**TINY, blocks="nope")
    with pytest.raises(ValueError, match=r"GPTConfig.blocks\[1\]=3 is neither a block kind name"):
        GPTConfig(**TINY, blocks=["dense", 3, "dense"])
    with pytest.raises(ValueError, match=r"blocks has 2 entries but num_layers=3; give one entry per layer"):
        GPTConfig(**TINY, blocks=["dense", "dense"])
    with pytest.raises(ValueError, match=r"'scaled' is already registered .*replace=True"):
        register_block(scaled_kind, build_scaled)
    with pytest.raises(ValueError, match=r"options_type ScaledOptions already selects the kind 'scaled'"):
        register_block("other", build_scaled, options_type=ScaledOptions)
    with pytest.raises(ValueError, match=r"name='no good' must be a non-empty identifier"):
        register_block("no good", build_scaled)
    with pytest.raises(TypeError, match=r"factory=3 is not callable"):
        register_block("three", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"options_type=.* must be a class"):
        register_block("inst", build_scaled, options_type=ScaledOptions())  # type: ignore[arg-type]
    with pytest.raises(KeyError, match=r"no block kind named 'ghost'"):
        unregister_block("ghost")


def test_a_factory_must_return_a_module() -> None:
    register_block("broken", lambda config, index, options: "not a module")
    try:
        with pytest.raises(
            TypeError, match=r"kind 'broken' returned str for layer 0; it must return an nn.Module"
        ):
            GPT(GPTConfig(**TINY, blocks="broken"))
    finally:
        unregister_block("broken")
