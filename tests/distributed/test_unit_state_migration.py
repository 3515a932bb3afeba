"""Layer state under migration on 2 gloo ranks: parametrizations migrate exactly, hooks are refused.

A weight-mask parametrization (the mask a buffer of the parametrization module) on every block's MLP
migrates with the block, and training with migrations equals the single-process run in float64. Hooks
a user put on a block are refused on every rank: at setup, or at the migration if they were added later.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import Run, assert_matches_reference, fit_pipelined, max_param_diff, reference

pytestmark = pytest.mark.distributed


class WeightMask(nn.Module):
    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, weight: Tensor) -> Tensor:
        return weight * self.mask


class MaskedGPT(DemoGPT):
    """DemoGPT whose blocks' ``mlp.fc_in.weight`` is ``original * mask`` (a fixed random half of entries).

    ``hooks``: ``"at-init"`` puts a forward pre-hook on block 1; ``"on-train-start"`` adds it when training
    starts (after the strategy checked the model).
    """

    def __init__(self, hooks: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        gen = torch.Generator().manual_seed(1)
        for block in self.layers.values():
            mask = (torch.rand(block.mlp.fc_in.weight.shape, generator=gen) > 0.5).float()
            parametrize.register_parametrization(block.mlp.fc_in, "weight", WeightMask(mask))
        self.hooks = hooks
        if hooks == "at-init":
            self._add_hook()

    def _add_hook(self) -> None:
        if "1" in self.layers:  # on the rank that owns block 1
            self.layers["1"].ln_1.register_forward_pre_hook(lambda module, args: None)

    def on_train_start(self) -> None:
        if self.hooks == "on-train-start":
            self._add_hook()


class DropParametrizations(DynMoStrategy):
    """Negative control: a received block loses its mask's state (all ones: the weight is unmasked)."""

    def _migrate(self, planned: Any, what: str) -> Any:
        before = set(self._local_units())
        report = super()._migrate(planned, what)
        for unit, module in self._local_units().items():
            if unit in before:
                continue
            for sub in module.modules():
                if parametrize.is_parametrized(sub, "weight"):
                    sub.parametrizations.weight[0].mask.fill_(1.0)
        return report


RUN = Run.two_migrations(MaskedGPT)


def test_a_parametrized_layer_migrates_and_trains_exactly(tmp_path: Any) -> None:
    ref = reference(RUN)
    results = fit_pipelined(RUN, tmp_path)
    assert all(res["applied"] == ["0-3|4-5", "0-0|1-5"] for res in results)
    assert any(k.endswith("fc_in.parametrizations.weight.0.mask") for k in results[1]["state"])
    assert_matches_reference(results, ref, RUN)
    dropped = fit_pipelined(RUN, tmp_path, strategy_cls=DropParametrizations)
    assert max_param_diff(dropped, ref) > 1e-4


@pytest.mark.parametrize(
    ("hooks", "match"),
    [
        (
            "at-init",
            r"(?s)rank 0 -----.*unit 'layers.1': 'ln_1' carries a forward pre-hook.*rank 1 -----.*"
            r"unit 'layers.1': 'ln_1' carries a forward pre-hook",
        ),
        (
            "on-train-start",
            r"(?s)rank 0 -----.*unit 'layers.1': 'ln_1' carries a forward pre-hook.*rank 1 -----.*"
            r"Migration aborted: rank\(s\) \[0\] rejected the moves",
        ),
    ],
)
def test_a_block_with_a_users_hook_is_refused_on_every_rank(hooks: str, match: str, tmp_path: Any) -> None:
    # Block 1 starts on rank 0 ("0-2|3-5") and the second migration moves it to rank 1.
    run = replace(RUN, model_args=(hooks,))
    with pytest.raises(AssertionError, match=match):
        fit_pipelined(run, tmp_path)
