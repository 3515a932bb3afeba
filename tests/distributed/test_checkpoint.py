"""Placement-independent checkpoints: save under one layout, resume under another, continue exactly.

The uninterrupted run is the single-process reference trained for two epochs (the pipelined run equals
it within 1e-9, see ``test_strategy_equivalence.py``). A pipelined run trains epoch 1 and saves at the
epoch's end (``ModelCheckpoint`` or ``trainer.save_checkpoint``); a second run resumes from that
checkpoint with another placement, another pipeline or data-parallel size, or after a re-pack, and trains
epoch 2. Its losses and final parameters must equal the reference's epoch 2 in float64 (1e-9).

Checkpoints are sharded directories by default; each resuming rank must read only its share of one
(the kernel's count of bytes read, ``/proc/self/io``), while from a gathered file every rank reads it
all. A few runs save the gathered file instead (``save_distributed_checkpoint=False``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.pipeline.checkpoint.checksums import MANIFEST_FILENAME
from lightning_dynmo.pipeline.checkpoint.contents import full_state_from_checkpoint
from lightning_dynmo.pipeline.checkpoint.sharded import export_full_checkpoint
from lightning_dynmo.pipeline.checkpoint.state import load_local_state
from lightning_dynmo.pipeline.model.units import unit_of_key
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed import fitting
from tests.distributed.fitting import TOL, Run, local_state, make_strategy, max_param_diff, reference
from tests.distributed.harness import run_distributed
from tests.distributed.test_sharded import bytes_read_by_this_process

pytestmark = pytest.mark.distributed


@dataclass(frozen=True)
class EpochRun(Run):
    """A :class:`Run` over ``epochs`` epochs of ``steps`` batches each (the same batches every epoch)."""

    epochs: int = 2
    checkpoint_callback: bool = False
    # Negative control: resume the weights but not the optimizer state.
    skip_optimizer_restore: bool = False
    # Negative control: a tied parameter's second copy does not look up its first name's state.
    no_tie_alias: bool = False
    # Save one gathered file instead of a sharded directory.
    gathered: bool = False

    def trainer_kwargs(self) -> dict[str, Any]:
        return {
            **super().trainer_kwargs(),
            "max_epochs": self.epochs,
            "enable_checkpointing": self.checkpoint_callback,
        }


class WeightsOnlyResume(DynMoStrategy):
    """Negative control: resumes parameters but leaves the optimizer state empty."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass


