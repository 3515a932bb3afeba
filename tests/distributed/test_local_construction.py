"""Local construction under DynMoStrategy: a meta-device model, each rank building only its own units.

Every rank declares the whole model on the meta device (``MetaGPT``, or ``ConfiguredGPT`` in
``configure_model``) and materialises only the units it owns. Its initial weights must equal, exactly,
the single-process model's (materialised in one process), and training (with a migration and a re-pack)
must equal the single-process run in float64. The negative control shares one random stream across
units instead of seeding each unit: the initial weights then depend on what a rank builds, and the
comparison fails.

Memory budget. A model whose weights are larger than what one rank may hold (``BUDGET``) starts, trains
and migrates on 2 ranks. Measured, outside the code under test: the rank's peak resident memory growth
(the kernel's ``VmHWM``, reset in the ``setup`` hook) while ``configure_model`` and the strategy build and
set up the model, and the bytes of model tensors the rank holds after every batch (migrations included).
Gradients and optimizer state of the rank's share come on top during training and are not part of the
budget (they scale with the share too). The negative control builds the same model eagerly, as every
rank did before: its construction alone exceeds the budget.
"""

from __future__ import annotations

import gc
import itertools
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.pipeline.model import construction
from lightning_dynmo.pipeline.model.construction import materialize_model
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed import fitting
from tests.distributed.fitting import TOL, Run, local_state, make_strategy, max_param_diff, reference
from tests.distributed.harness import run_distributed
from tests.distributed.memory import MIB, Watch
from tests.distributed.meta_model import ConfiguredGPT, MetaGPT, model_bytes

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class MetaRun(Run):
    """A :class:`Run` of a meta-device GPT: ``kind`` "meta" (declared in ``__init__``), "configured" (in
    ``configure_model``), or "eager" (the control: every rank builds the whole model there)."""

    kind: str = "meta"
    d_model: int = 32
    num_heads: int = 2
    mlp_ratio: int = 2
    seq_len: int = 16
    # Negative control: one random stream across units (a counter) instead of a seed per unit.
    shared_stream: bool = False

    def _config(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "lr_gamma": self.lr_gamma,
            "d_model": self.d_model,
            "num_heads": self.num_heads,
            "mlp_ratio": self.mlp_ratio,
            "seq_len": self.seq_len,
            "tie_embeddings": self.tie_embeddings,
        }

    def model(self) -> Any:
        if self.kind in ("configured", "eager"):
            return ConfiguredGPT(dtype=torch.float64, whole=self.kind == "eager", **self._config())
        return MetaGPT(dtype=torch.float64, **self._config())

    def reference_model(self) -> Any:
        model = self.model()
        return materialize_model(model) if self.kind == "meta" else model

    def datamodule(self) -> RandomTokenDataModule:
        return RandomTokenDataModule(self.batch_size, self.num_samples, seq_len=self.seq_len)


def construction_worker(rank: int, world_size: int, run: MetaRun) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    if run.shared_stream:
        counter = itertools.count()
        construction.unit_seed = lambda seed, unit: next(counter)  # type: ignore[assignment]
    recorder, mover = fitting.LossRecorder(), fitting.ForcePlacement(dict(run.migrations))
    strategy = make_strategy(run)
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=run.use_sampler,
        callbacks=[recorder, mover],
        **run.trainer_kwargs(),
    )
    watch = Watch()
    trainer.callbacks.append(watch)
    model = run.model()
    trainer.fit(model, run.datamodule())
    assert isinstance(strategy, DynMoStrategy)
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "initial": watch.initial,
        "setup_growth": watch.setup_growth,
        "held": watch.held,
        "released": strategy.is_released,
        "placement": str(strategy.placement),
    }


def fit(run: MetaRun, tmp_path: Path) -> list[dict[str, Any]]:
    gc.collect()  # the ranks inherit this process's memory: leave them no garbage to free
    return run_distributed(construction_worker, run.world_size, tmp_path, timeout_s=180, args=(run,))


