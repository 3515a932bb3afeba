"""The global pruning threshold over a model split across gloo ranks keeps exactly what a single-process
global top-k keeps: on 2 pipeline ranks (contiguous and interleaved layer sets) and on 2 x 2 data-parallel
x pipeline ranks, over successive pruning steps, with exact ties; replicas also agree on kernels.

Negative controls: ranks that each take their own threshold (no pipeline group), and replicas that
choose kernels on their own timings (no data-parallel group).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_dynmo.dynamism import pruning as pruning_module
from lightning_dynmo.dynamism.pruning import (
    GlobalMagnitudePruner,
    PruningConfig,
    PruningScope,
    prunable_linears,
)
from lightning_dynmo.dynamism.sparse_linear import MaskedLinear
from lightning_dynmo.events import EventBus
from lightning_dynmo.models import GPT, GPTConfig
from tests.distributed.harness import run_distributed
from tests.unit.dynamism.test_pruning import brute_force_masks

pytestmark = pytest.mark.distributed

CONFIG = GPTConfig(num_layers=6, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
SPARSITIES = (0.3, 0.75, 0.9)
QUANTUM = 2e-3  # weights rounded to multiples of it: thousands of exact ties at every threshold


def full_model() -> GPT:
    model = GPT(CONFIG).double()
    GlobalMagnitudePruner.prepare({int(k): m for k, m in model.layers.items()})
    with torch.no_grad():
        for _, _, m in prunable_linears({int(k): b for k, b in model.layers.items()}):
            m.weight.copy_(torch.round(m.weight / QUANTUM) * QUANTUM)
    return model


def expected_masks() -> list[dict[str, torch.Tensor]]:
    """Single process, whole model: the masks after each of SPARSITIES (pruned in turn)."""
    model = full_model()
    layers = {int(k): b for k, b in model.layers.items()}
    names = [n for _, n, _ in prunable_linears(layers)]
    out = []
    for sparsity in SPARSITIES:
        masks = brute_force_masks(model, sparsity)
        for (_, _, m), mask in zip(prunable_linears(layers), masks, strict=True):
            m.set_mask(mask.view(m.weight.shape))
        out.append({n: mask.clone() for n, mask in zip(names, masks, strict=True)})
    return out


def fake_timing(replica: int) -> Any:
    """Replica 0 measures CSR 3x faster, replica 1 2x slower: the sum (dense 4, CSR 3) picks CSR."""

    def time_kernels(layer: MaskedLinear, rows: int, **kwargs: Any) -> dict[str, float]:
        return {"dense": 3.0, "csr": 1.0} if replica == 0 else {"dense": 1.0, "csr": 2.0}

    return time_kernels


def prune_worker(
    rank: int, world_size: int, owned: list[list[int]], pipeline_size: int, agree: bool
) -> dict[str, Any]:
    """This rank holds the layers ``owned[pipeline position]``; prune to each of SPARSITIES in turn."""
    replica, position = divmod(rank, pipeline_size)
    pipelines = [
        dist.new_group(list(range(r * pipeline_size, (r + 1) * pipeline_size)))
        for r in range(world_size // pipeline_size)
    ]
    replicas = [dist.new_group(list(range(p, world_size, pipeline_size))) for p in range(pipeline_size)]
    pruning_module.time_kernels = fake_timing(replica)  # forked worker: patches this process only
    model = full_model()
    layers = {i: model.layers[str(i)] for i in owned[position]}
    scope = PruningScope(
        layers=layers,
        num_layers=CONFIG.num_layers,
        pipeline_group=pipelines[replica] if agree else None,
        data_parallel_group=replicas[position] if agree and world_size > pipeline_size else None,
    )
    config = PruningConfig(kernel="auto", csr_min_sparsity=0.0, timing_repeats=1)
    pruner = GlobalMagnitudePruner(config, event_bus=EventBus())
    steps = []
    for sparsity in SPARSITIES:
        report = pruner.prune_to(sparsity, scope)
        masks = {n: m.weight_mask.reshape(-1).clone() for _, n, m in prunable_linears(layers)}
        zeros = all((m.weight[~m.weight_mask] == 0).all() for _, _, m in prunable_linears(layers))
        # Entries left at exactly the threshold: the tie-break decided between equal magnitudes.
        kept_ties = sum(
            int((m.weight[m.weight_mask].abs() == report.threshold).sum())
            for _, _, m in prunable_linears(layers)
        )
        steps.append({"masks": masks, "report": report, "zeros": zeros, "kept_ties": kept_ties})
    kernels = {n: m.kernel for _, n, m in prunable_linears(layers)}
    return {"steps": steps, "kernels": kernels, "replica": replica}


def mismatches(results: list[dict[str, Any]], expected: list[dict[str, torch.Tensor]], replica: int) -> int:
    """How many weight entries differ from the expected masks over all steps, for one replica's ranks."""
    wrong = 0
    for j, want in enumerate(expected):
        got: dict[str, torch.Tensor] = {}
        for res in results:
            if res["replica"] == replica:
                got.update(res["steps"][j]["masks"])
        assert set(got) == set(want), "every prunable weight is held by exactly one rank of a replica"
        wrong += sum(int((got[n] != want[n]).sum()) for n in want)
    return wrong


