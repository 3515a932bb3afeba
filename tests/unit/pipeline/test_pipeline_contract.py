"""The model contract: a contract-abiding model is described, a broken one gets a TypeError naming the fix."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.pipeline.model.contract import (
    ModelSpec,
    TiedParameter,
    check_model_contract,
    find_tied_parameters,
)


class _Minimal(nn.Module):
    """The smallest valid model: blocks only, no first/last parts."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(n)})

    def pipeline_batch(self, batch: Any) -> Any:
        return batch

    def pipeline_loss(self, output: Any, target: Any) -> Any:
        return (output - target).pow(2).mean()


def test_demo_gpt_follows_the_contract() -> None:
    spec = check_model_contract(DemoGPT(num_layers=3))
    assert spec == ModelSpec(num_layers=3, first_parts=("tok_emb", "pos_emb"), last_parts=("ln_f", "head"))


def test_blocks_only_model_needs_no_first_or_last_methods() -> None:
    assert check_model_contract(_Minimal()) == ModelSpec(3, (), ())


def test_missing_layers() -> None:
    with pytest.raises(TypeError, match=r"Linear has no `layers: nn.ModuleDict` \(found NoneType\)"):
        check_model_contract(nn.Linear(2, 2))


def test_layers_keyed_out_of_order() -> None:
    model = _Minimal()
    model.layers = nn.ModuleDict({"1": nn.Linear(2, 2), "0": nn.Linear(2, 2)})
    with pytest.raises(TypeError, match=r"keys \['1', '0'\]; they must be '0', '1', ..., 'n-1'"):
        check_model_contract(model)


def test_missing_methods_are_named() -> None:
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(2, 2)})
    with pytest.raises(TypeError, match=r"missing \['pipeline_batch', 'pipeline_loss'\]"):
        check_model_contract(model)


def test_first_parts_require_pipeline_first() -> None:
    model = _Minimal()
    model.emb = nn.Embedding(4, 2)
    model.pipeline_first_parts = ("emb",)
    with pytest.raises(TypeError, match=r"missing \['pipeline_first'\]"):
        check_model_contract(model)


def test_parts_must_name_submodules() -> None:
    model = _Minimal()
    model.pipeline_last_parts = ("head",)
    with pytest.raises(TypeError, match=r"pipeline_last_parts names 'head', which is not a submodule"):
        check_model_contract(model)
    model.pipeline_last_parts = "head"
    with pytest.raises(TypeError, match=r"pipeline_last_parts is 'head'; it must be a tuple"):
        check_model_contract(model)


def test_untied_model_has_no_ties() -> None:
    model = DemoGPT(num_layers=3)
    assert find_tied_parameters(model, check_model_contract(model)) == ()


def test_embedding_tied_to_the_head_is_found() -> None:
    model = DemoGPT(num_layers=3, tie_embeddings=True)
    assert model.head.weight is model.tok_emb.weight
    ties = find_tied_parameters(model, check_model_contract(model))
    assert ties == (TiedParameter(first_name="tok_emb.weight", last_name="head.weight"),)


def test_blocks_sharing_weights_are_refused() -> None:
    model = _Minimal(n=4)
    for i in (1, 3):  # ALBERT-style sharing: weight and bias of block 0 reused by blocks 1 and 3
        model.layers[str(i)].weight = model.layers["0"].weight
        model.layers[str(i)].bias = model.layers["0"].bias
    with pytest.raises(
        TypeError, match=r"layers.0.weight is layers.1.weight is layers.3.weight \(and 1 more shared\)"
    ):
        find_tied_parameters(model, check_model_contract(model))
