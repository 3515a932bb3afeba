"""MaskedLinear: the CSR kernel equals the dense one on the masked weight, forward and backward (float64);
its state (mask, kernel) survives conversion, migration packing and state_dict; bad masks are refused."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.dynamism.sparse_linear import MaskedLinear, SparsePattern, time_kernels
from lightning_dynmo.pipeline.migration.pack import pack_unit, unpack_unit

# Single-threaded (conftest.py): small matrices are much faster so on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def masked_layer(in_features: int, out_features: int, sparsity: float, bias: bool = True) -> MaskedLinear:
    torch.manual_seed(0)
    layer = MaskedLinear(in_features, out_features, bias=bias, dtype=torch.float64)
    layer.set_mask(torch.rand(out_features, in_features) >= sparsity)
    return layer


def run(layer: MaskedLinear, kernel: str, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    layer.set_kernel(kernel)
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad)
    grads = [x.grad, layer.weight.grad] + ([layer.bias.grad] if layer.bias is not None else [])
    return [y.detach(), *grads]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("shape", "sparsity"), [((3, 5), 0.5), ((2, 4, 5), 0.9), ((7, 5), 0.0), ((4, 5), 1.0)]
)
def test_csr_equals_dense_forward_and_backward(shape: tuple[int, ...], sparsity: float, bias: bool) -> None:
    layer = masked_layer(5, 6, sparsity, bias)
    x = torch.randn(*shape, dtype=torch.float64)
    grad = torch.randn(*shape[:-1], 6, dtype=torch.float64)
    dense, csr = run(layer, "dense", x, grad), run(layer, "csr", x, grad)
    for a, b in zip(dense, csr, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # The reference is an nn.Linear on the masked weight; pruned entries get exactly zero gradient.
    plain = nn.Linear(5, 6, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        plain.weight.copy_(layer.weight * layer.weight_mask)
        if bias:
            plain.bias.copy_(layer.bias)
    torch.testing.assert_close(plain(x), dense[0], rtol=1e-12, atol=1e-12)
    for grads in (dense, csr):
        assert (grads[2][~layer.weight_mask] == 0).all()


def test_a_dense_kernel_that_forgets_the_mask_is_caught() -> None:
    # Negative control for the comparison above: the unmasked weight gives other numbers.
    layer = masked_layer(5, 6, 0.5)
    with torch.no_grad():
        layer.weight.add_(1.0)  # pruned entries non-zero: only the mask hides them
    x, grad = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    csr = run(layer, "csr", x, grad)
    unmasked = nn.functional.linear(x, layer.weight, layer.bias)
    assert (unmasked - csr[0]).abs().max() > 1e-3


def test_the_pattern_orders_kept_entries_row_major_for_both_orientations() -> None:
    mask = torch.tensor([[True, False, True], [False, False, True]])
    pattern = SparsePattern.of(mask)
    assert pattern.crow.tolist() == [0, 2, 3] and pattern.col.tolist() == [0, 2, 2]
    assert pattern.flat.tolist() == [0, 2, 5]
    assert pattern.crow_t.tolist() == [0, 1, 1, 3] and pattern.col_t.tolist() == [0, 0, 1]
    assert pattern.flat_t.tolist() == [0, 2, 5]  # W^T's rows are W's columns


def test_convert_keeps_the_module_its_parameters_and_the_rng() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 3)
    linear.residual_projection = True  # type: ignore[assignment]
    weight, state = linear.weight, torch.random.get_rng_state()
    masked = MaskedLinear.convert_(linear)
    assert masked is linear and masked.weight is weight and masked.residual_projection
    assert torch.equal(torch.random.get_rng_state(), state)
    assert masked.weight_mask.all() and masked.kernel == "dense" and masked.sparsity == 0.0
    x = torch.randn(2, 4)
    assert torch.equal(masked(x), nn.functional.linear(x, weight, linear.bias))  # unpruned: exactly nn.Linear
    assert MaskedLinear.convert_(masked) is masked


def test_convert_refuses_a_linear_subclass() -> None:
    class Scaled(nn.Linear):
        pass

    with pytest.raises(TypeError, match=r"MaskedLinear.convert_ takes a plain nn.Linear, got .*Scaled"):
        MaskedLinear.convert_(Scaled(2, 2))


def test_set_mask_zeroes_pruned_weights_and_never_revives_them() -> None:
    layer = masked_layer(4, 4, 0.5)
    assert (layer.weight[~layer.weight_mask] == 0).all()
    assert layer.sparsity == pytest.approx(1 - layer.weight_mask.float().mean().item())
    with pytest.raises(ValueError, match=r"keeps weights that are already pruned"):
        layer.set_mask(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"the mask has shape \(4, 3\) but the weight \(4, 4\)"):
        layer.set_mask(torch.ones(4, 3, dtype=torch.bool))
    with pytest.raises(
        ValueError, match=r"kernel='blocked'\): use one of \('dense', 'csr', 'bsr', 'semi_structured'\)"
    ):
        layer.set_kernel("blocked")


def test_state_travels_in_a_migration_packet_without_the_pattern_cache() -> None:
    block = nn.Sequential(masked_layer(5, 6, 0.7))
    layer = block[0]
    layer.set_kernel("csr")
    x = torch.randn(3, 5, dtype=torch.float64)
    expected = block(x)
    assert layer._pattern is not None  # built by the forward
    packed = pack_unit("layers.0", block)
    received, _ = unpack_unit(packed.structure, packed.payloads)
    moved = received[0]
    assert isinstance(moved, MaskedLinear) and moved.kernel == "csr" and moved._pattern is None
    assert torch.equal(moved.weight_mask, layer.weight_mask)
    assert torch.equal(received(x), expected)
    assert copy.deepcopy(layer)._pattern is None


def test_state_dict_carries_the_mask_and_the_kernel() -> None:
    source = masked_layer(5, 6, 0.7)
    source.set_kernel("csr")
    state = source.state_dict()
    assert set(state) == {"weight", "bias", "weight_mask", "_extra_state"}
    target = MaskedLinear(5, 6, dtype=torch.float64)
    target.load_state_dict(state)
    assert target.kernel == "csr" and torch.equal(target.weight_mask, source.weight_mask)
    x = torch.randn(2, 5, dtype=torch.float64)
    assert torch.equal(target(x), source(x))  # the loaded mask is in force (the layer knows it is pruned)


def test_time_kernels_measures_both_kernels_without_touching_grads() -> None:
    layer = masked_layer(8, 8, 0.9)
    ticks = iter(range(1000))

    def clock() -> float:
        return float(next(ticks))

    times: dict[str, Any] = time_kernels(layer, rows=4, repeats=3, clock=clock)
    assert set(times) == {"dense", "csr"} and all(t == 1.0 for t in times.values())
    assert layer.weight.grad is None and layer.bias is not None and layer.bias.grad is None


def test_a_meta_declared_layer_materialises_unpruned() -> None:
    # Local construction gives meta tensors storage, then calls reset_parameters.
    with torch.device("meta"):
        layer = MaskedLinear(4, 3)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    assert layer.weight_mask.all() and layer.kernel == "dense" and layer.sparsity == 0.0
    pruned = masked_layer(4, 3, 0.5)
    pruned.set_kernel("csr")
    pruned.reset_parameters()
    assert pruned.weight_mask.all() and pruned.kernel == "dense"


def test_the_csr_kernel_falls_back_to_dense_where_it_cannot_run() -> None:
    # torch's CPU CSR kernels have no bfloat16: under autocast (or for bf16 weights) the layer runs dense.
    layer = masked_layer(8, 6, 0.5)
    layer.float()
    layer.set_kernel("csr")
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad is not None and (layer.weight.grad[~layer.weight_mask] == 0).all()
    assert layer.csr_supported and not layer.to(torch.bfloat16).csr_supported
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
