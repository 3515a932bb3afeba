"""The stage interface in one process: what a stage runs equals the model, and bad input is named.

The distributed equivalence lives in ``tests/distributed/test_stage_interface.py``; here every error of
the interface has a ``match=`` test, and the auxiliary-loss channel is checked against plain autograd.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.pipeline.model.contract import ModelSpec, check_loss, check_model_contract, split_batch
from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses
from lightning_dynmo.pipeline.step.stage import StageModule
from tests.distributed.interface_model import MaskedGPT, padded_loader


def _batch() -> dict[str, Tensor]:
    return next(iter(padded_loader(8, 8)))


def _stage_for(model: nn.Module, first: bool = True, last: bool = True) -> StageModule:
    spec = check_model_contract(model)
    return StageModule(model, spec, range(spec.num_layers), first, last)


# -- a whole-model stage equals the model ---------------------------------------------------------------


def test_one_stage_runs_the_model_with_side_inputs_and_side_state() -> None:
    model = MaskedGPT().double()
    inputs, _, side = model.pipeline_batch(_batch())
    expected = model(inputs, side["attention_mask"], side["position_ids"])
    assert torch.equal(_stage_for(model)(inputs, **side), expected)


def test_a_cut_between_stages_sends_hidden_then_side_state_in_declared_order() -> None:
    model = MaskedGPT().double()
    spec = check_model_contract(model)
    inputs, _, side = model.pipeline_batch(_batch())
    first = StageModule(model, spec, [0, 1], first=True, last=False)
    second = StageModule(model, spec, [2, 3], first=False, last=True)
    sent = first(inputs, **side)
    assert isinstance(sent, tuple) and len(sent) == 3
    assert sent[1].dtype == torch.bool and sent[2].dtype == torch.float64  # exited, score
    assert torch.equal(second(*sent, **side), model(inputs, side["attention_mask"], side["position_ids"]))


def test_plain_models_still_send_one_tensor() -> None:
    model = _Plain()
    sent = StageModule(model, check_model_contract(model), [0], first=True, last=False)(torch.ones(2, 3))
    assert isinstance(sent, Tensor)


def test_shape_inference_zeroes_received_inputs_and_drops_aux_losses() -> None:
    model = MaskedGPT().double()
    spec = check_model_contract(model)
    stage = StageModule(model, spec, [2, 3], first=False, last=True)
    _, _, side = model.pipeline_batch(_batch())
    garbage = (torch.full((8, 8, 16), float("nan"), dtype=torch.float64), torch.ones(8, 8, dtype=torch.bool))
    score = torch.full((8, 8), float("nan"), dtype=torch.float64)
    with collect_aux_losses() as outer, stage.shape_inference():
        out = stage(*garbage, score, **side)
    assert torch.isfinite(out).all()
    assert not outer.values, "aux losses of torch's metadata pass must not be recorded"
    assert not garbage[1].any() and not score.isnan().any()


# -- auxiliary losses --------------------------------------------------------------------------------


def _aux_setup() -> tuple[Tensor, Tensor, Tensor]:
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64)
    return w, r, x


def _grads_of(w: Tensor, r: Tensor, x: Tensor, mode: str) -> list[Tensor]:
    w.grad = r.grad = None
    h = x @ w
    aux = 0.1 * torch.logsumexp(h @ r, -1).pow(2).mean()
    if mode == "plain":
        loss = h.tanh().sum() + aux
    elif mode == "attached":
        loss = add_aux_loss("z", aux, h).tanh().sum()
    elif mode == "dropped":  # negative control: the aux term never reaches the objective
        loss = h.tanh().sum()
    else:
        with collect_aux_losses(attach=False) as record:
            h = add_aux_loss("z", aux, h)
        loss = h.tanh().sum() + record.total()
    loss.backward()
    return [torch.zeros_like(t) if t.grad is None else t.grad.clone() for t in (w, r)]


@pytest.mark.parametrize("mode", ["attached", "collected"])
def test_aux_loss_gradient_equals_adding_it_to_the_loss(mode: str) -> None:
    w, r, x = _aux_setup()
    expected = _grads_of(w, r, x, "plain")
    for got, want in zip(_grads_of(w, r, x, mode), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-14, rtol=0)
    dropped = _grads_of(w, r, x, "dropped")
    assert not torch.allclose(dropped[0], expected[0]), "negative control: the aux term must matter"


def test_aux_loss_scale_multiplies_its_gradient() -> None:
    w, r, x = _aux_setup()
    h = x @ w
    with collect_aux_losses(scale=0.25) as record:
        out = add_aux_loss("z", (h @ r).sum(), h)
    out.sum().backward()
    assert r.grad is not None
    assert torch.allclose(r.grad, 0.25 * h.detach().sum(0, keepdim=True).T.expand(4, 3))
    assert record.totals()["z"].item() == pytest.approx((h @ r).sum().item())


def test_aux_loss_must_be_a_scalar() -> None:
    with pytest.raises(TypeError, match=r"got a tensor of shape \(3,\); an auxiliary loss must be a scalar"):
        add_aux_loss("z", torch.ones(3), torch.ones(2))


def test_aux_loss_name_must_be_declared() -> None:
    with (
        collect_aux_losses(allowed=("router_z",), model_name="MaskedGPT"),
        pytest.raises(ValueError, match=r"'load_balance', which MaskedGPT does not declare"),
    ):
        add_aux_loss("load_balance", torch.ones(()), torch.ones(2))


# -- the contract's new checks -------------------------------------------------------------------------


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(3, 3), "1": nn.Linear(3, 3)})

    def pipeline_batch(self, batch: Any) -> Any:
        return batch

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(output, target)


class _Asks(nn.Linear):
    pipeline_inputs = ("attention_mask",)

    def forward(self, x: Tensor, attention_mask: Tensor) -> Tensor:  # type: ignore[override]
        return super().forward(x) * attention_mask.unsqueeze(-1)


def test_a_block_asking_for_an_undeclared_input_is_refused_at_setup() -> None:
    model = _Plain()
    model.layers["1"] = _Asks(3, 3)
    with pytest.raises(
        TypeError, match=r"layers\.1 asks for \['attention_mask'\], which the model does not declare"
    ):
        check_model_contract(model)


def test_a_side_input_the_batch_does_not_provide_is_named() -> None:
    model = _Plain()
    model.layers["1"] = _Asks(3, 3)
    model.pipeline_side_inputs = ("attention_mask",)  # type: ignore[assignment]
    spec = check_model_contract(model)
    batch = (torch.ones(4, 3), torch.ones(4, 3), {})
    with pytest.raises(TypeError, match=r"missing \['attention_mask'\] \(a block or part asks for them"):
        split_batch(model, spec, batch)


def test_undeclared_and_malformed_side_inputs_are_refused() -> None:
    model = _Plain()
    spec = check_model_contract(model)
    with pytest.raises(TypeError, match=r"not declared \['mask'\]"):
        split_batch(model, spec, (torch.ones(4, 3), torch.ones(4, 3), {"mask": torch.ones(4)}))
    with pytest.raises(ValueError, match=r"side input 'm' has shape \(3,\) but inputs have shape \(4, 3\)"):
        model.pipeline_side_inputs = ("m",)  # type: ignore[assignment]
        split_batch(
            model, check_model_contract(model), (torch.ones(4, 3), torch.ones(4, 3), {"m": torch.ones(3)})
        )


def test_strided_views_from_pipeline_batch_come_back_contiguous_and_equal() -> None:
    # GPT's pipeline_batch returns rows[:, :-1] and rows[:, 1:]: views with the rows' stride, which torch
    # 2.11's stage refuses against the contiguous metadata it traced (found on an H200, 2026-11-27).
    model = GPT(GPTConfig(vocab_size=16, seq_len=8, num_layers=2, d_model=8, num_heads=2, d_ff=8))
    rows = torch.arange(4 * 9).view(4, 9)
    inputs, target, side = split_batch(model, check_model_contract(model), rows)
    assert not rows[:, :-1].is_contiguous()  # the control: the model's own views are strided
    assert inputs.is_contiguous() and target.is_contiguous() and side == {}
    assert torch.equal(inputs, rows[:, :-1]) and torch.equal(target, rows[:, 1:])


def test_pipeline_batch_returning_a_tuple_of_inputs_is_explained() -> None:
    model = _Plain()
    spec = check_model_contract(model)
    with pytest.raises(TypeError, match=r"returned inputs = a tuple of 2 \(Tensor, Tensor\).*side inputs"):
        split_batch(model, spec, ((torch.ones(4, 3), torch.ones(4, 3)), torch.ones(4, 3)))
    with pytest.raises(TypeError, match=r"returned a tensor of shape \(4, 3\); it must return"):
        split_batch(model, spec, torch.ones(4, 3))


def test_side_state_that_changes_shape_between_steps_is_refused() -> None:
    model = MaskedGPT().double()
    stage = _stage_for(model, last=False)
    inputs, _, side = model.pipeline_batch(_batch())
    stage(inputs, **side)
    original = model.pipeline_first

    def first_with_longer_score(ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
        state = original(ids, attention_mask)
        state["score"] = torch.zeros(ids.shape[0], ids.shape[1] + 1, dtype=torch.float64)
        return state

    model.pipeline_first = first_with_longer_score  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"side state \['score'\].*Side state must keep its shape"):
        stage(inputs, **side)


def test_a_block_changing_side_state_shape_is_named() -> None:
    model = MaskedGPT().double()
    block = model.layers["1"]
    original = block.forward

    def shrinking(*args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        hidden, updates = original(*args, **kwargs)
        return hidden, {**updates, "exited": updates["exited"][:, :-1]}

    block.forward = shrinking  # type: ignore[method-assign]
    inputs, _, side = model.pipeline_batch(_batch())
    with pytest.raises(ValueError, match=r"layers\.1 \(MaskedBlock\) replaced side state 'exited'"):
        _stage_for(model)(inputs, **side)


def test_a_block_returning_an_unsupported_tuple_is_named() -> None:
    model = _Plain()
    model.layers["0"].forward = lambda x: (x, x)  # type: ignore[method-assign]
    with pytest.raises(
        TypeError, match=r"layers\.0 \(Linear\) returned a tuple of 2 \(Tensor, Tensor\); a block"
    ):
        _stage_for(model)(torch.ones(2, 3))


@pytest.mark.parametrize(
    ("loss", "needs_grad", "match"),
    [
        (
            torch.ones(4),
            False,
            r"returned a tensor of shape \(4,\); it must return the micro-batch's mean loss",
        ),
        (3.0, False, r"returned a float; it must return"),
        (torch.ones(()), True, r"returned a loss that does not require grad"),
    ],
)
def test_bad_losses_are_explained(loss: Any, needs_grad: bool, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        check_loss("M", loss, needs_grad=needs_grad)


def test_a_parameter_outside_the_units_is_named() -> None:
    model = _Plain()
    model.scale = nn.Parameter(torch.ones(()))
    with pytest.raises(TypeError, match=r"parameter `scale` outside the pipeline units"):
        check_model_contract(model)


def test_a_submodule_used_but_not_listed_as_a_part_is_named() -> None:
    model = _Plain()
    model.emb = nn.Embedding(4, 3)
    with pytest.raises(TypeError, match=r"`emb\.weight` outside the pipeline units.*pipeline_first_parts"):
        check_model_contract(model)


def test_the_original_container_still_registered_is_named() -> None:
    model = _Plain()
    model.backbone = nn.ModuleList(list(model.layers.values()))  # as a Hugging Face wrapper would keep it
    with pytest.raises(TypeError, match=r"`backbone\.0\.weight` outside .* again as `layers\.0\.weight`"):
        check_model_contract(model)


def test_a_persistent_buffer_outside_the_units_is_named_but_a_constant_is_fine() -> None:
    model = _Plain()
    model.register_buffer("causal", torch.ones(3, 3), persistent=False)
    assert check_model_contract(model) == ModelSpec(2, (), ())
    model.register_buffer("step", torch.zeros(()))
    with pytest.raises(TypeError, match=r"persistent buffer `step` outside .*persistent=False"):
        check_model_contract(model)


def test_interface_declarations_are_checked() -> None:
    model = _Plain()
    model.pipeline_side_inputs = ("mask",)  # type: ignore[assignment]
    model.pipeline_side_state = ("mask",)  # type: ignore[assignment]
    with pytest.raises(
        TypeError, match=r"declares \['mask'\] both as pipeline_side_inputs and pipeline_side_state"
    ):
        check_model_contract(model)
    model.pipeline_side_state = ("exited",)  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"missing \['pipeline_first'\].*creates the side state"):
        check_model_contract(model)
