"""HuggingFaceCausalLM's optimizer: HF Trainer's weight-decay groups on every rank, and the factories.

The decay group holds exactly the parameters ``transformers.Trainer.get_decay_parameter_names`` names
(GPT-2 with LayerNorms and a tied head, Llama and Mixtral with RMSNorms), on the whole model and on any
cut of it (two groups in the same order, even empty); optimizer and scheduler factories reach
``configure_optimizers``, and what they return is checked. Pipelined with a migration:
``tests/distributed/test_huggingface_fit.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from lightning_dynmo.models.hf_optim import DECAY, NO_DECAY, build_optimization
from lightning_dynmo.models.huggingface import HuggingFaceCausalLM
from lightning_dynmo.pipeline.model.construction import keep_local_units
from lightning_dynmo.pipeline.model.contract import check_model_contract
from tests.distributed.hf_reference import tiny_model, transformers


def _names(model: HuggingFaceCausalLM, params: list[Any]) -> set[str]:
    by_id = {id(p): model.huggingface_name(n) for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_the_decay_group_is_what_hf_trainer_decays(kind: str) -> None:
    plain = tiny_model(kind)
    everything = {n for n, _ in plain.named_parameters()}  # a tied head once, as the embedding
    # HF lists a tied tensor under each of its names (GPT-2's lm_head.weight too); it is one parameter.
    expected = set(transformers.Trainer.get_decay_parameter_names(None, plain)) & everything
    assert expected and everything - expected  # both groups hold something
    model = HuggingFaceCausalLM(plain, weight_decay=0.1)
    optimizer = model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.AdamW)
    decay, keep = optimizer.param_groups
    assert _names(model, decay["params"]) == expected
    assert _names(model, keep["params"]) == everything - expected
    assert (decay["weight_decay"], keep["weight_decay"], decay["lr"]) == (0.1, 0.0, 1e-3)


@pytest.mark.parametrize(
    "owned", [["embedding"], ["layers.0", "layers.1"], ["layers.3", "final_norm", "head"]]
)
def test_every_cut_builds_the_same_two_groups(owned: list[str]) -> None:
    model = HuggingFaceCausalLM(tiny_model("llama"), weight_decay=0.1)
    keep_local_units(model, check_model_contract(model), owned, device=torch.device("cpu"))
    groups = model.configure_optimizers().param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    if owned == ["embedding"]:
        assert groups[NO_DECAY]["params"] == []  # present though empty: the layout is every rank's
    names = _names(model, groups[NO_DECAY]["params"])
    assert all("norm" in n for n in names) and not _names(model, groups[DECAY]["params"]) & names


def test_the_factories_reach_configure_optimizers() -> None:
    seen: list[Any] = []

    def schedule(optimizer: torch.optim.Optimizer) -> Any:
        seen.append(optimizer)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))

    model = HuggingFaceCausalLM(
        tiny_model("gpt2"),
        weight_decay=0.2,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        lr_scheduler=schedule,
    )
    config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]
    assert isinstance(optimizer, torch.optim.SGD) and seen == [optimizer]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.2, 0.0]
    assert scheduler["interval"] == "step" and isinstance(
        scheduler["scheduler"], torch.optim.lr_scheduler.LambdaLR
    )
    assert "optimizer" not in model.hparams and "lr_scheduler" not in model.hparams  # code, not hparams


def test_a_scheduler_dict_is_passed_to_lightning_as_given() -> None:
    model = torch.nn.Linear(2, 2)
    groups = [{"params": [model.weight]}, {"params": [model.bias]}]

    def plateau(opt: torch.optim.Optimizer) -> dict[str, Any]:
        return {"scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "val_loss"}

    config = build_optimization(groups, lr=0.1, optimizer=None, lr_scheduler=plateau)
    assert config["lr_scheduler"]["monitor"] == "val_loss" and "interval" not in config["lr_scheduler"]


def test_factory_errors_name_the_rule() -> None:
    model = torch.nn.Linear(2, 2)
    groups = [{"params": [model.weight], "weight_decay": 0.1}, {"params": [model.bias], "weight_decay": 0.0}]
    with pytest.raises(TypeError, match=r"optimizer returned a list, not a torch\.optim\.Optimizer"):
        build_optimization(groups, lr=0.1, optimizer=lambda g: [], lr_scheduler=None)  # type: ignore[arg-type,return-value]
    merged = functools.partial(torch.optim.AdamW, model.parameters())
    with pytest.raises(TypeError, match=r"built 1 parameter groups of sizes \[2\] from the 2 groups"):
        build_optimization(groups, lr=0.1, optimizer=lambda g: merged(), lr_scheduler=None)
    with pytest.raises(TypeError, match=r"a dict with keys \['monitor'\] but no 'scheduler'"):
        build_optimization(groups, lr=0.1, optimizer=None, lr_scheduler=lambda o: {"monitor": "x"})
