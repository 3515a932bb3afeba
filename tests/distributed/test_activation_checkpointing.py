"""DynMoStrategy(activation_checkpointing=True): pipelined training equals the run without it, through
migrations.

On 2 forked gloo ranks in float64, the GPT trains with every block checkpointed through two migrations
(a block moves to the other rank and back) and must log the single-process reference's losses and end
with its parameters (1e-9). Each rank counts the second runs of its blocks' forwards: every block runs
again once per micro-batch and step whichever rank holds it, and never without the option (the negative
control that the option is not a no-op), and the same pipeline without the option ends bit for bit
equal. Hugging Face blocks (Mixtral, with its per-layer router loss
logged once) are tested in ``test_huggingface_fit.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dynmo.pipeline.step import recompute
from tests.distributed.fitting import Run, assert_matches_reference, fit_worker, reference
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

RUN = Run(num_layers=4, placement="0-1|2-3", steps=6, migrations=((2, "0-0|1-3"), (4, "0-2|3-3")))


def counting_worker(rank: int, world_size: int, run: Run, overrides: dict[str, Any]) -> dict[str, Any]:
    """``fit_worker``, also counting the second runs of checkpointed blocks on this rank."""
    count = [0]
    second_run = recompute._second_run

    @contextlib.contextmanager
    def counted() -> Iterator[None]:
        count[0] += 1
        with second_run():
            yield

    recompute._second_run = counted  # type: ignore[assignment]  # in this forked rank only
    return {**fit_worker(rank, world_size, run, overrides), "recomputed": count[0]}


def fit(run: Run, tmp_path: Path, checkpointing: bool) -> list[dict[str, Any]]:
    overrides = {"activation_checkpointing": checkpointing}
    return run_distributed(counting_worker, run.world_size, tmp_path, timeout_s=180, args=(run, overrides))


def test_checkpointed_blocks_train_exactly_as_without_through_migrations(tmp_path: Path) -> None:
    results = fit(RUN, tmp_path, checkpointing=True)
    assert [r["applied"] for r in results] == [["0-0|1-3", "0-2|3-3"]] * 2
    assert_matches_reference(results, reference(replace(RUN, migrations=())), RUN)
    assert sum(r["recomputed"] for r in results) == RUN.num_layers * RUN.num_microbatches * RUN.steps
    assert all(r["recomputed"] > 0 for r in results)
    # The same pipeline without the option: the same losses and parameters, bit for bit.
    plain = fit(RUN, tmp_path, checkpointing=False)
    assert [r["recomputed"] for r in plain] == [0, 0]  # negative control: the option is not a no-op
    for with_it, without in zip(results, plain, strict=True):
        assert with_it["losses"] == without["losses"]
        assert with_it["state"].keys() == without["state"].keys()
        assert all(torch.equal(v, without["state"][k]) for k, v in with_it["state"].items())
