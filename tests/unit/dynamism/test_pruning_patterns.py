"""Structured pruning patterns in float64: 2:4 and block masks are the exact global top-k of their units
(brute force), the kernel choice changes no mask, threshold or result, the BSR kernel equals the masked
dense kernel forward and backward, and a 2:4 mask meets the semi-structured storage contract."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_dynmo.dynamism import sparse_linear
from lightning_dynmo.dynamism.magnitude_select import num_to_prune
from lightning_dynmo.dynamism.pruning import (
    GlobalMagnitudePruner,
    PruningConfig,
    PruningScope,
    prunable_linears,
)
from lightning_dynmo.dynamism.pruning_patterns import compress_two_four, is_two_four
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import MaskedLinear
from lightning_dynmo.events import EventBus
from lightning_dynmo.models import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = GPTConfig(num_layers=3, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
HALF = PruningSchedule(final_sparsity=0.5)


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CONFIG).double()
    GlobalMagnitudePruner.prepare(_blocks(model))
    return model


def _blocks(model: GPT) -> dict[int, Any]:
    return {int(k): m for k, m in model.layers.items()}


def _prune(model: GPT, sparsity: float, **config: Any) -> Any:
    pruner = GlobalMagnitudePruner(PruningConfig(**config), event_bus=EventBus())
    return pruner.prune_to(sparsity, PruningScope(_blocks(model), CONFIG.num_layers))


def _brute_force_two_four(model: GPT, sparsity: float) -> list[torch.Tensor]:
    """Candidates: the 2 smallest of each group of 4 (ties by position); then a stable global sort."""
    linears = prunable_linears(_blocks(model))
    keys, candidate = [], []
    for _, _, m in linears:
        groups = m.weight.detach().abs().reshape(m.out_features, -1, 4)
        rank = torch.empty_like(groups, dtype=torch.long)
        for g in range(groups.shape[1]):
            for row in range(groups.shape[0]):
                order = sorted(range(4), key=lambda j, r=row, gg=g: (float(groups[r, gg, j]), j))
                for position, j in enumerate(order):
                    rank[row, g, j] = position
        keys.append(m.weight.detach().abs().reshape(-1))
        candidate.append((rank < 2).reshape(-1))
    flat_keys, flat_candidate = torch.cat(keys), torch.cat(candidate)
    k = num_to_prune(sparsity, flat_keys.numel())
    order = [i for i in torch.sort(flat_keys, stable=True).indices.tolist() if flat_candidate[i]]
    keep = torch.ones(flat_keys.numel(), dtype=torch.bool)
    keep[order[:k]] = False
    return list(keep.split([m.weight.numel() for _, _, m in linears]))


def _brute_force_blocks(model: GPT, sparsity: float, block: int) -> list[torch.Tensor]:
    linears = prunable_linears(_blocks(model))
    norms = []
    for _, _, m in linears:
        w = m.weight.detach()
        rows, cols = w.shape[0] // block, w.shape[1] // block
        norms.append(
            torch.tensor(
                [
                    float(w[r * block : (r + 1) * block, c * block : (c + 1) * block].norm())
                    for r in range(rows)
                    for c in range(cols)
                ],
                dtype=torch.float64,
            )
        )
    flat = torch.cat(norms)
    keep = torch.ones(flat.numel(), dtype=torch.bool)
    keep[torch.sort(flat, stable=True).indices[: num_to_prune(sparsity, flat.numel())]] = False
    masks = []
    for (_, _, m), kept in zip(linears, keep.split([n.numel() for n in norms]), strict=True):
        grid = kept.view(m.weight.shape[0] // block, m.weight.shape[1] // block)
        masks.append(grid.repeat_interleave(block, 0).repeat_interleave(block, 1).reshape(-1))
    return masks


def _masks(model: GPT) -> list[torch.Tensor]:
    return [m.weight_mask.reshape(-1).clone() for _, _, m in prunable_linears(_blocks(model))]


def test_two_four_pruning_is_the_global_top_k_of_the_candidates_and_ends_on_the_full_pattern() -> None:
    model = _model()
    pruner = GlobalMagnitudePruner(
        PruningConfig(pattern="2:4", kernel="dense", schedule=HALF), event_bus=EventBus()
    )
    for sparsity in (0.2, 0.35, 0.5):
        expected = _brute_force_two_four(model, sparsity)
        report = pruner.prune_to(sparsity, PruningScope(_blocks(model), CONFIG.num_layers))
        for got, want in zip(_masks(model), expected, strict=True):
            assert torch.equal(got, want)
        assert report.num_pruned == num_to_prune(sparsity, report.num_prunable)
        layouts = [is_two_four(m.weight_mask) for _, _, m in prunable_linears(_blocks(model))]
        assert all(layouts) == (sparsity == 0.5), "2:4 once the schedule reaches 50%, not before"
    for _, _, m in prunable_linears(_blocks(model)):  # exactly 2 of every 4 at 50%
        assert bool((m.weight_mask.reshape(m.out_features, -1, 4).sum(-1) == 2).all())
    # Negative control: unstructured pruning at 50% is not a 2:4 pattern.
    free = _model()
    _prune(free, 0.5, kernel="dense")
    assert not all(is_two_four(m.weight_mask) for _, _, m in prunable_linears(_blocks(free)))


def test_block_pruning_is_the_global_top_k_of_block_norms() -> None:
    model = _model()
    pruner = GlobalMagnitudePruner(
        PruningConfig(pattern="block", block_size=8, kernel="dense"), event_bus=EventBus()
    )
    for sparsity in (0.3, 0.75):
        expected = _brute_force_blocks(model, sparsity, 8)
        report = pruner.prune_to(sparsity, PruningScope(_blocks(model), CONFIG.num_layers))
        for got, want in zip(_masks(model), expected, strict=True):
            assert torch.equal(got, want)
        entries = sum(m.weight_mask.numel() for _, _, m in prunable_linears(_blocks(model)))
        pruned = sum(int((~m.weight_mask).sum()) for _, _, m in prunable_linears(_blocks(model)))
        assert (
            pruned / entries == pytest.approx(report.sparsity, abs=0) and report.num_prunable == entries // 64
        )


@pytest.mark.parametrize(
    ("pattern", "kernels"), [("block", ("dense", "bsr", "csr")), ("unstructured", ("dense", "csr"))]
)
def test_the_kernel_changes_no_mask_threshold_or_result(pattern: str, kernels: tuple[str, ...]) -> None:
    batch = torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(1))
    runs = []
    for kernel in kernels:
        model = _model()
        model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
        report = _prune(model, 0.75, pattern=pattern, block_size=8, kernel=kernel)
        assert {k.kernel for k in report.kernels} == {kernel}
        loss = model.training_step(batch, 0)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        runs.append((report.threshold, report.num_pruned, _masks(model), loss.detach(), grads))
    first = runs[0]
    for threshold, num_pruned, masks, loss, grads in runs[1:]:
        assert (threshold, num_pruned) == (first[0], first[1])
        assert all(torch.equal(a, b) for a, b in zip(masks, first[2], strict=True))
        torch.testing.assert_close(loss, first[3], rtol=0, atol=1e-12)
        for a, b in zip(grads, first[4], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_bsr_kernel_equals_the_masked_dense_kernel_forward_and_backward() -> None:
    torch.manual_seed(0)
    layer = MaskedLinear.convert_(torch.nn.Linear(16, 24).double())
    blocks = torch.rand(3, 2, generator=torch.Generator().manual_seed(2)) < 0.5
    layer.set_mask(blocks.repeat_interleave(8, 0).repeat_interleave(8, 1))
    layer.set_kernel("bsr", bsr_block=8)
    x = torch.randn(5, 7, 16, dtype=torch.float64, requires_grad=True)
    results = []
    for forward in (layer.forward_dense, layer.forward_bsr):
        out = forward(x)
        grads = torch.autograd.grad(
            (out * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum(), [x, layer.weight, layer.bias]
        )
        results.append((out, *grads))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert not results[1][2][~layer.weight_mask].any(), "pruned weights get a zero gradient"
    # Negative control: the unmasked product differs.
    assert (torch.nn.functional.linear(x, layer.weight + 1, layer.bias) - results[0][0]).abs().max() > 1e-3


def test_a_two_four_mask_meets_the_semi_structured_contract() -> None:
    torch.manual_seed(0)
    model = _model()
    _prune(model, 0.5, pattern="2:4", kernel="dense", schedule=HALF)
    x = torch.randn(6, 16, dtype=torch.float64)
    for _, _, m in prunable_linears(_blocks(model)):
        values, positions = compress_two_four(m.weight.detach(), m.weight_mask)
        assert values.shape == (m.out_features, m.in_features // 2)
        rebuilt = torch.zeros(m.out_features, m.in_features // 4, 4, dtype=torch.float64)
        rebuilt.scatter_(-1, positions.view(m.out_features, -1, 2), values.view(m.out_features, -1, 2))
        rebuilt = rebuilt.view(m.out_features, m.in_features)
        assert torch.equal(rebuilt, m.weight.detach() * m.weight_mask)
        if m.in_features == 16:
            torch.testing.assert_close(
                x @ rebuilt.t(), m.forward_dense(x).detach() - m.bias.detach(), rtol=0, atol=1e-12
            )
    with pytest.raises(ValueError, match=r"compress_two_four: the mask keeps more than 2 of some group of 4"):
        compress_two_four(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.bool))


def test_structured_kernels_that_cannot_run_here_are_refused() -> None:
    model = _model()
    with pytest.raises(
        ValueError, match=r"kernel='semi_structured' cannot run layers.0.attn.qkv \(torch.float64 on cpu\)"
    ):
        _prune(model, 0.3, pattern="2:4", kernel="semi_structured", schedule=HALF)
    auto = _model()
    report = _prune(auto, 0.5, pattern="2:4", kernel="auto", schedule=HALF, csr_min_sparsity=0.0)
    assert {k.kernel for k in report.kernels} == {"dense"} and all(k.csr_s is None for k in report.kernels)
    with pytest.raises(ValueError, match=r"MaskedLinear.set_kernel\(kernel='bsr'\) needs bsr_block"):
        MaskedLinear.convert_(torch.nn.Linear(8, 8)).set_kernel("bsr")


def test_shapes_the_pattern_cannot_tile_are_refused() -> None:
    model = _model()
    with pytest.raises(
        ValueError, match=r"PruningConfig.block_size=6 does not tile layers.0.attn.qkv.weight \(48x16\)"
    ):
        _prune(model, 0.3, pattern="block", block_size=6)
    odd = GPT(GPTConfig(num_layers=1, d_model=18, num_heads=2, seq_len=8, vocab_size=32)).double()
    layers = {int(k): m for k, m in odd.layers.items()}
    GlobalMagnitudePruner.prepare(layers)
    pruner = GlobalMagnitudePruner(PruningConfig(pattern="2:4", schedule=HALF), event_bus=EventBus())
    with pytest.raises(
        ValueError, match=r"pattern='2:4' needs each weight's input size to be a multiple of 4; "
    ):
        pruner.prune_to(0.3, PruningScope(layers, 1))


def _two_four_layer(dtype: torch.dtype = torch.float64, device: str = "cpu") -> MaskedLinear:
    torch.manual_seed(0)
    layer = MaskedLinear.convert_(torch.nn.Linear(32, 16)).to(device=device, dtype=dtype)
    magnitude = layer.weight.detach().abs().reshape(16, 8, 4)
    keep = magnitude.argsort(dim=-1).argsort(dim=-1) >= 2  # the 2 largest of every 4
    layer.set_mask(keep.reshape(16, 32))
    return layer


def test_the_semi_structured_kernel_is_the_dense_function_with_the_storage_emulated_on_a_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's to_sparse_semi_structured is CUDA-only: on a CPU the compressed storage is emulated
    # (compress, then rebuild), which checks the kernel's autograd wiring around it in float64.
    def emulated(weight: torch.Tensor) -> torch.Tensor:
        values, positions = compress_two_four(weight, weight != 0)
        out_features, in_features = weight.shape
        rebuilt = torch.zeros(out_features, in_features // 4, 4, dtype=weight.dtype)
        rebuilt.scatter_(-1, positions.view(out_features, -1, 2), values.view(out_features, -1, 2))
        return rebuilt.view(out_features, in_features)

    monkeypatch.setattr(sparse_linear, "_semi_structured", emulated)
    layer = _two_four_layer()
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    results = []
    for forward in (layer.forward_dense, layer.forward_semi_structured):
        out = forward(x)
        weight = torch.linspace(-1, 1, 16, dtype=torch.float64)
        results.append((out, *torch.autograd.grad((out * weight).sum(), [x, layer.weight, layer.bias])))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # Negative control: an emulation that keeps the wrong 2 of 4 computes something else.
    monkeypatch.setattr(sparse_linear, "_semi_structured", lambda w: emulated(w).roll(1, dims=1))
    assert (layer.forward_semi_structured(x) - results[0][0]).abs().max() > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_semi_structured_kernel_on_cuda_is_close_to_dense_in_bf16() -> None:
    layer = _two_four_layer(torch.bfloat16, "cuda")
    assert layer.supports("semi_structured")
    x = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(layer.forward_semi_structured(x), layer.forward_dense(x), rtol=2e-2, atol=2e-2)
