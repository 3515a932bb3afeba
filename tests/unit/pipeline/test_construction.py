"""Local construction: a unit's initial values do not depend on which units a process builds.

A process that materialises a subset of a meta-device model's units (as a pipeline rank does) must get,
for those units, exactly the values one process gets for the whole model; the negative control shows
that this fails when the random stream is shared across units instead of seeded per unit.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from lightning_dynmo.pipeline.model import construction
from lightning_dynmo.pipeline.model.construction import keep_local_units, materialize_model, unit_seed
from lightning_dynmo.pipeline.model.contract import check_model_contract
from tests.distributed.meta_model import MetaGPT, model_bytes

CPU = torch.device("cpu")


def _build_only(units: list[str], **overrides: Any) -> MetaGPT:
    model = MetaGPT(num_layers=4, **overrides)
    keep_local_units(model, check_model_contract(model), units, device=CPU)
    return model


def _assert_units_equal(part: nn.Module, whole: nn.Module) -> None:
    mine = part.state_dict()
    assert mine, "the part holds nothing"
    reference = whole.state_dict()
    for key, value in mine.items():
        assert torch.equal(value, reference[key]), key


def test_unit_seeds_are_stable_and_distinct() -> None:
    assert unit_seed(0, "layers.0") == unit_seed(0, "layers.0")
    seeds = {unit_seed(s, u) for s in (0, 1) for u in ("layers.0", "layers.1", "tok_emb")}
    assert len(seeds) == 6
    # Pinned: a model's initial values must not change between versions (the other end of a checkpoint).
    assert unit_seed(0, "layers.0") == 7562614255450807484


@pytest.mark.parametrize(
    "owned", [["layers.2", "head"], ["tok_emb", "layers.3"], ["layers.0", "layers.1", "ln_f"]]
)
def test_a_subset_gets_the_values_of_the_whole_model(owned: list[str]) -> None:
    whole = materialize_model(MetaGPT(num_layers=4))
    part = _build_only(owned)
    _assert_units_equal(part, whole)
    assert model_bytes(part) < model_bytes(whole)


def test_negative_control_one_random_stream_across_units_depends_on_what_is_built(monkeypatch: Any) -> None:
    counter = itertools.count()
    monkeypatch.setattr(construction, "unit_seed", lambda seed, unit: next(counter))
    whole = materialize_model(MetaGPT(num_layers=4))
    part = _build_only(["layers.2", "head"])
    with pytest.raises(AssertionError, match="layers"):
        _assert_units_equal(part, whole)


def test_a_tied_head_built_alone_takes_the_embeddings_values() -> None:
    whole = materialize_model(MetaGPT(num_layers=2, tie_embeddings=True))
    assert whole.head.weight is whole.tok_emb.weight  # one parameter in one process
    head_only = _build_only(["ln_f", "head"], tie_embeddings=True)
    assert head_only.tok_emb is None  # materialised for a moment, then dropped
    assert torch.equal(head_only.head.weight, whole.tok_emb.weight)


def test_without_an_init_hook_each_submodule_is_reset() -> None:
    class Plain(MetaGPT):
        pipeline_init_unit = None  # type: ignore[assignment]

    model = materialize_model(Plain(num_layers=2))
    assert not any(torch.isnan(p).any() for p in model.parameters())


def test_an_uninitialised_tensor_is_named() -> None:
    class Forgetful(MetaGPT):
        def pipeline_init_unit(self, name: str, unit: nn.Module) -> None:
            if name != "layers.1":
                super().pipeline_init_unit(name, unit)

    with pytest.raises(
        TypeError, match=r"unit 'layers.1' was materialised .* \['ln_1.weight'.*pipeline_init_unit"
    ):
        materialize_model(Forgetful(num_layers=2))


def test_a_bad_seed_is_refused() -> None:
    model = MetaGPT(num_layers=2)
    model.pipeline_init_seed = "0"  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"pipeline_init_seed is '0'; it must be an int"):
        materialize_model(model)


def test_a_meta_tensor_outside_the_units_is_refused() -> None:
    model = MetaGPT(num_layers=2)
    with torch.device("meta"):
        model.register_buffer("stray", torch.zeros(3), persistent=False)  # a constant: the contract allows it
    with pytest.raises(TypeError, match=r"still has meta tensors outside its pipeline units: \['stray'\]"):
        materialize_model(model)


def test_a_model_built_on_a_real_device_is_left_as_it_is() -> None:
    model = MetaGPT(num_layers=2)
    materialize_model(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert keep_local_units(model, check_model_contract(model), ["layers.0"], device=CPU) == 0
    assert torch.equal(model.layers["0"].attn.qkv.weight, before["layers.0.attn.qkv.weight"])