class NoAliasResume(DynMoStrategy):
    """Negative control: a tie's second copy does not look up the state saved under its first name."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        full = full_state_from_checkpoint(checkpoint, with_optimizer=True)
        load_local_state(full, self._local_units(), list(self.optimizers))


def ckpt_worker(rank: int, world_size: int, run: EpochRun, ckpt: Path, resume: bool) -> dict[str, Any]:
    """Train ``run``; without ``resume`` save ``ckpt`` at the end, with it start from ``ckpt``."""
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    recorder = fitting.LossRecorder()
    callbacks: list[pl.Callback] = [recorder, fitting.ForcePlacement(dict(run.migrations))]
    if run.checkpoint_callback:
        callbacks.append(ModelCheckpoint(dirpath=ckpt.parent, filename=ckpt.stem, save_top_k=1))
    cls = (
        WeightsOnlyResume
        if run.skip_optimizer_restore
        else NoAliasResume
        if run.no_tie_alias
        else DynMoStrategy
    )
    strategy = make_strategy(run, strategy_cls=cls, save_distributed_checkpoint=not run.gathered)
    reads: list[int] = []
    load = strategy.load_checkpoint

    def counted_load(path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        before = bytes_read_by_this_process()
        loaded = load(path, weights_only=weights_only)
        reads.append(bytes_read_by_this_process() - before)
        return loaded

    strategy.load_checkpoint = counted_load  # type: ignore[method-assign]
    trainer = pl.Trainer(
        devices=world_size,
        strategy=strategy,
        use_distributed_sampler=run.use_sampler,
        callbacks=callbacks,
        **run.trainer_kwargs(),
    )
    model = run.model()
    trainer.fit(model, run.datamodule(), ckpt_path=ckpt if resume else None)
    if not resume and not run.checkpoint_callback:
        trainer.save_checkpoint(ckpt)
    return {
        "losses": recorder.losses,
        "state": local_state(model),
        "released": strategy.is_released,
        "placement": str(strategy.placement),
        "units": [] if strategy.is_released else sorted(strategy._local_units()),
        "bytes_read": reads[0] if reads else None,
    }


def train(run: EpochRun, tmp_path: Path, ckpt: Path, resume: bool) -> list[dict[str, Any]]:
    return run_distributed(ckpt_worker, run.world_size, tmp_path, timeout_s=120, args=(run, ckpt, resume))


def whole_checkpoint(ckpt: Path, tmp_path: Path) -> dict[str, Any]:
    """The checkpoint as one dict, whatever its form (a sharded directory is exported first)."""
    if ckpt.is_dir():
        ckpt = export_full_checkpoint(ckpt, tmp_path / f"{ckpt.stem}-export.ckpt")
    return torch.load(ckpt, weights_only=False)  # type: ignore[no-any-return]


def share_of(ckpt: Path, units: Sequence[str]) -> int:
    """Bytes of a sharded checkpoint's items that a rank owning ``units`` needs, plus the three small
    files every rank reads whole."""
    mine, total = set(units), 0
    for _file, _offset, length, _crc, key in json.loads((ckpt / MANIFEST_FILENAME).read_text())["items"]:
        section, _, rest = key.partition(".")
        if section == "state_dict":
            total += length if unit_of_key(rest) in mine else 0
        elif ".param_group_of." in key:
            total += length if key.rpartition(".param_group_of.")[2] in mine else 0
        elif ".state." in key:
            total += length if unit_of_key(key.partition(".state.")[2]) in mine else 0
        else:
            total += length  # param_groups
    return total + sum((ckpt / f).stat().st_size for f in (".metadata", "meta.pt", MANIFEST_FILENAME))


def assert_reads_only_its_share(resumed: list[dict[str, Any]], ckpt: Path) -> None:
    for rank, res in enumerate(resumed):
        share = share_of(ckpt, res["units"])
        # The few bytes over the share are collective messages.
        assert share <= res["bytes_read"] <= share + 16 * 1024, (
            f"rank {rank} read {res['bytes_read']} bytes for a share of {share}"
        )


def assert_continues_exactly(resumed: list[dict[str, Any]], run: EpochRun) -> None:
    ref = reference(replace(run, epochs=2, migrations=(), checkpoint_callback=False))
    expected = ref["losses"][run.steps :]
    assert len(expected) == run.steps
    active = [res for res in resumed if not res["released"]]
    for res in active:
        assert len(res["losses"]) == run.steps, "the resumed run must train exactly the second epoch"
        diff = max(abs(a - b) for a, b in zip(res["losses"], expected, strict=True))
        assert diff < TOL, f"resumed losses differ from the uninterrupted run by {diff:.3e}"
    worst = max_param_diff(active, ref)
    assert worst < TOL, f"final parameters differ from the uninterrupted run by {worst:.3e}"


SAVE_RUN = EpochRun(num_layers=6, placement="0-2|3-5", steps=4, epochs=1, checkpoint_callback=True)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Epoch 1 trained on 2 stages at "0-2|3-5", saved by ModelCheckpoint at the epoch's end."""
    tmp = tmp_path_factory.mktemp("saved")
    ckpt = tmp / "epoch1.ckpt"
    train(SAVE_RUN, tmp, ckpt, resume=False)
    assert ckpt.exists()
    return ckpt


def test_checkpoint_exports_to_the_whole_single_process_model(saved_checkpoint: Path, tmp_path: Path) -> None:
    assert saved_checkpoint.is_dir()  # the default: a sharded directory, written by ModelCheckpoint
    ckpt = whole_checkpoint(saved_checkpoint, tmp_path)
    assert ckpt["dynmo"]["placement"] == "0-2|3-5" and ckpt["dynmo"]["pipeline_size"] == 2
    # Plain single-device Lightning/torch loads the weights: keys equal the single-process model's.
    model = DemoGPT(num_layers=6, lr_gamma=0.9).double()  # the run trained in 64-true precision
    model.load_state_dict(ckpt["state_dict"], strict=True)
    ref = reference(replace(SAVE_RUN, checkpoint_callback=False))
    worst = max((model.state_dict()[k] - v).abs().max().item() for k, v in ref["state"].items())
    assert worst < TOL
    # Optimizer state is keyed by parameter name, for every parameter of every stage.
    (opt,) = ckpt["optimizer_states"]
    assert set(opt["state"]) == {name for name, _ in model.named_parameters()}
    assert all(s["step"].item() == SAVE_RUN.steps for s in opt["state"].values())


@pytest.mark.parametrize(
    ("world_size", "pipeline_size", "placement"),
    [(2, None, "0-4|5-5"), (2, None, "0-2|3-5"), (1, None, "0-5"), (4, 2, "0-1|2-5")],
)
def test_resume_at_another_placement_or_size_continues_exactly_reading_only_each_ranks_share(
    world_size: int, pipeline_size: int | None, placement: str, saved_checkpoint: Path, tmp_path: Path
) -> None:
    # (4, 2): two data-parallel replicas, each rank reading its stage's share (the replicas see the same
    # batches here, so the reference is unchanged).
    run = replace(
        SAVE_RUN,
        world_size=world_size,
        pipeline_size=pipeline_size,
        placement=placement,
        epochs=2,
        checkpoint_callback=False,
    )
    resumed = train(run, tmp_path, saved_checkpoint, resume=True)
    assert all(res["placement"] == placement for res in resumed)
    assert_continues_exactly(resumed, run)
    assert_reads_only_its_share(resumed, saved_checkpoint)


