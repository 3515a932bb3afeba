"""check_trainer_setup refuses what DynMoStrategy cannot honour, naming the flag and the alternative."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    EMAWeightAveraging,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import (
    DeepSpeedPrecision,
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)

from lightning_dynmo.demos import DemoGPT
from lightning_dynmo.strategy.trainer_checks import batch_fingerprint, check_trainer_setup


def _check(module: Any = None, precision: Any = None, layer_sync: Any = None, callbacks: Any = ()) -> None:
    check_trainer_setup(
        module if module is not None else DemoGPT(num_layers=2),
        precision if precision is not None else Precision(),
        layer_sync,
        list(callbacks),
        fitting=True,
    )


def test_supported_setups_pass() -> None:
    for precision in (
        Precision(),
        DoublePrecision(),
        HalfPrecision("bf16-true"),
        MixedPrecision("bf16-mixed", "cpu"),
        MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")),
    ):
        _check(precision=precision, callbacks=[EarlyStopping(monitor="val_loss")])


def test_manual_optimization_is_refused_for_fit_only() -> None:
    module = DemoGPT(num_layers=2)
    module.automatic_optimization = False
    with pytest.raises(
        ValueError, match=r"DemoGPT.automatic_optimization is False .* Use automatic optimization"
    ):
        _check(module)
    # Validate / test / predict run: training-only flags and callbacks do not matter there.
    check_trainer_setup(module, Precision(), TorchSyncBatchNorm(), [ModelPruning("l1_unstructured")], False)
    with pytest.raises(ValueError, match=r"FSDPPrecision cannot be used"):
        check_trainer_setup(module, FSDPPrecision("bf16-mixed"), None, [], fitting=False)


def test_sync_batchnorm_is_refused() -> None:
    match = r"Trainer\(sync_batchnorm=True\) .* Use Trainer\(sync_batchnorm=False\)"
    with pytest.raises(ValueError, match=match):
        _check(layer_sync=TorchSyncBatchNorm())


@pytest.mark.parametrize(
    ("precision", "match"),
    [
        (FSDPPrecision("bf16-mixed"), r"FSDPPrecision cannot be used with DynMoStrategy: it belongs to FSDP"),
        (DeepSpeedPrecision("32-true"), r"DeepSpeedPrecision cannot be used .* Use Trainer\(precision="),
    ],
)
def test_other_strategies_precision_plugins_are_refused(precision: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _check(precision=precision)


@pytest.mark.parametrize(
    ("callback", "match"),
    [
        (StochasticWeightAveraging(swa_lrs=1e-2), r"StochasticWeightAveraging cannot be used .* copy of the"),
        (EMAWeightAveraging(), r"EMAWeightAveraging cannot be used .* a migration makes stale"),
        (ModelPruning("l1_unstructured"), r"ModelPruning cannot be used .* forward pre-hooks"),
    ],
)
def test_callbacks_that_copy_or_prune_the_model_are_refused(callback: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _check(callbacks=[callback])


def test_batch_fingerprint_tells_batches_apart() -> None:
    tokens = torch.arange(24).reshape(4, 6)
    assert batch_fingerprint(tokens) == batch_fingerprint(tokens.clone())
    assert batch_fingerprint({"x": tokens, "y": [tokens]}) == batch_fingerprint({"x": tokens, "y": [tokens]})
    assert batch_fingerprint(tokens) != batch_fingerprint(tokens.flip(0))  # same rows, other order
    assert batch_fingerprint(tokens) != batch_fingerprint(tokens + 1)
    assert batch_fingerprint("no tensors") == 0
