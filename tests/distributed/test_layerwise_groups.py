"""Layer-wise parameter groups (one learning rate per block) survive migrations exactly.

Each rank builds its optimizer over its own stage, so ranks hold different groups. A migrated block's
parameters join the group with their learning rate on the receiving rank (created if needed, LR
schedulers included), so training equals the single-process run, which has every group, in float64.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.pipeline.migration import optimizer as migration
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import Run, assert_matches_reference, fit_pipelined, max_param_diff, reference

pytestmark = pytest.mark.distributed


class LayerwiseLR(DemoGPT):
    """Layer-wise LR decay: block ``i`` of ``n`` trains at ``lr * 0.7 ** (n - 1 - i)``, embeddings lowest.

    ``schedule="exponential"`` decays every group's rate by ``lr_gamma`` per step; ``"per-group"`` gives
    each group its own LambdaLR function (which a foreign group cannot follow: refused).
    """

    def __init__(self, schedule: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.schedule = schedule

    def configure_optimizers(self) -> Any:
        n, lr = self.config.num_layers, self.demo_config.lr
        groups = [
            {"params": list(getattr(self, name).parameters()), "lr": lr * 0.7**n}
            for name in ("tok_emb", "pos_emb")
            if getattr(self, name) is not None
        ]
        groups += [
            {"params": list(b.parameters()), "lr": lr * 0.7 ** (n - 1 - int(k))}
            for k, b in self.layers.items()
        ]
        groups += (
            [{"params": list(self.ln_f.parameters()) + list(self.head.parameters()), "lr": lr}]
            if self.head
            else []
        )
        optimizer = torch.optim.AdamW(groups, weight_decay=0.1)
        if self.schedule == "exponential":
            gamma = self.demo_config.lr_gamma
            scheduler: Any = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=gamma)
        else:
            scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, [lambda s, k=k: 0.9**s + k for k in range(len(groups))]
            )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class FirstGroup(DynMoStrategy):
    """Negative control: migrated parameters join group 0 (the embeddings' learning rate)."""

    def _migrate(self, planned: Any, what: str) -> Any:
        real = migration.group_for
        migration.group_for = lambda optimizer, *args: optimizer.param_groups[0]  # type: ignore[assignment]
        try:
            return super()._migrate(planned, what)
        finally:
            migration.group_for = real


# Block 3 goes to rank 0 (a group rank 0 does not have), then blocks 1-3 go to rank 1 (which has block 3's
# group but not those of blocks 1 and 2).
RUN = Run.two_migrations(LayerwiseLR, "exponential")


def test_layerwise_learning_rates_survive_migrations(tmp_path: Any) -> None:
    ref = reference(RUN)
    results = fit_pipelined(RUN, tmp_path)
    assert all(res["applied"] == ["0-3|4-5", "0-0|1-5"] for res in results)
    assert_matches_reference(results, ref, RUN)
    assert max_param_diff(fit_pipelined(RUN, tmp_path, strategy_cls=FirstGroup), ref) > 1e-4


def test_a_group_the_scheduler_cannot_follow_fails_on_every_rank(tmp_path: Any) -> None:
    run = replace(RUN, model_args=("per-group",), steps=3)
    with pytest.raises(AssertionError, match=r"(?s)LambdaLR holds one lr_lambda per group") as failure:
        fit_pipelined(run, tmp_path)
    assert "could not take in the units they received" in str(failure.value), "the sender must fail too"