def test_a_gathered_file_resumes_exactly_but_every_rank_reads_all_of_it(
    saved_checkpoint: Path, tmp_path: Path
) -> None:
    # The exported file is what save_distributed_checkpoint=False writes; it is also the negative control
    # of the share measurement above.
    ckpt = export_full_checkpoint(saved_checkpoint, tmp_path / "gathered.ckpt")
    run = replace(SAVE_RUN, placement="0-4|5-5", epochs=2, checkpoint_callback=False)
    resumed = train(run, tmp_path, ckpt, resume=True)
    assert_continues_exactly(resumed, run)
    assert all(res["bytes_read"] >= ckpt.stat().st_size for res in resumed)
    with pytest.raises(AssertionError, match=r"rank \d read"):
        assert_reads_only_its_share(resumed, saved_checkpoint)


def test_a_damaged_checkpoint_stops_every_rank_naming_the_file_and_entry(
    saved_checkpoint: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "damaged.ckpt"
    shutil.copytree(saved_checkpoint, ckpt)
    items = json.loads((ckpt / MANIFEST_FILENAME).read_text())["items"]
    moment = "layers.5.mlp.fc_in.weight.exp_avg"
    file, offset, length, _, key = next(i for i in items if i[4].endswith(moment))
    with open(ckpt / file, "r+b") as f:
        f.seek(offset + length // 2)
        f.write(b"\xff" * 64)
    run = replace(SAVE_RUN, placement="0-4|5-5", epochs=2, checkpoint_callback=False)
    with pytest.raises(
        AssertionError,
        match=rf"(?s)2 of 2 rank\(s\) failed.*{file}' is damaged: entry '{key}'.*{file}' is damaged",
    ):
        train(run, tmp_path, ckpt, resume=True)


def test_resume_after_a_repack_continues_exactly(tmp_path: Path) -> None:
    # 4 stages, re-packed to 2 at batch 2 of epoch 1 (ranks 2 and 3 leave), saved at the end of epoch 1
    # by trainer.save_checkpoint on every rank (a no-op on the released ones); resumed on 2 ranks.
    ckpt = tmp_path / "after_repack.ckpt"
    first = EpochRun(
        world_size=4,
        num_layers=8,
        placement="0-1|2-3|4-5|6-7",
        migrations=((2, "0-2|3-7"),),
        steps=4,
        epochs=1,
    )
    saved = train(first, tmp_path, ckpt, resume=False)
    assert [res["released"] for res in saved] == [False, False, True, True]
    # Written by the two active ranks only (over their group); the released ones did nothing.
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert whole_checkpoint(ckpt, tmp_path)["dynmo"]["placement"] == "0-2|3-7"
    run = replace(first, world_size=2, placement="0-3|4-7", migrations=(), epochs=2)
    assert_continues_exactly(train(run, tmp_path, ckpt, resume=True), run)


def test_resume_without_optimizer_state_is_detected(saved_checkpoint: Path, tmp_path: Path) -> None:
    # The exactness check above must be able to fail: without the saved AdamW moments it does.
    run = replace(
        SAVE_RUN, placement="0-4|5-5", epochs=2, checkpoint_callback=False, skip_optimizer_restore=True
    )
    with pytest.raises(AssertionError, match="resumed losses differ from the uninterrupted run"):
        assert_continues_exactly(train(run, tmp_path, saved_checkpoint, resume=True), run)


@pytest.mark.parametrize(("saved_on", "resumed_on"), [(1, 2), (2, 1)])
def test_a_tied_embedding_resumes_exactly_across_pipeline_sizes(
    saved_on: int, resumed_on: int, tmp_path: Path
) -> None:
    # One process saves the tie's Adam state once, as tok_emb.weight; two ranks save both copies (here in
    # one gathered file).
    ckpt = tmp_path / "tied.ckpt"
    placements = {1: "0-5", 2: "0-2|3-5"}
    first = EpochRun(
        world_size=saved_on,
        num_layers=6,
        placement=placements[saved_on],
        steps=4,
        epochs=1,
        tie_embeddings=True,
        gathered=saved_on == 2,
    )
    train(first, tmp_path, ckpt, resume=False)
    assert ckpt.is_file() == (saved_on == 2)
    saved = whole_checkpoint(ckpt, tmp_path)["optimizer_states"][0]["state"]
    assert ("head.weight" in saved) == (saved_on == 2)
    run = replace(first, world_size=resumed_on, placement=placements[resumed_on], epochs=2)
    assert_continues_exactly(train(run, tmp_path, ckpt, resume=True), run)
    if saved_on == 1:
        unaliased = train(replace(run, no_tie_alias=True), tmp_path, ckpt, resume=True)
        with pytest.raises(AssertionError, match=r"differ from the uninterrupted run"):
            assert_continues_exactly(unaliased, run)