def assert_initial_weights_equal_one_process(results: list[dict[str, Any]], run: MetaRun) -> None:
    expected = materialize_model(MetaGPT(dtype=torch.float64, **run._config())).state_dict()
    seen: set[str] = set()
    for res in results:
        for key, value in res["initial"].items():
            assert torch.equal(value, expected[key]), f"initial {key} differs from the single-process model's"
            seen.add(key)
    assert seen == set(expected)


def assert_trains_like_one_process(results: list[dict[str, Any]], run: MetaRun) -> None:
    ref = reference(replace(run, shared_stream=False))
    for res in results:
        n = len(res["losses"])
        assert n == run.steps or res["released"]
        diff = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"][:n], strict=True))
        assert diff < TOL, f"losses differ from the single-process run by {diff:.3e}"
    assert max_param_diff([r for r in results if not r["released"]], ref) < TOL


SMALL = MetaRun(num_layers=6, placement="0-2|3-5", steps=6, migrations=((2, "0-4|5-5"), (4, "0-5")))


@pytest.mark.parametrize(("kind", "tied"), [("meta", False), ("configured", True)])
def test_each_rank_builds_its_units_with_the_single_process_values_and_trains_exactly(
    kind: str, tied: bool, tmp_path: Path
) -> None:
    # Tied: the last rank builds the head alone and takes the tied weight from the embedding's init.
    run = replace(SMALL, kind=kind, tie_embeddings=tied)
    results = fit(run, tmp_path)
    assert [r["released"] for r in results] == [False, True]  # migrated, then re-packed onto rank 0
    assert_initial_weights_equal_one_process(results, run)
    assert_trains_like_one_process(results, run)


def test_negative_control_one_random_stream_across_units_is_caught(tmp_path: Path) -> None:
    run = replace(SMALL, shared_stream=True, steps=1, migrations=())
    results = fit(run, tmp_path)
    with pytest.raises(AssertionError, match="differs from the single-process model's"):
        assert_initial_weights_equal_one_process(results, run)


# Six blocks of 14 MB (float64) and tiny activations: the weights dominate every other allocation.
BIG = MetaRun(
    num_layers=6,
    d_model=384,
    num_heads=4,
    mlp_ratio=4,
    seq_len=4,
    placement="0-2|3-5",
    steps=2,
    migrations=((1, "0-3|4-5"),),
)
BUDGET = 64 * MIB


def assert_within_budget(results: list[dict[str, Any]], budget: int) -> None:
    for rank, res in enumerate(results):
        assert res["setup_growth"] <= budget, (
            f"rank {rank}: resident memory grew by {res['setup_growth'] / MIB:.1f} MiB while building and "
            f"setting up the model, over the budget of {budget / MIB:.0f} MiB"
        )
        assert max(res["held"]) <= budget, (
            f"rank {rank} held {max(res['held']) / MIB:.1f} MiB of model tensors"
        )


@pytest.mark.slow
def test_a_model_larger_than_a_ranks_budget_starts_trains_and_migrates(tmp_path: Path) -> None:
    full = model_bytes(BIG.reference_model())
    assert full > BUDGET * 1.25, f"the model ({full / MIB:.1f} MiB) must not fit the budget"
    results = fit(BIG, tmp_path)
    assert all(r["placement"] == "0-3|4-5" for r in results)
    assert_within_budget(results, BUDGET)
    assert max(results[0]["held"]) > results[0]["held"][0]  # the migration moved a block to rank 0
    assert_initial_weights_equal_one_process(results, BIG)
    assert_trains_like_one_process(results, BIG)


def test_negative_control_building_the_whole_model_on_each_rank_exceeds_the_budget(tmp_path: Path) -> None:
    results = fit(replace(BIG, kind="eager", steps=1, migrations=()), tmp_path)
    with pytest.raises(AssertionError, match=r"resident memory grew by .* over the budget"):
        assert_within_budget(results, BUDGET)
