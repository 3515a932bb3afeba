"""Faults on one rank stop every rank within the timeout, each naming the cause.

- Lost rank: rank 1 of a 2-stage pipeline dies (``os._exit(1)``) or stalls (sleeps far past the timeout)
  at the start of a batch; rank 0, inside its schedule step, fails with DynMo's ``CommunicationError``
  naming its own stage, the peer (stage 1 on global rank 1; one that died, as gone with its pid) and the
  transport error.
- A collective called on one rank only (``apply_placement``, ``strategy.broadcast`` / ``reduce`` from a
  callback, ``trainer.save_checkpoint``): both ranks fail after the strategy's timeout, each naming its
  own call and the call the other rank was in.
- A block raising on one rank: that rank raises the block's own ``ValueError`` (not torch's "failed to
  run forward" wrapper), noting the rank, unit and stage; its peer names that rank and that error. The
  same for an error outside the pipeline (a callback).
- A non-``ValueError`` bug in the rebalance decision on rank 0: rank 0 raises it, the others name it at
  once instead of waiting in the decision's broadcast.
- SIGTERM sent to one rank: every rank stops at the same batch with Lightning's ``SIGTERMException``,
  ``trainer.received_sigterm`` set, and ``ModelCheckpoint(save_on_exception=True)`` saves the whole model.

Every run must end within ``timeout + 30 s``; the errors are checked with ``pytest.raises(match=...)``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

import lightning_dynmo.callback.dynmo_callback
from lightning_dynmo.callback import DynMoCallback, ProfilingConfig
from lightning_dynmo.pipeline.checkpoint.sharded import export_full_checkpoint
from lightning_dynmo.pipeline.faults.guard import CommunicationError
from tests.distributed.fitting import Run, make_strategy
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

_FAIL_AT_BATCH = 3


class Misbehave(pl.Callback):
    """On rank 1, at batch ``_FAIL_AT_BATCH``: die at once, or stall for ``stall_s`` seconds."""

    def __init__(self, mode: str, stall_s: float) -> None:
        self.mode = mode
        self.stall_s = stall_s

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 1 or batch_idx != _FAIL_AT_BATCH:
            return
        if self.mode == "die":
            os._exit(1)
        time.sleep(self.stall_s)


def faulty_worker(rank: int, world_size: int, mode: str, timeout_s: float) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    run = Run(steps=8)
    strategy = make_strategy(run, timeout=timedelta(seconds=timeout_s))
    trainer = pl.Trainer(
        devices=world_size, strategy=strategy, callbacks=[Misbehave(mode, stall_s=60)], **run.trainer_kwargs()
    )
    trainer.fit(run.model(), run.datamodule())


@pytest.mark.parametrize(
    ("mode", "transport_error"),
    [("die", r"Connection (closed|reset) by peer"), ("stall", r"Timed out waiting 4000ms")],
)
def test_survivor_fails_within_the_timeout_naming_the_lost_peer(
    mode: str, transport_error: str, tmp_path: Path
) -> None:
    timeout_s = 4.0
    start = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(faulty_worker, 2, tmp_path, timeout_s=90, args=(mode, timeout_s))
    elapsed = time.monotonic() - start
    report = str(info.value)
    rank0 = report.split("----- rank 0 -----")[1].split("----- rank 1 -----")[0]
    # A dead peer's process is gone (this rank checks its pid, registered on the failure board); a stalled one
    # is not, so only its lost contact is reported.
    gone = ""
    if mode == "die":
        gone = r"rank 1 \(stage 1\) is gone: its process \(pid \d+\) no longer exists .*; so "
    lost = rf"CommunicationError: DynMo: {gone}rank 0 \(stage 0\) lost contact with a peer"
    assert re.search(lost, rank0), rank0[-2000:]
    assert "It exchanges data with: stage 1 on global rank 1." in rank0
    assert re.search(transport_error, rank0), rank0[-2000:]
    assert elapsed < timeout_s + 30, f"the survivor took {elapsed:.1f} s to fail"


# -- one rank misbehaves while the other trains: the worker returns what fit raised ----------------------

_TIMEOUT_S = 4.0
_AT_BATCH = 2


class Tripwire(nn.Module):
    """A block that raises once armed (a plain attribute, set on one rank only)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("boom: layer 3 saw a NaN")
        return self.block(x)  # type: ignore[no-any-return]


