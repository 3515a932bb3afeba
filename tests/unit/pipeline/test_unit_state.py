"""What of a unit can migrate: a user's hooks are refused with where the state must live; the profiler's
hooks are left behind; parametrized modules travel and behave exactly as on the sender; compiled modules
are refused, and the torch behaviour that is why."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from lightning_dynmo.pipeline.migration.pack import pack_unit, unpack_unit
from lightning_dynmo.pipeline.model.unit_state import check_no_user_hooks, check_not_compiled
from lightning_dynmo.profiling import LayerTimer, module_has_hooks
from lightning_dynmo.profiling.clock import StepClock


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class WeightMask(nn.Module):
    """A parametrization: the weight seen by forward is ``original * mask`` (the mask is a buffer)."""

    def __init__(self, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.mask


def _round_trip(module: nn.Module) -> nn.Module:
    packed = pack_unit("layers.3", module)
    copy, _ = unpack_unit(packed.structure, [t.clone() for t in packed.payloads])
    return copy


def _mask_hook(grad: torch.Tensor) -> torch.Tensor:
    return grad * 0.5


@pytest.mark.parametrize(
    ("register", "match"),
    [
        (
            lambda b: b.fc1.register_forward_pre_hook(lambda m, a: None),
            r"unit 'layers.3': 'fc1' carries a forward pre-hook \(.*<lambda>\), which cannot migrate .* Keep "
            r"layer state in the module: parameters, buffers .* parametrizations",
        ),
        (
            lambda b: b.register_forward_hook(lambda m, a, o: None),
            r"'<the unit itself>' carries a forward hook",
        ),
        (
            lambda b: b.fc2.weight.register_hook(_mask_hook),
            r"'fc2.weight' carries a gradient hook \(_mask_hook\), which cannot migrate .* apply a gradient "
            r"mask inside forward",
        ),
        (
            lambda b: b.fc1.bias.register_post_accumulate_grad_hook(lambda p: None),
            r"'fc1.bias' carries a post-accumulate-grad hook",
        ),
        (
            lambda b: prune.l1_unstructured(b.fc1, "weight", amount=0.5),
            r"'fc1' carries a forward pre-hook \(L1Unstructured\).* torch.nn.utils.prune's mask.* "
            r"torch.nn.utils.prune.remove\(module, 'weight'\) .* or a parametrization",
        ),
        (
            lambda b: torch.nn.utils.weight_norm(b.fc2),
            r"'fc2' carries a forward pre-hook \(WeightNorm\).* use "
            r"torch.nn.utils.parametrizations.weight_norm",
        ),
    ],
    ids=["forward-pre-hook", "forward-hook", "gradient-hook", "post-accumulate-hook", "prune", "weight_norm"],
)
@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
def test_a_users_hook_is_refused_naming_the_module_and_where_state_lives(register, match) -> None:
    block = Block()
    register(block)
    with pytest.raises(TypeError, match=match):
        pack_unit("layers.3", block)
    with pytest.raises(TypeError, match=match):
        check_no_user_hooks({"layers.3": block})


def test_a_made_permanent_prune_migrates() -> None:
    block = Block()
    prune.l1_unstructured(block.fc1, "weight", amount=0.5)
    prune.remove(block.fc1, "weight")
    copy = _round_trip(block)
    assert torch.equal(copy.fc1.weight, block.fc1.weight) and (copy.fc1.weight == 0).sum() == 16


def test_the_profilers_hooks_are_left_behind() -> None:
    block = Block()
    timer = LayerTimer({3: block}, StepClock(torch.device("cpu")))
    timer.attach()
    assert module_has_hooks(block)
    check_no_user_hooks({"layers.3": block})
    copy = _round_trip(block)
    assert not module_has_hooks(copy) and module_has_hooks(block)  # the sender's window goes on
    timer.detach()
    assert not module_has_hooks(block)  # a closed window leaves nothing a migration would see


def test_a_parametrized_layer_travels_with_its_state_and_behaves_the_same() -> None:
    torch.manual_seed(0)
    block = Block()
    parametrize.register_parametrization(block.fc1, "weight", WeightMask(torch.rand(8, 4) > 0.5))
    block.fc1.parametrizations.weight.original.grad = torch.randn(8, 4)
    copy = _round_trip(block)

    assert parametrize.is_parametrized(copy.fc1, "weight")
    assert type(copy.fc1).__name__ == "ParametrizedLinear" and isinstance(copy.fc1, nn.Linear)
    assert copy.state_dict().keys() == block.state_dict().keys()
    assert all(torch.equal(v, copy.state_dict()[k]) for k, v in block.state_dict().items())
    assert torch.equal(
        copy.fc1.parametrizations.weight.original.grad, block.fc1.parametrizations.weight.original.grad
    )
    assert torch.equal(copy.fc1.weight, block.fc1.weight)  # recomputed through the received mask
    x = torch.randn(3, 4)
    assert torch.equal(copy(x), block(x))
    copy(x).sum().backward()
    block(x).sum().backward()
    original = copy.fc1.parametrizations.weight.original
    assert torch.equal(original.grad, block.fc1.parametrizations.weight.original.grad)
    with parametrize.cached():
        assert torch.equal(copy(x), block(x))
    # The masked entries get no gradient: the mask really is applied on the receiver.
    mask = copy.fc1.parametrizations.weight[0].mask
    before = original.grad.clone()
    copy(x).sum().backward()
    assert torch.equal((original.grad - before)[~mask], torch.zeros(int((~mask).sum())))


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_compiled_module_is_refused_naming_it_and_why(how: str) -> None:
    unit = nn.Sequential(Block(), Block())
    if how == "torch.compile":
        unit[1] = torch.compile(unit[1], backend="eager")  # type: ignore[assignment]
    else:
        unit[1].compile(backend="eager")
    check_not_compiled({"layers.2": nn.Sequential(Block())})  # an uncompiled unit passes
    with pytest.raises(
        TypeError,
        match=r"compiled by the user: \['layers\.2\.1'\].*may not notice hooks.*compile_blocks=True",
    ):
        check_not_compiled({"layers.2": unit})


def test_why_compiled_blocks_are_refused_hooks_added_after_the_first_call_may_be_skipped() -> None:
    # The reason the refusal gives, shown on torch itself: the profiler attaches its hooks during
    # training, after a block's first call, and torch does not guard on hooks by default
    # (torch._dynamo.config.skip_nnmodule_hook_guards: "if your model ... doesn't [have hooks] and you
    # add them, dynamo will not notice"). If a torch release changes this, this test fails and the
    # refusal can be reconsidered.
    block, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4)
    compiled = torch.compile(block, backend="eager")
    compiled(x)
    calls: list[str] = []
    block.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    compiled(x)
    assert calls == []
    block(x)  # the same hook on the uncompiled block
    assert calls == ["pre"]
