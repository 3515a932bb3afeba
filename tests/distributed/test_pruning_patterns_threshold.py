"""Structured pruning patterns across gloo ranks: 2 pipeline ranks holding interleaved layers keep exactly
the masks one process keeps, for 2:4 and block pruning over successive schedule steps (the selection and
its threshold stay exact and global in every pattern). Negative control: ranks with their own threshold."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_dynmo.dynamism.pruning import (
    GlobalMagnitudePruner,
    PruningConfig,
    PruningScope,
    prunable_linears,
)
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.events import EventBus
from lightning_dynmo.models import GPT, GPTConfig
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

CONFIG = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
CASES = {
    "2:4": ({"pattern": "2:4", "schedule": PruningSchedule(final_sparsity=0.5)}, (0.3, 0.5)),
    "block": ({"pattern": "block", "block_size": 8}, (0.3, 0.75)),
}
OWNED = [[0, 2], [1, 3]]


def _prune(layers: dict[int, Any], case: str, group: Any) -> list[dict[str, torch.Tensor]]:
    options, sparsities = CASES[case]
    pruner = GlobalMagnitudePruner(PruningConfig(kernel="dense", **options), event_bus=EventBus())
    steps = []
    for sparsity in sparsities:
        report = pruner.prune_to(sparsity, PruningScope(layers, CONFIG.num_layers, pipeline_group=group))
        masks = {n: m.weight_mask.clone() for _, n, m in prunable_linears(layers)}
        steps.append({"masks": masks, "threshold": report.threshold, "sparsity": report.sparsity})
    return steps


def _model() -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG).double()
    GlobalMagnitudePruner.prepare({int(k): m for k, m in model.layers.items()})
    return model


def worker(rank: int, world_size: int, case: str, agree: bool) -> list[dict[str, Any]]:
    model = _model()
    layers = {i: model.layers[str(i)] for i in OWNED[rank]}
    return _prune(layers, case, dist.group.WORLD if agree else None)


def _mismatches(results: list[list[dict[str, Any]]], expected: list[dict[str, Any]]) -> int:
    wrong = 0
    for j, want in enumerate(expected):
        got = {**results[0][j]["masks"], **results[1][j]["masks"]}
        assert set(got) == set(want["masks"])
        wrong += sum(int((got[n] != want["masks"][n]).sum()) for n in got)
    return wrong


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_pipeline_ranks_prune_what_one_process_prunes_in_every_pattern(case: str, tmp_path: Path) -> None:
    model = _model()
    expected = _prune({int(k): m for k, m in model.layers.items()}, case, None)
    results = run_distributed(worker, 2, tmp_path, timeout_s=60, args=(case, True))
    assert _mismatches(results, expected) == 0
    for j, want in enumerate(expected):
        assert results[0][j]["threshold"] == results[1][j]["threshold"] == want["threshold"]
        assert results[0][j]["sparsity"] == want["sparsity"]
    # Negative control: each rank with its own threshold prunes something else.
    alone = run_distributed(worker, 2, tmp_path, timeout_s=60, args=(case, False))
    assert _mismatches(alone, expected) > 0