class OneRankOnly(pl.Callback):
    """At batch ``_AT_BATCH``, on ``rank`` only: make a collective call, arm a tripwire or send SIGTERM."""

    def __init__(self, action: str, rank: int, tmp_path: Path) -> None:
        self.action, self.rank, self.tmp_path = action, rank, tmp_path

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != self.rank or batch_idx != _AT_BATCH:
            return
        strategy = trainer.strategy
        if self.action == "apply_placement":
            strategy.apply_placement("0-0|1-3")
        elif self.action == "broadcast":
            strategy.broadcast("a decision only rank 0 takes")
        elif self.action == "reduce":
            strategy.reduce(torch.ones(()), reduce_op="sum")
        elif self.action == "save_checkpoint":
            trainer.save_checkpoint(self.tmp_path / "only-rank-0.ckpt")
        elif self.action == "raise":
            strategy.local_layers[3].armed = True
        elif self.action == "raise_in_callback":
            raise ValueError("my callback broke")
        elif self.action.startswith("sigterm"):
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal; its handler runs right here

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.action == "sigterm_in_validation" and trainer.global_rank == self.rank and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def misbehaving_worker(
    rank: int,
    world_size: int,
    action: str,
    culprit: int,
    tmp_path: Path,
    timeout: timedelta | None = timedelta(seconds=_TIMEOUT_S),
    control_timeout: timedelta | None = None,
) -> dict[str, Any]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    run = Run(steps=6)
    model = run.model()
    model.layers["3"] = Tripwire(model.layers["3"])
    callbacks: list[pl.Callback] = [OneRankOnly(action, culprit, tmp_path)]
    kwargs = run.trainer_kwargs()
    if action in ("sigterm", "sigterm_with_callback"):
        kwargs["enable_checkpointing"] = True
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "on-sigterm", save_on_exception=True))
    if action == "sigterm_with_callback":  # the agreement rides the callback's per-step exchange
        callbacks.append(DynMoCallback(every_n_steps=1000))
    val = None
    if action == "sigterm_in_validation":  # validate every 2 training batches, 4 batches each time
        kwargs.update(val_check_interval=2, limit_val_batches=4, num_sanity_val_steps=0)
        val = run.datamodule().train_dataloader()
    if action == "decide":
        lightning_dynmo.callback.dynmo_callback.decide = _buggy_decide  # this forked rank only
        callbacks.append(
            DynMoCallback(every_n_steps=_AT_BATCH, profiling=ProfilingConfig(warmup_steps=0, steps=1))
        )
    # timeout=None: the process groups' default (30 minutes); control_timeout=None: DynMo's default.
    overrides: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if control_timeout is not None:
        overrides["control_timeout"] = control_timeout
    strategy = make_strategy(run, **overrides)
    trainer = pl.Trainer(devices=world_size, strategy=strategy, callbacks=callbacks, **kwargs)
    error: BaseException | None = None
    try:
        if val is None:
            trainer.fit(model, run.datamodule())
        else:
            trainer.fit(model, train_dataloaders=run.datamodule().train_dataloader(), val_dataloaders=val)
    except BaseException as err:  # SIGTERMException is a SystemExit
        error = err
    return {"error": error, "step": trainer.global_step, "sigterm": trainer.received_sigterm}


def _buggy_decide(*args: Any, **kwargs: Any) -> Any:
    raise KeyError("stage 7")


def _run_timed(action: str, culprit: int, tmp_path: Path) -> list[dict[str, Any]]:
    start = time.monotonic()
    results = run_distributed(misbehaving_worker, 2, tmp_path, timeout_s=90, args=(action, culprit, tmp_path))
    elapsed = time.monotonic() - start
    assert elapsed < _TIMEOUT_S + 30, f"the ranks took {elapsed:.1f} s to stop"
    return results


def _reraise(result: dict[str, Any]) -> None:
    assert result["error"] is not None, "fit ended without an error on this rank"
    raise result["error"]


