"""The demo model and data: seeded, contract-abiding, and strict about bad settings."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_dynmo.demos import DemoConfig, DemoGPT, EmulatedCost, RandomTokenDataModule, RandomTokenDataset
from lightning_dynmo.demos.emulated_block import LinearEmulatedBlock
from lightning_dynmo.models.gpt import build_unit


def test_same_seed_same_model_and_data() -> None:
    a, b = DemoGPT(num_layers=2), DemoGPT(DemoConfig(num_layers=2))
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )
    assert not torch.equal(a.head.weight, DemoGPT(num_layers=2, seed=1).head.weight)
    assert torch.equal(RandomTokenDataset(seed=3).tokens, RandomTokenDataset(seed=3).tokens)


def test_forward_equals_the_pipeline_pieces_in_order() -> None:
    model = DemoGPT(num_layers=3)
    batch = next(iter(RandomTokenDataModule(batch_size=4).train_dataloader()))
    inputs, target = model.pipeline_batch(batch)
    hidden = model.pipeline_first(inputs)
    for i in range(3):
        hidden = model.layers[str(i)](hidden)
    torch.testing.assert_close(model.pipeline_last(hidden), model(inputs), rtol=0, atol=0)
    assert target.shape == inputs.shape == (4, 16)


def test_dataloader_has_fixed_batch_shapes() -> None:
    shapes = {tuple(b.shape) for b in RandomTokenDataModule(batch_size=8, num_samples=20).train_dataloader()}
    assert shapes == {(8, 17)}


def test_emulated_cost_sleeps_and_is_an_identity() -> None:
    cost = EmulatedCost(fwd_ms=20.0)
    x = torch.randn(3, requires_grad=True)
    start = time.perf_counter()
    y = cost(x)
    y.sum().backward()
    assert time.perf_counter() - start >= 0.06  # 20 ms forward + 40 ms backward: sleep never returns early
    assert torch.equal(y, x) and torch.equal(x.grad, torch.ones(3))


def test_linear_blocks_compute_one_linear_then_sleep_and_build_from_the_config_alone() -> None:
    dense = DemoGPT(num_layers=2, sleep_ms=(5.0, 0.0))
    light = DemoGPT(num_layers=2, sleep_ms=(5.0, 0.0), block_compute="linear")
    block = light.layers["0"]
    assert isinstance(block, LinearEmulatedBlock) and block.cost.fwd_ms == 5.0
    assert sum(p.numel() for p in block.parameters()) < sum(p.numel() for p in dense.layers["0"].parameters())
    x = torch.randn(2, 16, 32, requires_grad=True)
    expected = x + block.proj(x)
    start = time.perf_counter()
    out = block(x)
    out.sum().backward()
    assert time.perf_counter() - start >= 0.015  # 5 ms forward, 10 ms backward
    assert torch.allclose(out, expected)
    # A rank receiving the layer builds it from the GPT's config, as it builds a dense one.
    rebuilt = build_unit(light.config, "layers.1")
    assert isinstance(rebuilt, LinearEmulatedBlock)
    assert rebuilt.proj.weight.shape == block.proj.weight.shape


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="d_model=30 is not divisible by num_heads=4"):
        DemoConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="num_layers=0 must be >= 1"):
        DemoConfig(num_layers=0)
    with pytest.raises(ValueError, match="sleep_ms has 1 values but num_layers=2"):
        DemoConfig(num_layers=2, sleep_ms=(1.0,))
    with pytest.raises(ValueError, match="emulated costs must be >= 0 milliseconds"):
        EmulatedCost(fwd_ms=-1.0)
    with pytest.raises(ValueError, match=r"compute='sparse' must be one of \('dense', 'linear'\)"):
        DemoConfig(block_compute="sparse")
    with pytest.raises(ValueError, match="need num_samples >= 1"):
        RandomTokenDataset(num_samples=0)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        RandomTokenDataModule(batch_size=0)
