"""Pipelined Trainer.fit equals single-process training of the same model on the same batches.

Each run forks real gloo ranks (``run_distributed``) that call ``Trainer.fit`` with ``DynMoStrategy``
on an already-initialised process group (Lightning's launcher is not used; see
``tests/integration/test_strategy_launcher.py`` for that path). Every rank returns the per-step losses it
logged and its local ``state_dict``; keys are global (``layers.5...``), so the union is the whole model.
The reference is a plain single-device ``Trainer.fit`` of the identically seeded model in this process.
Everything runs in float64 (``precision="64-true"``), where pipelining changes results only by rounding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.distributed.fitting import (
    TOL,
    LocalClipStrategy,
    NoTieSyncStrategy,
    Run,
    assert_matches_reference,
    fit_pipelined,
    max_param_diff,
    reference,
)

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"])
def test_pipelined_fit_equals_single_process(schedule: str, tmp_path: Any) -> None:
    run = Run(schedule=schedule)
    results = fit_pipelined(run, tmp_path)
    assert_matches_reference(results, reference(run), run)
    stages_per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    owned = sorted(layer for res in results for layer in res["layers"])
    assert owned == list(range(run.num_layers)), "every layer must live on exactly one rank"
    assert [len(res["stage_indices"]) for res in results] == [stages_per_rank] * run.world_size


def test_gradient_accumulation_equals_single_process(tmp_path: Any) -> None:
    run = Run(accumulate=2, steps=6)
    assert_matches_reference(fit_pipelined(run, tmp_path), reference(run), run)


def test_gradient_clipping_uses_the_norm_over_all_stages(tmp_path: Any) -> None:
    run = Run(clip=0.05, steps=8)
    ref = reference(run)
    assert min(ref["grad_norms"]) > 0.05, "the clip must bite on every step for this test to mean anything"
    assert_matches_reference(fit_pipelined(run, tmp_path), ref, run)
    # Negative control: clipping each stage by its own norm (Lightning's default) must not match.
    local = fit_pipelined(run, tmp_path, strategy_cls=LocalClipStrategy)
    assert max_param_diff(local, ref) > 1e-4


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_migrations_mid_run_do_not_change_training(schedule: str, tmp_path: Any) -> None:
    stages = 2 if schedule == "1F1B" else 4
    if stages == 2:
        start, moves = "0-2|3-5", ((3, "0-3|4-5"), (6, "0-0|1-5"))  # one layer forward, then four back
    else:
        start, moves = "0-1|2-2|3-3|4-5", ((3, "0-0|1-3|4-4|5-5"), (6, "0-2|3-3|4-4|5-5"))
    run = Run(schedule=schedule, num_layers=6, placement=start, migrations=moves, accumulate=2, steps=5)
    results = fit_pipelined(run, tmp_path)
    assert all(res["applied"] == [p for _, p in moves] for res in results)
    assert_matches_reference(results, reference(run), run)
    unmigrated = fit_pipelined(replace(run, migrations=()), tmp_path)
    worst = max(
        abs(a - b)
        for res, base in zip(results, unmigrated, strict=True)
        for a, b in zip(res["losses"], base["losses"], strict=True)
    )
    assert worst < TOL, f"losses with migrations differ from the run without by {worst:.3e}"


def test_non_neighbour_moves_on_four_ranks(tmp_path: Any) -> None:
    # Layer 3 jumps from stage 1 to stage 3 (rank 1 -> rank 3) while layers 1, 2, 4, 5 shift too.
    run = Run(
        world_size=4,
        num_layers=8,
        placement="0-1|2-3|4-5|6-7",
        migrations=((4, "0-0|1-1|2-2|3-7"),),
        steps=8,
        clip=0.05,
    )
    results = fit_pipelined(run, tmp_path)
    assert [res["layers"] for res in results] == [[0], [1], [2], [3, 4, 5, 6, 7]]
    assert_matches_reference(results, reference(run), run)


def test_two_data_parallel_replicas_of_a_two_stage_pipeline(tmp_path: Any) -> None:
    run = Run(world_size=4, pipeline_size=2, use_sampler=True, steps=6, clip=0.05)
    results = fit_pipelined(run, tmp_path)
    assert [res["stage_index"] for res in results] == [0, 1, 0, 1]
    assert [(res["first"], res["last"]) for res in results] == [(True, False), (False, True)] * 2
    assert_matches_reference(results, reference(run), run)


def test_a_smaller_last_batch_rebuilds_the_stages(tmp_path: Any) -> None:
    run = Run(steps=4, extra_samples=4)  # four batches of 8, then one of 4 (one sample per micro-batch)
    assert_matches_reference(fit_pipelined(run, tmp_path), reference(run), run)


def test_float32_training_follows_the_reference(tmp_path: Any) -> None:
    # In float32, AdamW magnifies reduction-order noise (shared/notes/feasibility.md section 2), so only
    # closeness is expected, not 1e-9.
    run = Run(precision="32-true", steps=6)
    results = fit_pipelined(run, tmp_path)
    floats = [v for res in results for v in res["state"].values() if v.is_floating_point()]
    assert all(v.dtype == torch.float32 for v in floats)
    assert_matches_reference(results, reference(run), run, tol=1e-3)


@pytest.mark.parametrize(
    "run",
    [
        Run(tie_embeddings=True, clip=0.05, accumulate=2, steps=6),
        Run(tie_embeddings=True, schedule="ZBVZeroBubble"),  # first and last stage both on rank 0
        Run(tie_embeddings=True, world_size=4, pipeline_size=2, use_sampler=True, steps=6, clip=0.05),
        Run(
            tie_embeddings=True,
            num_layers=6,
            placement="0-2|3-5",
            migrations=((3, "0-3|4-5"), (6, "0-0|1-5")),
            accumulate=2,
            steps=5,
        ),
    ],
    ids=["1F1B-clip-accumulate", "ZBV-same-rank", "2x2-data-parallel", "with-migrations"],
)
def test_embedding_tied_to_the_head_trains_as_one_parameter(run: Run, tmp_path: Any) -> None:
    ref = reference(run)
    results = fit_pipelined(run, tmp_path)
    assert_matches_reference(results, ref, run)  # both copies (tok_emb.weight, head.weight) checked
    if run.schedule == "1F1B" and run.world_size == 2 and not run.migrations:
        # Negative control: copies that are not summed drift apart from the single-process training.
        assert max_param_diff(fit_pipelined(run, tmp_path, strategy_cls=NoTieSyncStrategy), ref) > 1e-4


def test_data_parallel_replicas_migrate_in_one_plan(tmp_path: Any) -> None:
    # DP2 x PP2: both replicas move their copies of layer 3, then of layers 2 and 3 back, in one plan each.
    run = Run(
        world_size=4,
        pipeline_size=2,
        use_sampler=True,
        num_layers=6,
        placement="0-2|3-5",
        migrations=((2, "0-3|4-5"), (4, "0-1|2-5")),
        steps=6,
        clip=0.05,
    )
    results = fit_pipelined(run, tmp_path)
    assert all(res["applied"] == [p for _, p in run.migrations] for res in results)
    for a, b in ((0, 2), (1, 3)):  # max_param_diff merges replicas: check they hold the same copies
        assert results[a]["state"].keys() == results[b]["state"].keys()
        assert all(torch.equal(v, results[b]["state"][k]) for k, v in results[a]["state"].items())
    ref = reference(run)
    assert_matches_reference(results, ref, run)
    # Negative control: the same comparison tells apart a run that trains differently (no clipping).
    assert max_param_diff(results, reference(replace(run, clip=None))) > 1e-4