@pytest.mark.parametrize(
    ("action", "call"),
    [
        ("apply_placement", r"apply_placement \(the check that every rank applies the same placement\)"),
        ("broadcast", r"strategy\.broadcast\(src=0\)"),
        ("reduce", r"strategy\.reduce"),
        ("save_checkpoint", r"checkpoint saving \(each rank writing its units\)"),
    ],
)
def test_a_collective_called_on_one_rank_fails_on_both_naming_both_calls(
    action: str, call: str, tmp_path: Path
) -> None:
    rank0, rank1 = _run_timed(action, culprit=0, tmp_path=tmp_path)
    with pytest.raises(
        CommunicationError,
        match=rf"^DynMo: rank 0 \(stage 0\) failed in {call} while rank 1 \(stage 1\) was waiting in a "
        r"schedule step\..* every rank, not under `if trainer.is_global_zero`.* timeout of 4 s",
    ):
        _reraise(rank0)
    with pytest.raises(
        CommunicationError,
        match=rf"^DynMo: rank 1 \(stage 1\) failed in a schedule step while rank 0 \(stage 0\) was "
        rf"waiting in {call}\.",
    ):
        _reraise(rank1)


def test_with_the_groups_default_timeout_apply_placement_on_one_rank_fails_on_both_within_the_control_timeout(
    tmp_path: Path,
) -> None:
    # The process groups keep their default 30-minute timeout; only DynMo's control timeout bounds the
    # wait. It is 8 s here, not its default (DEFAULT_CONTROL_TIMEOUT, which tests/unit/pipeline/
    # test_stall_watch.py checks the strategy resolves to), so that the test waits seconds, not minutes.
    bound_s = 8.0
    start = time.monotonic()
    rank0, rank1 = run_distributed(
        misbehaving_worker,
        2,
        tmp_path,
        timeout_s=bound_s + 120,
        args=("apply_placement", 0, tmp_path, None, timedelta(seconds=bound_s)),
    )
    elapsed = time.monotonic() - start
    # Far below the groups' 30 minutes; the slack is two ranks starting and importing on a loaded 2-core VM.
    assert elapsed < bound_s + 60, f"the ranks took {elapsed:.1f} s to stop"
    with pytest.raises(
        CommunicationError,
        match=r"^DynMo: rank 0 \(stage 0\) failed in apply_placement \(the check that every rank applies the "
        r"same placement\) while rank 1 \(stage 1\) was waiting in a schedule step\..* until DynMo's control "
        rf"timeout of {bound_s:g} s",
    ):
        _reraise(rank0)
    with pytest.raises(
        CommunicationError,
        match=r"^DynMo: rank 1 \(stage 1\) failed in a schedule step while rank 0 \(stage 0\) was waiting in "
        r"apply_placement \(the check that every rank applies the same placement\)\.",
    ):
        _reraise(rank1)


# An error on the culprit rank: (action, culprit, its error there, the error its peer reports).
ONE_RANK_ERRORS = {
    "a block raising in a schedule step": (
        "raise",
        1,
        (
            ValueError,
            r"^boom: layer 3 saw a NaN\n"
            r"DynMo: raised on rank 1 in layers.3 \(stage 1\) during a schedule step",
        ),
        (
            CommunicationError,
            r"^DynMo: rank 1 \(stage 1\) failed first: ValueError: boom: layer 3 saw a NaN "
            r"\(raised in layers.3 during a schedule step\); so rank 0 \(stage 0\) lost contact with a peer "
            r"during a schedule step",
        ),
    ),
    "an error outside the pipeline": (
        "raise_in_callback",
        1,
        (ValueError, r"^my callback broke\nDynMo: raised on rank 1 in stage 1 during Trainer.fit"),
        (
            CommunicationError,
            r"^DynMo: rank 1 \(stage 1\) failed first: ValueError: my callback broke \(raised during "
            r"Trainer.fit\); so rank 0 \(stage 0\) lost contact with a peer during a schedule step",
        ),
    ),
    "a bug in the rebalance decision": (
        "decide",
        0,
        (KeyError, r"stage 7'\nDynMo: raised on rank 0 during the rebalance decision at step"),
        (
            RuntimeError,
            r"^DynMo: rank 0 failed while computing the rebalance decision at step \d+: "
            r"KeyError: 'stage 7'",
        ),
    ),
}


