"""The MoE block in float64: the dense block as its one-expert case, the auxiliary losses on hand-worked
numbers, capacity drops, gradients, the expert bias, loads and routing events, and bad options."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dynmo.dynamism.moe import (
    LOAD_BALANCE_LOSS,
    Z_LOSS,
    MoEBlock,
    MoEOptions,
    load_balance_loss,
    moe_gpt_config,
    route,
    router_z_loss,
)
from lightning_dynmo.events import DynamismEvent, default_bus
from lightning_dynmo.models import GPT, DenseBlock, GPTConfig
from lightning_dynmo.pipeline.model.contract import check_model_contract
from lightning_dynmo.pipeline.step.aux_loss import collect_aux_losses
from lightning_dynmo.pipeline.step.stage import StageModule
from tests.quiet_trainer import quiet_trainer

CONFIG = GPTConfig(vocab_size=32, seq_len=8, num_layers=2, d_model=16, num_heads=2, d_ff=24)


def _block(**options: Any) -> MoEBlock:
    torch.manual_seed(0)
    block = MoEBlock(CONFIG, MoEOptions(**options)).double()
    block.init_weights(CONFIG)
    with torch.no_grad():  # a router with some spread, so routing is not a near-tie
        block.router.weight.normal_(0.0, 1.0)
    return block


def _hidden(batch: int = 3, seq: int = 8, seed: int = 1) -> Tensor:
    return torch.randn(
        batch, seq, CONFIG.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )


def _attention_residual(block: MoEBlock, x: Tensor) -> Tensor:
    return x + block.attn(block.ln_1(x))


# -- the dense block is the one-expert, top-1 case --------------------------------------------------


def _dense_copy(moe: MoEBlock) -> DenseBlock:
    dense = DenseBlock(CONFIG).double()
    with torch.no_grad():
        for name in ("ln_1", "attn", "ln_2"):
            getattr(dense, name).load_state_dict(getattr(moe, name).state_dict())
        dense.mlp.fc_in.weight.copy_(moe.experts.w_in[0].T)
        dense.mlp.fc_out.weight.copy_(moe.experts.w_out[0].T)
        assert moe.experts.b_in is not None and moe.experts.b_out is not None
        moe.experts.b_in.normal_()  # non-zero biases, so they are compared too
        moe.experts.b_out.normal_()
        dense.mlp.fc_in.bias.copy_(moe.experts.b_in[0])
        dense.mlp.fc_out.bias.copy_(moe.experts.b_out[0])
    return dense


def test_one_expert_top_1_equals_the_dense_block_forward_and_backward() -> None:
    moe = _block(num_experts=1, top_k=1, load_balance_coef=0.0, z_loss_coef=0.0)
    dense = _dense_copy(moe)
    x = _hidden().requires_grad_(True)
    out_moe = moe(x)
    out_dense = dense(x)
    torch.testing.assert_close(out_moe, out_dense, rtol=0, atol=1e-12)
    (g_moe,) = torch.autograd.grad(out_moe.square().sum(), x)
    (g_dense,) = torch.autograd.grad(out_dense.square().sum(), x)
    torch.testing.assert_close(g_moe, g_dense, rtol=0, atol=1e-12)
    # Negative control: sigmoid gates are not 1 for one expert, so the same weights give another output.
    sigmoid = _block(num_experts=1, top_k=1, score_func="sigmoid", load_balance_coef=0.0, z_loss_coef=0.0)
    sigmoid.load_state_dict(moe.state_dict())
    assert (sigmoid(x) - out_dense).abs().max().item() > 1e-3


def test_one_expert_aux_losses_are_the_coefficient_and_the_squared_logit() -> None:
    moe = _block(num_experts=1, top_k=1, load_balance_coef=0.3, z_loss_coef=0.2)
    x = _hidden()
    with collect_aux_losses(attach=False) as aux:
        moe(x)
    logits = moe.router(moe.ln_2(_attention_residual(moe, x))).squeeze(-1)
    assert aux.values[LOAD_BALANCE_LOSS][0].item() == pytest.approx(0.3, abs=1e-15)
    assert aux.values[Z_LOSS][0].item() == pytest.approx(0.2 * logits.square().mean().item(), rel=1e-12)


# -- the auxiliary losses on a hand-worked example ----------------------------------------------------

# Four tokens, two experts: softmax([ln 3, 0]) = (0.75, 0.25) and its mirror.
HAND_LOGITS = torch.tensor(
    [[math.log(3), 0.0], [0.0, math.log(3)], [math.log(3), 0.0], [math.log(3), 0.0]], dtype=torch.float64
)


def test_load_balance_and_z_loss_match_a_hand_worked_example() -> None:
    scores = HAND_LOGITS.softmax(-1)
    routing = route(scores, MoEOptions(num_experts=2, top_k=1))
    assert routing.experts.squeeze(-1).tolist() == [0, 1, 0, 0]
    assert routing.load.tolist() == [3, 1]
    # f = (3/4, 1/4); P = ((3 * 0.75 + 0.25) / 4, (3 * 0.25 + 0.75) / 4) = (0.625, 0.375)
    # E * sum f * P = 2 * (0.75 * 0.625 + 0.25 * 0.375) = 1.125
    balance = load_balance_loss(scores, routing.load, top_k=1, score_func="softmax")
    assert balance.item() == pytest.approx(1.125, abs=1e-15)
    # Every row's logsumexp is ln(3 + 1) = ln 4.
    assert router_z_loss(HAND_LOGITS).item() == pytest.approx(math.log(4) ** 2, abs=1e-14)
    # Uniform routing gives 1 (the coefficient itself once weighted).
    uniform = torch.full((4, 2), 0.5, dtype=torch.float64)
    assert load_balance_loss(uniform, torch.tensor([2, 2]), 1, "softmax").item() == pytest.approx(1.0)


def test_sigmoid_scores_are_normalised_per_token_in_the_balance_loss() -> None:
    # sigmoid(0) = 0.5, sigmoid(ln 3) = 0.75: per-token shares (0.6, 0.4); top-2 of 2 puts 4 slots on each.
    scores = torch.sigmoid(HAND_LOGITS)
    routing = route(scores, MoEOptions(num_experts=2, top_k=2, score_func="sigmoid"))
    assert routing.load.tolist() == [4, 4]
    # f = (1/2, 1/2); P = ((3 * 0.6 + 0.4) / 4, (3 * 0.4 + 0.6) / 4) = (0.55, 0.45); 2 * (0.275 + 0.225) = 1
    balance = load_balance_loss(scores, routing.load, top_k=2, score_func="sigmoid")
    assert balance.item() == pytest.approx(1.0, abs=1e-15)
    assert routing.gates[0].tolist() == pytest.approx([0.75, 0.5])


def test_the_block_adds_the_weighted_losses_of_its_own_routing() -> None:
    block = _block(num_experts=4, top_k=2, load_balance_coef=0.05, z_loss_coef=0.01)
    x = _hidden()
    with collect_aux_losses(attach=False) as aux:
        block(x)
    logits = block.router(block.ln_2(_attention_residual(block, x))).reshape(-1, 4)
    scores = logits.softmax(-1)
    load = torch.stack([(torch.topk(scores, 2).indices == e).sum() for e in range(4)])
    expected_balance = 0.05 * 4 * ((load.double() / (24 * 2)) * scores.mean(0)).sum()
    expected_z = 0.01 * (torch.logsumexp(logits, -1) ** 2).mean()
    assert aux.values[LOAD_BALANCE_LOSS][0].item() == pytest.approx(expected_balance.item(), rel=1e-12)
    assert aux.values[Z_LOSS][0].item() == pytest.approx(expected_z.item(), rel=1e-12)
    assert block.expert_load.tolist() == load.tolist()


# -- gradients ---------------------------------------------------------------------------------------


def test_gradients_reach_the_router_through_the_gates_and_through_each_aux_loss() -> None:
    block = _block(num_experts=4, top_k=2, load_balance_coef=0.0, z_loss_coef=0.0)
    block(_hidden()).square().sum().backward()
    assert block.router.weight.grad is not None and block.router.weight.grad.abs().sum() > 0
    for name, options in ((LOAD_BALANCE_LOSS, {"z_loss_coef": 0.0}), (Z_LOSS, {"load_balance_coef": 0.0})):
        block = _block(num_experts=4, top_k=2, **options)
        with collect_aux_losses(attach=False) as aux:
            block(_hidden())
        (grad,) = torch.autograd.grad(aux.values[name][0], block.router.weight)
        assert grad.abs().sum() > 0, f"{name} must have a gradient on the router"


def test_an_expert_without_tokens_gets_a_zero_gradient_not_none() -> None:
    block = _block(num_experts=4, top_k=1, bias_update_rate=0.1)
    assert block.expert_bias is not None
    block.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, -100.0]))  # everyone picks expert 0
    block(_hidden()).sum().backward()
    assert block.expert_load.tolist() == [24, 0, 0, 0]
    for param in block.experts.parameters():
        assert param.grad is not None
        assert param.grad[0].abs().sum() > 0 and torch.count_nonzero(param.grad[1:]) == 0


# -- capacity and drops ----------------------------------------------------------------------------------

# Five tokens, two experts, top-1; tokens 0, 1, 2 pick expert 0 with scores 0.6, 0.9, 0.7.
DROP_SCORES = torch.tensor(
    [[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.2, 0.8], [0.45, 0.55]], dtype=torch.float64
)


@pytest.mark.parametrize(("policy", "kept_tokens"), [("probs", [1, 2]), ("position", [0, 1])])
def test_capacity_keeps_what_the_drop_policy_says(policy: str, kept_tokens: list[int]) -> None:
    # capacity = ceil(0.8 * 5 * 1 / 2) = 2: expert 0 keeps two of its three tokens, expert 1 both of its.
    options = MoEOptions(num_experts=2, top_k=1, capacity_factor=0.8, drop_policy=policy)
    routing = route(DROP_SCORES, options)
    assert routing.load.tolist() == [3, 2] and routing.kept_load.tolist() == [2, 2]
    kept = routing.kept.squeeze(-1)
    assert [t for t in range(3) if kept[t]] == kept_tokens
    assert kept[3] and kept[4]
    dropless = route(DROP_SCORES, MoEOptions(num_experts=2, top_k=1))
    assert dropless.kept.all() and dropless.kept_load.tolist() == [3, 2]


def test_a_token_whose_slots_are_all_dropped_passes_through_the_residual() -> None:
    block = _block(num_experts=4, top_k=1, capacity_factor=0.5)
    x = _hidden()
    out = block(x)
    residual = _attention_residual(block, x).reshape(-1, CONFIG.d_model)
    untouched = (out.reshape(-1, CONFIG.d_model) == residual).all(-1)
    dropped = 24 - int(block.kept_load.sum())
    assert dropped > 0, "the example must drop tokens"
    assert int(untouched.sum()) == dropped
    assert block.rows_computed == 4 * 3  # capacity ceil(0.5 * 24 / 4) = 3 rows per expert
    # Dropless, no token passes through untouched.
    block = _block(num_experts=4, top_k=1)
    out = block(x)
    residual = _attention_residual(block, x).reshape(-1, CONFIG.d_model)
    assert not (out.reshape(-1, CONFIG.d_model) == residual).all(-1).any()


def test_the_computed_rows_follow_the_busiest_expert() -> None:
    block = _block(num_experts=4, top_k=1, bias_update_rate=0.1)
    assert block.expert_bias is not None
    block(_hidden())
    balanced_rows = block.rows_computed
    assert balanced_rows == 4 * int(block.kept_load.max())
    block.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0]))
    block(_hidden())
    assert block.rows_computed == 4 * 24 > balanced_rows


# -- the expert bias, loads and routing events -----------------------------------------------------


def test_the_expert_bias_selects_but_does_not_weigh() -> None:
    options = MoEOptions(num_experts=2, top_k=1)
    routing = route(DROP_SCORES, options, expert_bias=torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert routing.experts.squeeze(-1).tolist() == [1] * 5
    assert routing.gates.squeeze(-1).tolist() == DROP_SCORES[:, 1].tolist()


def test_the_bias_update_moves_towards_the_mean_load_and_resets_the_step() -> None:
    block = _block(num_experts=4, top_k=1, bias_update_rate=0.1).train()
    assert block.expert_bias is not None
    block.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, -100.0]))  # expert 3 never chosen
    block(_hidden(seed=1))
    block(_hidden(seed=2))
    load = block.step_load.clone()
    assert int(load.sum()) == 48 and load[3] == 0
    assert block.step_assignments == 48 and block.step_rows >= 4 * int(load.max()) // 2
    block.after_optimizer_step()
    sign = torch.sign(load.double().mean() - load.double())
    expected = torch.tensor([0.0, 0.0, 0.0, -100.0]) + 0.1 * (sign - sign.mean())
    torch.testing.assert_close(block.expert_bias, expected.double(), rtol=0, atol=1e-15)
    assert int(block.step_load.sum()) == 0 and block.step_rows == 0 and block.step_assignments == 0
    assert block.work_ratio >= 1.0


def test_eval_forwards_and_shape_inference_are_not_counted() -> None:
    model = GPT(moe_gpt_config(num_layers=2, d_model=16, num_heads=2, seq_len=8, num_experts=4)).double()
    block = model.layers["0"]
    assert isinstance(block, MoEBlock)
    inputs = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        model.eval()(inputs)
    assert int(block.step_load.sum()) == 0 and int(block.expert_load.sum()) == 32
    spec = check_model_contract(model)
    stage = StageModule(model.train(), spec, range(2), first=True, last=True)
    with stage.shape_inference():
        stage(inputs)
    assert int(block.step_load.sum()) == 0
    stage(inputs)
    assert int(block.step_load.sum()) == 32


def test_a_routing_event_is_published_when_the_work_ratio_moves_past_the_threshold() -> None:
    events: list[DynamismEvent] = []
    unsubscribe = default_bus().subscribe(events.append)
    try:
        block = _block(num_experts=4, top_k=1, bias_update_rate=0.1, routing_event_threshold=0.5)
        block.layer_index = 5
        assert block.expert_bias is not None
        block.expert_bias.copy_(torch.tensor([100.0, 0.0, 0.0, 0.0]))
        block(_hidden())
        block.after_optimizer_step(step=7)
        assert block.work_ratio == pytest.approx(4.0)
        block(_hidden())
        block.after_optimizer_step(step=8)  # still 4.0: no new event
    finally:
        unsubscribe()
    assert [(e.kind, e.layers, e.step) for e in events] == [("routing", (5,), 7)]
    assert "1.00 -> 4.00" in events[0].detail


# -- the GPT, the ready configuration, options ------------------------------------------------------


def test_moe_gpt_config_builds_a_gpt_that_declares_the_aux_losses() -> None:
    config = moe_gpt_config(num_layers=4, d_model=16, num_heads=2, seq_len=8, moe_every=2, num_experts=4)
    kinds = [kind.name for kind, _ in config.resolved_blocks()]
    assert kinds == ["dense", "moe", "dense", "moe"]
    model = GPT(config)
    assert model.pipeline_aux_losses == (LOAD_BALANCE_LOSS, Z_LOSS)
    assert model.layers["1"].layer_index == 1
    # Per-unit seeding: a block built alone equals the one in the model.
    again = GPT(config).layers["3"]
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.layers["3"].state_dict().values(), again.state_dict().values(), strict=True)
    )
    no_z = GPT(moe_gpt_config(num_layers=2, d_model=16, num_heads=2, seq_len=8, z_loss_coef=0.0))
    assert no_z.pipeline_aux_losses == (LOAD_BALANCE_LOSS,)


def test_the_gpt_updates_the_expert_bias_after_each_optimizer_step(tokens: DataLoader[Tensor]) -> None:
    config = moe_gpt_config(
        num_layers=2,
        d_model=16,
        num_heads=2,
        seq_len=8,
        num_experts=4,
        score_func="sigmoid",
        bias_update_rate=0.01,
    )
    model = GPT(config, microbatches=2)
    trainer = quiet_trainer(
        max_steps=3,
    )
    trainer.fit(model, tokens)
    bias = model.layers["0"].expert_bias
    assert bias is not None
    # Three sign steps of 0.01 each, centred: every entry is a multiple of 0.01 / 4 and not all zero.
    assert bias.abs().max().item() > 0 and bias.abs().max().item() <= 0.03 + 1e-7
    assert abs(bias.sum().item()) < 1e-6
    assert int(model.layers["0"].step_load.sum()) == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_experts": 0}, r"MoEOptions.num_experts=0 must be an integer >= 1"),
        ({"top_k": 3, "num_experts": 2}, r"MoEOptions.top_k=3 exceeds num_experts=2"),
        ({"expert_width": 0}, r"MoEOptions.expert_width=0 must be an integer >= 1 or None"),
        ({"score_func": "relu"}, r"MoEOptions.score_func='relu' must be one of \('softmax', 'sigmoid'\)"),
        (
            {"drop_policy": "random"},
            r"MoEOptions.drop_policy='random' must be one of \('probs', 'position'\)",
        ),
        ({"capacity_factor": 0.0}, r"MoEOptions.capacity_factor=0.0 must be a number > 0, or None"),
        ({"load_balance_coef": -1.0}, r"MoEOptions.load_balance_coef=-1.0 must be a number >= 0"),
        ({"bias_update_rate": -0.1}, r"MoEOptions.bias_update_rate=-0.1 must be a number >= 0"),
        ({"routing_event_threshold": 0}, r"MoEOptions.routing_event_threshold=0 must be a number > 0"),
        (
            {"expert_kernel": "loop"},
            r"MoEOptions.expert_kernel='loop' must be one of \('padded', 'grouped'\)",
        ),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoEOptions(**options)


def test_bad_moe_every_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"moe_gpt_config\(moe_every=5\) must be an integer in \[1, num_layers=4\]"
    ):
        moe_gpt_config(num_layers=4, moe_every=5)


def test_moe_gpt_config_takes_options_and_gpt_fields_as_keywords() -> None:
    config = moe_gpt_config(num_layers=2, num_experts=4, d_model=16, num_heads=2, dropout=0.1)
    assert (config.d_model, config.num_heads, config.dropout) == (16, 2, 0.1)
    assert all(options.num_experts == 4 for _, options in config.resolved_blocks())
    with pytest.raises(
        TypeError, match=r"moe_gpt_config\(\) got unknown keyword\(s\) \['num_expert'\]; pass MoEOptions"
    ):
        moe_gpt_config(num_expert=4)


# -- the grouped GEMM kernel -------------------------------------------------------------------------


def _float_pair(**options: Any) -> tuple[MoEBlock, MoEBlock]:
    padded = _block(**options).float()
    grouped = _block(expert_kernel="grouped", **options).float()
    grouped.load_state_dict(padded.state_dict())
    with torch.no_grad():
        assert padded.experts.b_in is not None and grouped.experts.b_in is not None
        padded.experts.b_in.normal_()
        grouped.experts.b_in.copy_(padded.experts.b_in)
    return padded, grouped


def _run(block: MoEBlock, x: Tensor) -> tuple[Tensor, ...]:
    x = x.clone().requires_grad_(True)
    with collect_aux_losses(attach=False) as aux:
        out = block(x)
    loss = (out * torch.linspace(-1, 1, out.shape[-1])).sum() + torch.as_tensor(aux.total())
    params = [p for p in block.parameters() if p.requires_grad]
    return (out, *torch.autograd.grad(loss, [x, *params]))


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_the_grouped_kernel_computes_what_the_padded_one_does_in_float32(
    capacity_factor: float | None,
) -> None:
    padded, grouped = _float_pair(num_experts=4, top_k=2, capacity_factor=capacity_factor)
    x = _hidden().float()
    expected, got = _run(padded, x), _run(grouped, x)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert grouped.rows_computed == padded.rows_computed, "the signal is the busiest expert's, either way"
    assert int(grouped.kept_load.min()) < int(grouped.kept_load.max()), "the test needs uneven loads"
    # Negative control: rows sent to the wrong expert's weights change the output.
    with torch.no_grad():
        grouped.experts.w_in.copy_(grouped.experts.w_in.roll(1, dims=0))
    assert (_run(grouped, x)[0] - expected[0]).abs().max().item() > 1e-3


def test_the_grouped_kernel_refuses_what_grouped_mm_does_not_take() -> None:
    block = _block(expert_kernel="grouped")
    with pytest.raises(
        ValueError, match=r"expert_kernel='grouped' runs torch._grouped_mm, which takes .* torch.float64"
    ):
        block(_hidden())
    narrow = MoEBlock(CONFIG, MoEOptions(expert_kernel="grouped", expert_width=6))
    with pytest.raises(
        ValueError, match=r"needs 16-byte rows: d_model=16 and expert width=6 must be multiples of 4"
    ):
        narrow(_hidden().float())
