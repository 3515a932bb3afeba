"""Mixture of Depths: exact equivalences (float64), routing, gradients, the work signal, bad input."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_dynmo.dynamism import mod
from lightning_dynmo.dynamism.mod import PREDICTOR_LOSS, MoDBlock, MoDOptions, mod_config
from lightning_dynmo.dynamism.tokens import TokenSelection, select_tokens, token_counts
from lightning_dynmo.models import GPT, DenseBlock, GPTConfig
from lightning_dynmo.pipeline.model.contract import check_model_contract
from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses

SHAPE = {"vocab_size": 32, "seq_len": 16, "d_model": 16, "num_heads": 2}


def _model(
    capacity: float = 0.25, routing: str = "topk", num_layers: int = 4, token_bucket: int | None = 64
) -> GPT:
    config = mod_config(
        num_layers=num_layers, capacity=capacity, routing=routing, token_bucket=token_bucket, **SHAPE
    )
    return GPT(config).double()


def _block(
    capacity: float = 0.25, routing: str = "topk", token_bucket: int | None = 64
) -> tuple[MoDBlock, DenseBlock]:
    model = _model(capacity, routing, token_bucket=token_bucket)
    block = model.layers["1"]
    assert isinstance(block, MoDBlock)
    dense = DenseBlock(model.config).double()
    dense.load_state_dict(block.state_dict(), strict=False)
    return block, dense


def _hidden(seed: int = 0, rows: int = 3) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, generator=gen)


def _batch(seed: int = 0) -> Tensor:
    return torch.randint(0, 32, (4, SHAPE["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))


def test_the_ready_config_routes_every_other_block() -> None:
    model = _model()
    kinds = [type(block).__name__ for block in model.layers.values()]
    assert kinds == ["DenseBlock", "MoDBlock", "DenseBlock", "MoDBlock"]
    spec = check_model_contract(model)
    assert (spec.side_inputs, spec.side_state, spec.aux_losses) == ((), (), (PREDICTOR_LOSS,))


def test_capacity_one_with_a_unit_router_equals_the_dense_gpt() -> None:
    dense = GPT(GPTConfig(num_layers=4, **SHAPE)).double()
    full = _model(capacity=1.0)
    assert all(torch.equal(full.state_dict()[k], v) for k, v in dense.state_dict().items()), "same init"
    for i in (1, 3):
        block = full.layers[str(i)]
        assert isinstance(block, MoDBlock) and torch.equal(
            block.router.bias, torch.ones(1, dtype=torch.float64)
        )
        with torch.no_grad():
            block.router.weight.zero_()  # router output 1 for every token: the block's own output
    inputs = _batch()[:, :-1]
    expected = dense(inputs)
    assert torch.allclose(full(inputs), expected, rtol=0, atol=1e-12)
    # Negative control: at the paper's capacity the same weights compute something else.
    for i in (1, 3):
        block = full.layers[str(i)]
        assert isinstance(block, MoDBlock)
        block.options = MoDOptions(capacity=0.125)
    assert (full(inputs) - expected).abs().max().item() > 1e-6


def test_routed_tokens_get_the_block_run_on_them_alone_times_the_router_output() -> None:
    block, dense = _block(capacity=0.25)
    hidden = _hidden()
    out = block(hidden)
    weights = block.router(hidden).squeeze(-1)
    k = 4  # 25% of 16
    for row in range(hidden.shape[0]):
        chosen = weights[row].topk(k).indices.sort().values
        x = hidden[row, chosen].unsqueeze(0)
        expected = x + weights[row, chosen].view(1, -1, 1) * (dense(x) - x)  # the chosen tokens on their own
        assert torch.allclose(out[row, chosen], expected[0], rtol=0, atol=1e-12)
        skipped = torch.ones(hidden.shape[1], dtype=torch.bool)
        skipped[chosen] = False
        assert torch.equal(out[row, skipped], hidden[row, skipped]), "skipped tokens pass bit for bit"
    # Negative control: attention among the chosen tokens differs from attention over the whole row.
    chosen = weights[0].topk(k).indices.sort().values
    whole = dense(hidden[:1])[0, chosen]
    alone = dense(hidden[0, chosen].unsqueeze(0))[0]
    assert (whole - alone).abs().max().item() > 1e-6


def test_topk_routing_processes_a_fixed_count_and_predictor_routing_a_varying_one() -> None:
    block, _ = _block(capacity=0.25, token_bucket=None)
    rows: list[int] = []
    block.mlp.fc_in.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    for seed in range(3):
        block(_hidden(seed))
    assert rows == [3 * 4] * 3
    block.options = MoDOptions(capacity=0.25, routing="predictor", token_bucket=None)
    rows.clear()
    predicted = []
    for seed in range(3):
        hidden = _hidden(seed)
        predicted.append(int((block.predictor(hidden).squeeze(-1) > 0).sum()))
        block(hidden)
    assert rows == predicted and len(set(rows)) > 1, "the predictor decides, and its counts vary"
    counts = block.token_counts
    assert (counts.calls, counts.processed, counts.last_processed) == (6, 36 + sum(rows), rows[-1])
    assert token_counts(_model()).keys() == {1, 3}


def test_gradients_reach_the_router_and_the_predictor_learns_alone() -> None:
    model = _model()
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    model.training_step(_batch(), 0).backward()
    for i in (1, 3):
        block = model.layers[str(i)]
        assert isinstance(block, MoDBlock)
        assert block.router.weight.grad is not None and block.router.weight.grad.abs().sum() > 0
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in block.predictor.parameters())
    # Skipped tokens' outputs depend on nothing in the block.
    block, _ = _block()
    hidden = _hidden().requires_grad_(True)
    with collect_aux_losses(attach=False):
        out = block(hidden)
    weights = block.router(hidden).squeeze(-1).detach()
    skipped = torch.ones_like(weights, dtype=torch.bool).scatter(1, weights.topk(4, dim=1).indices, False)
    out[skipped].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in block.parameters())
    assert hidden.grad is not None
    assert torch.equal(hidden.grad, skipped.unsqueeze(-1).expand_as(hidden).to(hidden.dtype))
    # The predictor's loss (stop-gradient) reaches the predictor only.
    block.zero_grad()
    hidden.grad = None
    with collect_aux_losses(attach=False) as aux:
        block(hidden)
    torch.as_tensor(aux.total()).backward()
    assert hidden.grad is None
    trained = {name for name, p in block.named_parameters() if p.grad is not None and p.grad.any()}
    assert trained == {name for name, _ in block.named_parameters() if name.startswith("predictor.")}


def test_a_block_routing_no_token_returns_its_input_and_zero_gradients() -> None:
    block, _ = _block(routing="predictor")
    with torch.no_grad():
        block.predictor[-1].bias.fill_(-100.0)  # the predictor routes nothing
    hidden = _hidden()
    with collect_aux_losses(attach=False):
        out = block(hidden)
    assert torch.equal(out, hidden) and block.token_counts.last_processed == 0
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in block.parameters())


@pytest.mark.parametrize(("capacity", "seq", "k"), [(0.125, 16, 2), (0.3, 10, 3), (0.01, 16, 1), (1.0, 7, 7)])
def test_capacity_tokens(capacity: float, seq: int, k: int) -> None:
    assert MoDOptions(capacity=capacity).capacity_tokens(seq) == k


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"capacity": 0.0}, r"MoDOptions.capacity=0.0 must be in \(0, 1\]"),
        ({"capacity": 1.5}, r"MoDOptions.capacity=1.5 must be in \(0, 1\]"),
        ({"routing": "threshold"}, r"MoDOptions.routing='threshold' is not one of \('topk', 'predictor'\)"),
        (
            {"predictor_hidden": 0},
            r"MoDOptions.predictor_hidden=0 must be None \(d_model // 8\) or an integer",
        ),
        ({"predictor_loss_weight": -1.0}, r"predictor_loss_weight=-1.0 must be a finite number >= 0"),
        ({"token_bucket": 0}, r"MoDOptions.token_bucket=0 must be None \(exact token counts\) or an integer"),
        ({"token_bucket": 8.0}, r"MoDOptions.token_bucket=8.0 must be None"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoDOptions(**options)


def _routed_run(token_bucket: int | None, hidden: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor], Tensor]:
    """Output, input gradient, parameter gradients and aux loss of a predictor-routed block."""
    block, _ = _block(capacity=0.25, routing="predictor", token_bucket=token_bucket)
    hidden = hidden.clone().requires_grad_(True)
    with collect_aux_losses(attach=False) as aux:
        out = block(hidden)
    aux_loss = torch.as_tensor(aux.total())
    ((out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum() + aux_loss).backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}
    assert hidden.grad is not None
    return out.detach(), hidden.grad, grads, aux_loss.detach()


def test_token_buckets_pad_the_computed_shape_and_change_no_output_gradient_or_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hidden = _hidden(rows=3)
    exact = _routed_run(None, hidden)
    block, _ = _block(capacity=0.25, routing="predictor", token_bucket=5)
    rows: list[int] = []
    block.mlp.fc_in.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    with collect_aux_losses(attach=False):
        block(hidden)
    count = block.token_counts.last_processed
    assert count % 5 != 0 and rows == [-(-count // 5) * 5], "the block computes on the bucketed count"
    bucketed = _routed_run(5, hidden)
    assert torch.allclose(bucketed[0], exact[0], rtol=0, atol=1e-12)
    assert torch.allclose(bucketed[1], exact[1], rtol=0, atol=1e-12)
    assert bucketed[2].keys() == exact[2].keys()
    for name, grad in exact[2].items():
        assert torch.allclose(bucketed[2][name], grad, rtol=0, atol=1e-12), name
    assert torch.allclose(bucketed[3], exact[3], rtol=0, atol=1e-12)

    # Negative control: the padded attention slots, if they counted as keys, would change the result.
    def padding_as_keys(mask: Tensor, bucket: int | None = None) -> TokenSelection:
        selection = select_tokens(mask, bucket)
        return dataclasses.replace(selection, valid=torch.ones_like(selection.valid))

    monkeypatch.setattr(mod, "select_tokens", padding_as_keys)
    leaky = _routed_run(5, hidden)
    assert (leaky[0] - exact[0]).abs().max().item() > 1e-6