@pytest.mark.parametrize("case", list(ONE_RANK_ERRORS), ids=list(ONE_RANK_ERRORS))
def test_an_error_on_one_rank_is_reported_there_as_itself_and_named_by_its_peer(
    case: str, tmp_path: Path
) -> None:
    action, culprit, (own_type, own_match), (peer_type, peer_match) = ONE_RANK_ERRORS[case]
    results = _run_timed(action, culprit=culprit, tmp_path=tmp_path)
    with pytest.raises(own_type, match=own_match):
        _reraise(results[culprit])
    with pytest.raises(peer_type, match=peer_match):
        _reraise(results[1 - culprit])


@pytest.mark.parametrize(
    ("action", "signalled"), [("sigterm", 0), ("sigterm", 1), ("sigterm_with_callback", 1)]
)
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_batch_and_checkpoints(
    action: str, signalled: int, tmp_path: Path
) -> None:
    results = _run_timed(action, culprit=signalled, tmp_path=tmp_path)
    for result in results:
        with pytest.raises(SIGTERMException):
            _reraise(result)
        assert result["sigterm"] is True
    # The signal arrives at batch 2's start, after the batch's agreement: every rank stops at the next one.
    assert [r["step"] for r in results] == [_AT_BATCH + 1] * 2
    (saved,) = (tmp_path / "on-sigterm").iterdir()  # a sharded checkpoint directory (the default)
    checkpoint = torch.load(export_full_checkpoint(saved, tmp_path / "whole.ckpt"), weights_only=False)
    assert checkpoint["global_step"] == _AT_BATCH + 1
    layers = {k.split(".")[1] for k in checkpoint["state_dict"] if k.startswith("layers.")}
    assert layers == {"0", "1", "2", "3"}  # the whole model, written by both stages


def test_sigterm_during_validation_stops_every_rank_in_the_same_validation_batch(tmp_path: Path) -> None:
    results = _run_timed("sigterm_in_validation", culprit=1, tmp_path=tmp_path)
    for result in results:
        with pytest.raises(SIGTERMException):
            _reraise(result)
        assert result["sigterm"] is True
    assert [r["step"] for r in results] == [2, 2]  # in the first validation, after two training steps


class CountCollectives(pl.Callback):
    """Counts collective calls from batch 1's start to batch 4's (three boundaries)."""

    def __init__(self) -> None:
        self.calls = {"all_reduce": 0, "all_gather": 0, "gather": 0, "broadcast": 0}
        self._real: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            for name in self.calls:
                self._real[name] = real = getattr(torch.distributed, name)
                setattr(torch.distributed, name, self._counting(name, real))
        elif batch_idx == 4:
            for name, real in self._real.items():
                setattr(torch.distributed, name, real)

    def _counting(self, name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return real(*args, **kwargs)

        return call


def collectives_worker(rank: int, world_size: int, with_callback: bool) -> dict[str, int]:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    run = Run(steps=6)
    counter = CountCollectives()
    callbacks: list[pl.Callback] = [counter] + ([DynMoCallback(every_n_steps=1000)] if with_callback else [])
    trainer = pl.Trainer(
        devices=world_size, strategy=make_strategy(run), callbacks=callbacks, **run.trainer_kwargs()
    )
    trainer.fit(run.model(), run.datamodule())
    return counter.calls


def test_an_idle_callback_adds_no_collective_per_step_the_sigterm_agreement_rides_its_exchange(
    tmp_path: Path,
) -> None:
    (alone, _) = run_distributed(collectives_worker, 2, tmp_path, timeout_s=90, args=(False,))
    (with_callback, _) = run_distributed(collectives_worker, 2, tmp_path, timeout_s=90, args=(True,))
    # Control: without the callback each of the three batch starts makes its own SIGTERM all-reduce.
    assert alone["all_reduce"] >= 3 and alone["all_gather"] == alone["gather"] == alone["broadcast"] == 0
    # With it, each step's exchange (on gloo a gather on the first rank and its broadcast, one round trip
    # like the all-reduce) carries the flag and the batch starts make none.
    assert with_callback == {
        "all_reduce": alone["all_reduce"] - 3,
        "all_gather": 0,
        "gather": 3,
        "broadcast": 3,
    }
