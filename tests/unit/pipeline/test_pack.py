"""pack_unit / unpack_unit in one process: what travels, what must not, and clear errors."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from lightning_dynmo.pipeline.migration.pack import pack_unit, unpack_unit
from lightning_dynmo.pipeline.model.units import unit_sort_key
from lightning_dynmo.runtime_hooks import runtime_hook


class Tied(nn.Module):
    """Two linears sharing one weight, plus a buffer that is a view of a parameter's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.table = nn.Parameter(torch.randn(6, 4))
        self.register_buffer("first_rows", self.table.data[:2])


class Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.frozen_gain = nn.Parameter(torch.ones(2), requires_grad=False)
        self.register_buffer("mask", torch.tensor([[True, False, True], [False, True, True]]))
        self.frozen = True
        self.stats = {"tokens": 17, "load": torch.arange(3.0)}


def _round_trip(module: nn.Module, optimizers=()):
    packed = pack_unit("unit", module, optimizers)
    payloads = [t.clone() for t in packed.payloads]  # as if received into fresh memory
    return unpack_unit(packed.structure, payloads)


def _trained(module: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        module.lin(torch.randn(5, 3)).pow(2).sum().backward()
        opt.step()
    return opt


def test_round_trip_is_bitwise_with_flags_attributes_grads_and_optimizer_entries():
    torch.manual_seed(0)
    module = Flagged()
    opt = _trained(module)
    copy, entries = _round_trip(module, [opt])

    assert isinstance(copy, Flagged) and copy is not module
    for (name, p), (name2, q) in zip(module.named_parameters(), copy.named_parameters(), strict=True):
        assert name == name2 and isinstance(q, nn.Parameter) and torch.equal(p, q)
        assert p.requires_grad == q.requires_grad
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    assert copy.mask.dtype == torch.bool and torch.equal(copy.mask, module.mask)
    assert (
        copy.frozen is True
        and copy.stats["tokens"] == 17
        and torch.equal(copy.stats["load"], torch.arange(3.0))
    )
    by_name = {e[2]: e for e in entries}
    assert sorted(by_name) == ["lin.bias", "lin.weight"]  # the frozen gain is in no optimizer
    opt_index, group_index, _, state, hyper = by_name["lin.bias"]
    assert (opt_index, group_index, hyper["lr"]) == (0, 1, 0.5)
    assert torch.equal(state["exp_avg_sq"], opt.state[module.lin.bias]["exp_avg_sq"])
    assert torch.equal(state["step"], torch.tensor(2.0))


def test_tied_weights_and_views_stay_shared():
    torch.manual_seed(0)
    copy, _ = _round_trip(Tied())

    assert copy.a.weight is copy.b.weight
    assert len(list(copy.parameters())) == 2
    assert copy.first_rows.untyped_storage().data_ptr() == copy.table.untyped_storage().data_ptr()
    with torch.no_grad():
        copy.table[0, 0] = 42.0
    assert copy.first_rows[0, 0] == 42.0


def test_runtime_hooks_are_stripped_without_touching_the_sender():
    module = nn.Linear(2, 2)
    calls = []
    # The profiler's hooks (marked; lambdas could not be pickled anyway); a user's are refused:
    # tests/unit/pipeline/test_unit_state.py.
    module.register_forward_hook(runtime_hook(lambda *_: calls.append("fwd")))
    module.register_forward_pre_hook(runtime_hook(lambda *_: calls.append("pre")))
    module.register_full_backward_hook(runtime_hook(lambda *_: calls.append("bwd")))
    copy, _ = _round_trip(module)

    x = torch.ones(1, 2, requires_grad=True)
    copy(x).sum().backward()
    assert (
        calls == [] and not copy._forward_hooks and not copy._forward_pre_hooks and not copy._backward_hooks
    )
    module(x).sum().backward()
    assert calls == ["pre", "fwd", "bwd"]


def test_hooks_can_be_registered_on_a_received_unit():
    # torch's hook handles hold weak references to the hook tables: the receiver must get OrderedDicts.
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module.register_forward_hook(runtime_hook(lambda *_: None))
    copy, _ = _round_trip(module)
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append("pre")) for m in copy.modules()]
    handles.append(copy.register_full_backward_hook(lambda *_: calls.append("bwd")))
    copy(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert calls == ["pre", "pre", "pre", "bwd"]
    for handle in handles:
        handle.remove()
    assert not any(m._forward_pre_hooks or m._backward_hooks for m in copy.modules())


def test_packing_does_not_change_the_sender():
    torch.manual_seed(0)
    module = Flagged()
    opt = _trained(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    state_before = {k: v.clone() for k, v in opt.state[module.lin.weight].items()}
    pack_unit("unit", module, [opt])
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert all(torch.equal(state_before[k], v) for k, v in opt.state[module.lin.weight].items())
    assert opt.param_groups[0]["params"][0] is module.lin.weight


def test_structure_is_small_and_payloads_carry_the_bytes():
    module = nn.Linear(256, 256)
    packed = pack_unit("layers.0", module)
    assert packed.payload_nbytes == (256 * 256 + 256) * 4
    assert len(packed.structure) < 4096  # placeholders only, no tensor data in the pickle
    assert pickle.loads(packed.structure)["specs"]["buffers"][0]["numel"] == 256 * 256


def test_unit_sort_key_is_natural():
    names = ["layers.10", "head", "layers.2", "embed", "layers.1.fc.weight"]
    assert sorted(names, key=unit_sort_key) == [
        "embed",
        "head",
        "layers.1.fc.weight",
        "layers.2",
        "layers.10",
    ]


class _Holder(nn.Module):
    def __init__(self, value: object) -> None:
        super().__init__()
        self.inner = nn.Module()
        self.inner.thing = value


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (
            lambda: None,
            r"Cannot migrate unit 'layers.3': attribute 'inner.thing' holds an unpicklable function",
        ),
        (
            torch.randn(2, requires_grad=True) * 2,
            r"attribute 'inner.thing' holds a tensor attached to an autograd",
        ),
        (
            torch.eye(2).to_sparse(),
            r"attribute 'inner.thing' holds a torch.sparse_coo tensor .* store it dense",
        ),
    ],
    ids=["lambda", "graph-tensor", "sparse"],
)
def test_unit_that_cannot_travel_is_rejected_naming_the_attribute(value, match):
    with pytest.raises(TypeError, match=match):
        pack_unit("layers.3", _Holder(value))


