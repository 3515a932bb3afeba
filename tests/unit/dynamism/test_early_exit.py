"""Early exit: exact equivalences (float64), exit decisions, gradients, work signal, events, bad input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_dynmo.dynamism.early_exit import (
    EXIT_LOSS,
    EXITED,
    EarlyExitBlock,
    EarlyExitOptions,
    early_exit_config,
)
from lightning_dynmo.dynamism.tokens import TokenSelection, token_counts
from lightning_dynmo.events import DynamismEvent, default_bus
from lightning_dynmo.models import GPT, DenseBlock, GPTConfig
from lightning_dynmo.pipeline.model.contract import HIDDEN, check_model_contract
from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses
from lightning_dynmo.pipeline.step.stage import StageModule

SHAPE = {"vocab_size": 32, "seq_len": 12, "d_model": 16, "num_heads": 2}
# An untrained exit head's confidence is ~1e-3 with 32 tokens: this threshold lets roughly half leave.
EXITING = 2e-3


def _model(threshold: float, num_layers: int = 4, first_exit_layer: int = 1, **options: Any) -> GPT:
    config = early_exit_config(
        num_layers=num_layers, first_exit_layer=first_exit_layer, threshold=threshold, **options, **SHAPE
    )
    return GPT(config).double()


def _batch(rows: int = 4, seed: int = 0) -> Tensor:
    return torch.randint(0, 32, (rows, SHAPE["seq_len"] + 1), generator=torch.Generator().manual_seed(seed))


def _states(model: GPT, batch: Tensor) -> list[dict[str, Tensor]]:
    """The state after the embedding and after every block (hidden state and exit mask)."""
    inputs, target = batch[:, :-1], batch[:, 1:]
    state = dict(model.pipeline_first(inputs))
    states = [dict(state)]
    for block in model.layers.values():
        kwargs = {n: state.get(n, target) for n in getattr(block, "pipeline_inputs", ())}
        out = block(state[HIDDEN], **kwargs)
        hidden, updates = out if isinstance(out, tuple) else (out, {})
        state = {**state, **updates, HIDDEN: hidden}
        states.append(dict(state))
    return states


def test_the_gpt_declares_labels_the_exit_mask_and_the_exit_loss() -> None:
    model = _model(EXITING)
    spec = check_model_contract(model)
    assert (spec.side_inputs, spec.side_state, spec.aux_losses) == (("labels",), (EXITED,), (EXIT_LOSS,))
    first = model.pipeline_first(_batch()[:, :-1])
    assert first[EXITED].dtype == torch.bool and not first[EXITED].any()
    assert model.layers["3"].exit_head is None, "the last layer has no exit head: the shared head follows"


def test_an_unreachable_threshold_equals_the_dense_gpt() -> None:
    dense = GPT(GPTConfig(num_layers=4, **SHAPE)).double()
    never = _model(threshold=2.0, first_exit_layer=0, loss_weight=0.0)
    shared = dense.state_dict()
    assert all(torch.equal(never.state_dict()[k], v) for k, v in shared.items()), "same initial weights"
    batch = _batch()
    inputs, target = batch[:, :-1], batch[:, 1:]
    expected = dense(inputs)
    assert torch.allclose(never(inputs, target), expected, rtol=0, atol=1e-12)
    dense.log = never.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    dense.training_step(batch, 0).backward()
    never.training_step(batch, 0).backward()
    named = dict(never.named_parameters())
    for name, param in dense.named_parameters():
        assert param.grad is not None and named[name].grad is not None
        assert torch.allclose(named[name].grad, param.grad, rtol=0, atol=1e-12), name
    # Negative control: with tokens leaving, the same weights compute something else.
    exiting = _model(threshold=EXITING, first_exit_layer=0, loss_weight=0.0)
    assert (exiting(inputs, target) - expected).abs().max().item() > 1e-6


def test_an_exited_token_is_carried_bit_identically_through_later_blocks() -> None:
    states = _states(_model(EXITING), _batch())
    exited_after_1 = states[2][EXITED]  # layers.1 is the first exit point
    assert 0 < exited_after_1.sum() < exited_after_1.numel(), "the test needs leaving and staying tokens"
    assert states[-1][EXITED].sum() > exited_after_1.sum(), "later exits too"
    for later in states[3:]:
        assert torch.equal(later[HIDDEN][exited_after_1], states[2][HIDDEN][exited_after_1])
        assert later[EXITED][exited_after_1].all(), "an exit is final"
    staying = ~states[-1][EXITED]
    assert not torch.equal(states[-1][HIDDEN][staying], states[2][HIDDEN][staying])


def _block_and_dense(
    threshold: float = EXITING, token_bucket: int | None = 64
) -> tuple[EarlyExitBlock, DenseBlock]:
    model = _model(threshold, token_bucket=token_bucket)
    block = model.layers["2"]
    assert isinstance(block, EarlyExitBlock)
    dense = DenseBlock(model.config).double()
    dense.load_state_dict(block.state_dict(), strict=False)
    return block, dense


def _inputs(exit_share: float = 0.5, seed: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, SHAPE["seq_len"], SHAPE["d_model"], dtype=torch.float64, generator=gen)
    labels = torch.randint(0, 32, (3, SHAPE["seq_len"]), generator=gen)
    exited = torch.rand(3, SHAPE["seq_len"], generator=gen) < exit_share
    return hidden, labels, exited


def test_active_tokens_get_what_a_dense_block_computes_with_exited_tokens_as_keys() -> None:
    block, dense = _block_and_dense()
    hidden, labels, exited = _inputs()
    exited[1] = True  # a row with no active token
    out, _ = block(hidden, labels, exited)
    expected = torch.where(exited.unsqueeze(-1), hidden, dense(hidden))
    assert torch.allclose(out, expected, rtol=0, atol=1e-12)
    assert torch.equal(out[exited], hidden[exited])
    # Negative control: exited tokens' carried states are keys; change one and later active tokens move.
    changed = hidden.clone()
    first_exited = int(exited[0].nonzero()[0])
    changed[0, first_exited] += torch.linspace(-1.0, 1.0, SHAPE["d_model"], dtype=torch.float64)
    moved, _ = block(changed, labels, exited)
    later_active = ~exited[0] & (torch.arange(exited.shape[1]) > first_exited)
    assert later_active.any()
    assert (moved[0][later_active] - out[0][later_active]).abs().max().item() > 1e-6


def test_later_blocks_compute_on_the_gathered_active_tokens_only() -> None:
    block, _ = _block_and_dense(token_bucket=None)
    hidden, labels, exited = _inputs(exit_share=0.75)
    rows: list[int] = []
    handle = block.mlp.fc_in.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    block(hidden, labels, exited)
    handle.remove()
    assert rows == [int((~exited).sum())]


def test_exit_decisions_follow_the_confidence_and_the_position_decayed_threshold() -> None:
    block, _ = _block_and_dense()
    block.options = EarlyExitOptions(threshold=EXITING, position_temperature=4.0)
    hidden, labels, exited = _inputs()
    out, updates = block(hidden, labels, exited)
    assert block.exit_head is not None and block.exit_norm is not None
    probs = block.exit_head(block.exit_norm(out)).softmax(-1).topk(2, dim=-1).values
    confidence = probs[..., 0] - probs[..., 1]
    positions = torch.arange(SHAPE["seq_len"])
    thresholds = EXITING * (0.9 + 0.1 * torch.exp(-4.0 * positions.double() / SHAPE["seq_len"]))
    assert torch.allclose(block.exit_thresholds(positions), thresholds, rtol=1e-15, atol=0)
    expected = exited | (confidence >= thresholds)
    assert torch.equal(updates[EXITED], expected)
    assert (updates[EXITED] & ~exited).any() and (~updates[EXITED]).any()


def test_gradients_reach_the_exit_heads_and_nothing_reaches_a_skipped_token() -> None:
    model = _model(EXITING)
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    model.training_step(_batch(), 0).backward()
    for i in (1, 2):
        head = model.layers[str(i)].exit_head
        assert head is not None and head.weight.grad is not None and head.weight.grad.abs().sum() > 0
    # An exited token's output depends on nothing in the block; its input passes with gradient one.
    block, _ = _block_and_dense()
    hidden, labels, exited = _inputs()
    hidden.requires_grad_(True)
    with collect_aux_losses(attach=False):  # the exit loss is not part of this check
        out, _ = block(hidden, labels, exited)
    out[exited].sum().backward()
    assert all(p.grad is None or not p.grad.any() for p in block.parameters())
    assert hidden.grad is not None
    assert torch.equal(hidden.grad, exited.unsqueeze(-1).expand_as(hidden).to(hidden.dtype))


def test_a_block_whose_tokens_all_left_returns_its_input_and_zero_gradients() -> None:
    block, _ = _block_and_dense()
    hidden, labels, _ = _inputs()
    exited = torch.ones(hidden.shape[:2], dtype=torch.bool)
    out, updates = block(hidden, labels, exited)
    assert torch.equal(out, hidden) and torch.equal(updates[EXITED], exited)
    out.sum().backward()
    grads = [p.grad for p in block.parameters()]
    assert all(g is not None and not g.any() for g in grads), "zeros, not None: replicas sync the same set"


def test_token_counts_are_the_active_tokens_of_training_forwards_only() -> None:
    model = _model(EXITING)
    batch = _batch()
    states = _states(model, batch)
    counts = token_counts(model)
    assert sorted(counts) == [1, 2, 3]
    for i in (1, 2, 3):
        active = int((~states[i][EXITED]).sum())
        assert (counts[i].last_processed, counts[i].last_seen, counts[i].calls) == (
            active,
            batch[:, 1:].numel(),
            1,
        )
    assert counts[1].processed > counts[2].processed > counts[3].processed, "later layers get fewer"
    model.eval()
    _states(model, batch)
    assert counts[3].calls == 1, "evaluation is not counted"
    model.train()
    stage = StageModule(model, check_model_contract(model), range(4), first=True, last=True)
    with stage.shape_inference():
        _states(model, batch)
    assert counts[3].calls == 1, "torch's shape-inference pass is not counted"


@pytest.fixture
def events() -> Iterator[list[DynamismEvent]]:
    seen: list[DynamismEvent] = []
    unsubscribe = default_bus().subscribe(seen.append)
    yield seen
    unsubscribe()


def _steps(model: GPT, seeds: range) -> None:
    """Training forwards of one batch per optimizer step, each step closed as the GPT closes it."""
    for seed in seeds:
        _states(model, _batch(seed=seed))
        for block in model.layers.values():
            if isinstance(block, EarlyExitBlock):
                block.after_optimizer_step(step=seed)


def test_a_layer_announces_when_its_share_of_active_tokens_moves(events: list[DynamismEvent]) -> None:
    model = _model(EXITING, event_shift=0.1)
    _states(model, _batch())
    assert events == [], "events come when an optimizer step closes, not per micro-batch"
    _steps(model, range(3))
    layers = sorted({e.layers for e in events})
    assert layers == [(2,), (3,)], "layer 1 sees every token (nothing exits before it)"
    assert all(
        e.kind == "routing" and e.detail.startswith("early exit: active tokens 100% ->") for e in events
    )
    assert all(e.step == 0 for e in events), "the share drops at once: the first step announces it"
    first_count = len(events)
    _steps(model, range(3, 5))
    assert len(events) == first_count, "a stable share announces nothing more"
    quiet = _model(EXITING, event_shift=None)
    events.clear()
    _steps(quiet, range(2))
    assert events == []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"threshold": 0.0}, r"EarlyExitOptions.threshold=0.0 must be a number > 0"),
        ({"threshold": float("nan")}, r"EarlyExitOptions.threshold=nan must be a number > 0"),
        ({"position_temperature": -1.0}, r"position_temperature=-1.0 must be None or a number >= 0"),
        ({"loss_weight": -0.5}, r"loss_weight=-0.5 must be a finite number >= 0"),
        ({"event_shift": 0.0}, r"event_shift=0.0 must be None or in \(0, 1\]"),
        ({"event_smoothing": 1.0}, r"event_smoothing=1.0 must be in \[0, 1\)"),
        ({"token_bucket": -3}, r"EarlyExitOptions.token_bucket=-3 must be None \(exact token counts\)"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EarlyExitOptions(**options)


def test_a_dense_block_after_an_early_exit_block_is_refused() -> None:
    config = GPTConfig(num_layers=3, blocks=["early_exit", "dense", "early_exit"], **SHAPE)
    with pytest.raises(
        ValueError, match=r"GPTConfig.blocks\[1\] is a 'dense' block after the early-exit block"
    ):
        GPT(config)


@pytest.mark.parametrize("first", [-1, 4, 1.5])
def test_the_ready_config_refuses_a_bad_first_exit_layer(first: Any) -> None:
    with pytest.raises(
        ValueError, match=rf"first_exit_layer={first!r}\) must be an integer in \[0, num_layers=4\)"
    ):
        early_exit_config(num_layers=4, first_exit_layer=first)


def test_labels_of_minus_100_serve_a_forward_without_targets() -> None:
    model = _model(EXITING).eval()
    batch = _batch()
    inputs, target = batch[:, :-1], batch[:, 1:]
    with collect_aux_losses(attach=False) as aux:
        blind = model(inputs, torch.full_like(target, -100))
    assert torch.equal(blind, model(inputs, target)), "labels feed the exit loss only"
    assert float(aux.totals()[EXIT_LOSS]) == 0.0


def _training_run(token_bucket: int | None) -> tuple[Tensor, dict[str, Tensor], dict[int, int], list[int]]:
    """Loss, gradients, per-layer active counts and the MLP row counts of one float64 training step."""
    model = _model(EXITING, token_bucket=token_bucket)
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    rows: list[int] = []
    for block in model.layers.values():
        if isinstance(block, EarlyExitBlock):
            block.mlp.fc_in.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    loss = model.training_step(_batch(), 0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    counts = {i: c.last_processed for i, c in token_counts(model).items()}
    return loss.detach(), grads, counts, rows


def test_token_buckets_change_no_loss_gradient_or_count(monkeypatch: pytest.MonkeyPatch) -> None:
    loss, grads, counts, exact_rows = _training_run(None)
    bucketed_loss, bucketed_grads, bucketed_counts, rows = _training_run(5)
    assert any(n % 5 for n in exact_rows), "some layer's count is not a multiple of the bucket"
    assert rows == [min(48, -(-n // 5) * 5) for n in exact_rows], "the blocks compute on bucketed counts"
    assert bucketed_counts == counts, "the statistics count real tokens only"
    assert torch.allclose(bucketed_loss, loss, rtol=0, atol=1e-12)
    assert bucketed_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(bucketed_grads[name], grad, rtol=0, atol=1e-12), name
    # Negative control: padding rows copy a real token and its label; counted in the exit loss, they
    # change it.
    monkeypatch.setattr(TokenSelection, "fill_padding", lambda self, gathered, value: gathered)
    leaky_loss, *_ = _training_run(5)
    assert (leaky_loss - loss).abs().item() > 1e-6