@pytest.mark.parametrize(
    "owned",
    [[[0, 1, 2], [3, 4, 5]], [[0, 2, 4], [1, 3, 5]], [[0], [1, 2, 3, 4, 5]]],
    ids=["contiguous", "interleaved", "uneven"],
)
def test_two_pipeline_ranks_prune_what_one_process_prunes(owned: list[list[int]], tmp_path: Path) -> None:
    expected = expected_masks()
    results = run_distributed(prune_worker, 2, tmp_path, timeout_s=60, args=(owned, 2, True))
    assert mismatches(results, expected, replica=0) == 0
    for j, sparsity in enumerate(SPARSITIES):
        reports = [res["steps"][j]["report"] for res in results]
        assert reports[0].num_pruned == reports[1].num_pruned  # the global figures agree across ranks
        assert reports[0].threshold == reports[1].threshold
        assert reports[0].layer_sparsity == reports[1].layer_sparsity
        assert abs(reports[0].sparsity - sparsity) <= 0.5 / reports[0].num_prunable
        assert all(res["steps"][j]["zeros"] for res in results)
    assert all(sum(res["steps"][j]["kept_ties"] for res in results) > 0 for j in range(len(SPARSITIES)))


def test_ranks_with_their_own_threshold_prune_something_else(tmp_path: Path) -> None:
    # Negative control: without the pipeline group each rank prunes its own share.
    expected = expected_masks()
    results = run_distributed(
        prune_worker, 2, tmp_path, timeout_s=60, args=([[0, 1, 2], [3, 4, 5]], 2, False)
    )
    assert mismatches(results, expected, replica=0) > 0


def test_two_by_two_replicas_agree_on_masks_and_kernels(tmp_path: Path) -> None:
    expected = expected_masks()
    owned = [[0, 1, 2, 3], [4, 5]]
    results = run_distributed(prune_worker, 4, tmp_path, timeout_s=90, args=(owned, 2, True))
    assert mismatches(results, expected, replica=0) == 0
    assert mismatches(results, expected, replica=1) == 0
    for position in range(2):
        first, second = results[position], results[2 + position]
        assert first["kernels"] == second["kernels"]
        assert set(first["kernels"].values()) == {"csr"}  # the summed timings: dense 4 s vs CSR 3 s
    # Negative control: replicas deciding on their own timings disagree.
    alone = run_distributed(prune_worker, 4, tmp_path, timeout_s=90, args=(owned, 2, False))
    assert set(alone[0]["kernels"].values()) == {"csr"} and set(alone[2]["kernels"].values()) == {"dense"}
