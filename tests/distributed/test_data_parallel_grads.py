"""Data-parallel gradient averaging when a parameter has a gradient on some replicas only.

An expert no token of one replica's batch was routed to (here: a bias added only to a rare token's
embedding, inside ``pipeline_first``) has a gradient on one replica and none on the other. The averaged
gradient must be what one process computes over the union of both replicas' batches: the one replica's
gradient divided by the number of replicas, on both. 2 data-parallel replicas x 2 stages on 4 gloo ranks,
compared with the single-process reference in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler

from lightning_dynmo.demos import DemoGPT, RandomTokenDataModule
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.fitting import Run, assert_matches_reference, fit_pipelined, max_param_diff, reference

pytestmark = pytest.mark.distributed

RARE = 63  # the last token id; the data below holds it only in replica 0's batches 0 and 2


class RareTokenBias(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.full((dim,), 0.01))


class RareTokenGPT(DemoGPT):
    """DemoGPT plus a bias added only where the rare token occurs (in the graph only if it occurs)."""

    pipeline_first_parts = ("tok_emb", "pos_emb", "rare")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rare = RareTokenBias(self.config.d_model)

    def pipeline_first(self, idx: Tensor) -> Tensor:
        hidden = super().pipeline_first(idx)
        mask = idx == RARE
        if mask.any():
            hidden = hidden + mask.unsqueeze(-1) * self.rare.bias
        return hidden


class RareTokenData(RandomTokenDataModule):
    """Random tokens without ``RARE``, except in one row of replica 0's batches 0 and 2."""

    def __init__(self, batch_size: int, num_samples: int) -> None:
        super().__init__(batch_size, num_samples)
        tokens = self.dataset.tokens
        tokens[tokens == RARE] = RARE - 1
        # The rows Lightning's DistributedSampler (shuffle, seed 0) gives replica 0 of 2.
        shard = list(DistributedSampler(self.dataset, num_replicas=2, rank=0, shuffle=True, seed=0))
        for k in (0, 2):
            tokens[shard[k * batch_size], 3] = RARE


@dataclass(frozen=True)
class RareRun(Run):
    def model(self) -> DemoGPT:
        return RareTokenGPT(num_layers=self.num_layers, lr_gamma=self.lr_gamma)

    def datamodule(self) -> RandomTokenDataModule:
        return RareTokenData(self.batch_size, self.num_samples)


class RecordingStrategy(DynMoStrategy):
    """Checks, at the end of fit, that the rare bias had a gradient on replica 0 only (before averaging)."""

    had_grad: list[bool]

    def _sync_data_parallel_grads(self) -> None:
        rare = getattr(self._module(), "rare", None)
        if rare is not None:
            self.__dict__.setdefault("had_grad", []).append(rare.bias.grad is not None)
        super()._sync_data_parallel_grads()

    def teardown(self) -> None:
        if self.stage_index == 0:
            expected = [True, False, True, False] if self.data_parallel_rank == 0 else [False] * 4
            assert self.had_grad == expected, f"rank {self.global_rank}: rare gradient {self.had_grad}"
        super().teardown()


class RareLeftOut(DynMoStrategy):
    """Negative control: the rare bias is left out of the averaging (each replica keeps its own)."""

    def _sync_data_parallel_grads(self) -> None:
        rare = getattr(self._module(), "rare", None)
        held = rare.bias.grad if rare is not None else None
        if rare is not None:
            rare.bias.grad = None
        super()._sync_data_parallel_grads()
        if rare is not None:
            rare.bias.grad = held


RUN = RareRun(world_size=4, pipeline_size=2, use_sampler=True, steps=4, clip=0.05)


def test_a_gradient_on_one_replica_only_is_averaged_like_one_process(tmp_path: Any) -> None:
    ref = reference(RUN)
    results = fit_pipelined(RUN, tmp_path, strategy_cls=RecordingStrategy)
    assert_matches_reference(results, ref, RUN)
    assert max_param_diff(fit_pipelined(RUN, tmp_path, strategy_cls=RareLeftOut), ref) > 1e-4