def test_mixed_dtype_views_of_one_storage_are_rejected():
    module = nn.Module()
    module.register_buffer("f", torch.zeros(4))
    module.register_buffer("i", module.f.view(torch.int32))
    with pytest.raises(
        TypeError, match=r"attribute 'f' holds tensors of different dtypes .* sharing one storage"
    ):
        pack_unit("layers.0", module)


def test_non_module_unit_is_rejected():
    with pytest.raises(TypeError, match=r"local_units\['layers.0'\] must be an nn.Module, got Tensor"):
        pack_unit("layers.0", torch.zeros(2))  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_payloads_travel_on_the_device_and_cpu_state_comes_back_on_cpu():
    cuda = torch.device("cuda", torch.cuda.current_device())
    module = nn.Linear(4, 4).to(cuda)
    opt = torch.optim.Adam(module.parameters())  # Adam keeps `step` on CPU unless capturable/fused
    module(torch.ones(2, 4, device=cuda)).sum().backward()
    opt.step()
    packed = pack_unit("layers.0", module, [opt], device=cuda)
    assert all(t.device == cuda for t in packed.payloads)
    copy, entries = unpack_unit(packed.structure, [t.clone() for t in packed.payloads], device=cuda)
    assert copy.weight.device == cuda and torch.equal(copy.weight, module.weight)
    state = {e[2]: e[3] for e in entries}["weight"]
    assert state["step"].device.type == "cpu" and state["exp_avg"].device == cuda
