"""Layer freezing in one process: settings, the AutoFreeze decision, frozen layers, events, bad input."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dynmo.demos import RandomTokenDataModule
from lightning_dynmo.dynamism.freezing import (
    FROZEN_BUFFER,
    FreezingConfig,
    FreezingScope,
    LayerFreezer,
    is_frozen,
)
from lightning_dynmo.dynamism_callbacks import FreezingCallback
from lightning_dynmo.events import DynamismEvent, EventBus
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig
from tests.quiet_trainer import quiet_trainer


def blocks(num: int = 4) -> dict[int, nn.Module]:
    torch.manual_seed(0)
    return {i: nn.Sequential(nn.Linear(3, 3), nn.ReLU()) for i in range(num)}


def scope_of(layers: dict[int, nn.Module], **kwargs: Any) -> FreezingScope:
    return FreezingScope(layers=layers, num_layers=len(layers), **kwargs)


def set_norms(layers: dict[int, nn.Module], previous: list[float], current: list[float]) -> None:
    for i, block in layers.items():
        block.dynmo_grad_norm_previous.fill_(previous[i])
        block.dynmo_grad_norm.fill_(current[i])


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"criterion": "magic"}, r"criterion='magic' must be one of"),
        ({"check_every": 0}, r"check_every=0 must be an integer >= 1"),
        ({"check_every": True}, r"check_every=True must be an integer >= 1"),
        ({"percentile": 0.0}, r"percentile=0.0 must be in \(0, 100\]"),
        ({"percentile": 150}, r"percentile=150 must be in \(0, 100\]"),
        ({"criterion": "schedule"}, r"schedule=\(\) is empty but criterion='schedule'"),
        ({"schedule": ((10, 2), (5, 3))}, r"entry \(5, 3\) must be a pair .* strictly increasing"),
        ({"schedule": ((10, 2), (20, 2))}, r"entry \(20, 2\) must be a pair"),
        ({"schedule": ((-1, 2),)}, r"entry \(-1, 2\) must be a pair"),
        ({"schedule": ((3, 0),)}, r"entry \(3, 0\) must be a pair"),
        ({"schedule": ((3, 1, 2),)}, r"entry \(3, 1, 2\) must be a pair"),
        ({"max_frozen": -1}, r"max_frozen=-1 must be an integer >= 0 or None"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FreezingConfig(**kwargs)


def test_freezing_a_layer_that_does_not_exist_is_refused() -> None:
    layers = blocks(4)
    freezer = LayerFreezer()
    with pytest.raises(ValueError, match=r"freeze_through\(layer=4\): the model has blocks 0 \.\. 3"):
        freezer.freeze_through(4, scope_of(layers))
    with pytest.raises(ValueError, match=r"unfreeze_from\(layer=-1\): the model has blocks 0 \.\. 3"):
        freezer.unfreeze_from(-1, scope_of(layers))
    scheduled = LayerFreezer(FreezingConfig(criterion="schedule", schedule=((3, 5),)))
    with pytest.raises(ValueError, match=r"freezes 5 blocks at step 3 but the model has 4"):
        scheduled.step(3, scope_of(layers))
    too_many = LayerFreezer(FreezingConfig(max_frozen=9))
    with pytest.raises(ValueError, match=r"max_frozen=9 exceeds the model's 4 blocks"):
        too_many.step(50, scope_of(layers))


# -- decisions ------------------------------------------------------------------------------------


def test_autofreeze_freezes_the_prefix_up_to_the_first_layer_still_changing() -> None:
    layers, bus, seen = blocks(5), EventBus(), []
    bus.subscribe(seen.append)
    freezer = LayerFreezer(FreezingConfig(check_every=10), event_bus=bus)
    freezer.prepare(layers)
    assert freezer.step(10, scope_of(layers)) is None  # first interval: only the "previous" norms
    # ratios |p - c| / p: 0.1, 0.05, 0.5, 0.02, 0.4 -> median 0.1: layer 0 reaches it, nothing frozen.
    set_norms(layers, [1, 1, 1, 1, 1], [0.9, 0.95, 0.5, 0.98, 0.6])
    assert freezer.step(20, scope_of(layers)) is None
    # ratios 0.01, 0.02, 0.5, 0.03, 0.4 -> median 0.03: layer 2 is the first still changing.
    set_norms(layers, [1, 1, 1, 1, 1], [0.99, 0.98, 0.5, 0.97, 0.6])
    report = freezer.step(30, scope_of(layers))
    assert report is not None and report.num_frozen == 2 and report.threshold == pytest.approx(0.03)
    assert [is_frozen(layers[i]) for i in range(5)] == [True, True, False, False, False]
    assert seen == [DynamismEvent("frozen", (0, 1), 30, "2 frozen (autofreeze)")]
    # The current interval became the previous one; frozen layers' sums are cleared.
    assert float(layers[3].dynmo_grad_norm_previous) == pytest.approx(0.97)
    assert float(layers[3].dynmo_grad_norm) == 0.0 and float(layers[0].dynmo_grad_norm_previous) == 0.0
    # Later decisions only look at trainable layers and never shrink the prefix.
    set_norms(layers, [0, 0, 1, 1, 1], [0, 0, 0.5, 0.99, 0.99])
    assert freezer.step(40, scope_of(layers)) is None
    assert freezer.step(41, scope_of(layers)) is None  # not a check step
    assert freezer.num_frozen == 2


def test_autofreeze_never_freezes_more_than_max_frozen() -> None:
    layers = blocks(4)
    freezer = LayerFreezer(FreezingConfig(check_every=1, percentile=100))
    freezer.prepare(layers)
    set_norms(layers, [1, 1, 1, 1], [1, 1, 1, 0.5])  # only the last layer changes
    report = freezer.step(2, scope_of(layers))
    assert report is not None and report.num_frozen == 3  # the default cap: all but the last
    capped = LayerFreezer(FreezingConfig(check_every=1, percentile=100, max_frozen=1))
    other = blocks(4)
    capped.prepare(other)
    set_norms(other, [1, 1, 1, 1], [1, 1, 1, 0.5])
    assert capped.step(2, scope_of(other)).num_frozen == 1  # type: ignore[union-attr]


def test_schedule_freezes_at_its_steps_and_explicit_unfreeze_is_the_only_way_back() -> None:
    layers, bus, seen = blocks(4), EventBus(), []
    bus.subscribe(seen.append)
    freezer = LayerFreezer(FreezingConfig(criterion="schedule", schedule=((2, 1), (5, 3))), event_bus=bus)
    assert [freezer.step(s, scope_of(layers)) is not None for s in range(7)] == [
        False, False, True, False, False, True, False,
    ]  # fmt: skip
    assert freezer.num_frozen == 3
    assert freezer.freeze_through(1, scope_of(layers)) is None  # already frozen: no-op, never shrinks
    freezer.unfreeze_from(1, scope_of(layers), step=9)
    assert freezer.num_frozen == 1 and [is_frozen(layers[i]) for i in range(4)] == [True, False, False, False]
    assert all(p.requires_grad for p in layers[1].parameters())
    assert [(e.kind, e.layers) for e in seen] == [("frozen", (0,)), ("frozen", (1, 2)), ("unfrozen", (1, 2))]
    assert [r.reason for r in freezer.history] == ["schedule", "schedule", "unfreeze"]


def test_optimizer_state_of_frozen_layers_is_dropped_or_kept() -> None:
    for keep in (False, True):
        layers = blocks(2)
        optimizer = torch.optim.AdamW([p for b in layers.values() for p in b.parameters()])
        sum(b(torch.ones(1, 3)).sum() for b in layers.values()).backward()  # type: ignore[misc]
        optimizer.step()
        freezer = LayerFreezer(FreezingConfig(keep_optimizer_state=keep))
        freezer.freeze_through(0, scope_of(layers, optimizers=[optimizer]))
        kept = [p in optimizer.state for p in layers[0].parameters()]
        assert kept == [keep, keep]
        assert all(p in optimizer.state for p in layers[1].parameters())


def test_flags_are_module_state_reapplied_to_requires_grad() -> None:
    layers = blocks(3)
    LayerFreezer().freeze_through(1, scope_of(layers))
    state = {i: b.state_dict() for i, b in layers.items()}
    assert all(FROZEN_BUFFER in s for s in state.values())
    fresh = blocks(3)
    freezer = LayerFreezer()
    freezer.prepare(fresh)
    for i, block in fresh.items():
        block.load_state_dict(state[i])
    assert all(p.requires_grad for b in fresh.values() for p in b.parameters())  # not yet applied
    freezer.apply_flags(scope_of(fresh))
    assert [all(not p.requires_grad for p in fresh[i].parameters()) for i in range(3)] == [True, True, False]


# -- training -------------------------------------------------------------------------------------


class Snapshots(pl.Callback):
    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.with_grad: list[set[str]] = []
        self.outputs_need_grad: list[tuple[bool, bool]] = []  # of layers 1 and 2, per step
        self._seen: dict[str, bool] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for name in ("1", "2"):
            pl_module.layers[name].register_forward_hook(
                lambda m, i, out, name=name: self._seen.__setitem__(name, out.requires_grad)
            )

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.with_grad.append({n for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.params.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
        self.outputs_need_grad.append((self._seen["1"], self._seen["2"]))


def train(config: FreezingConfig | None, steps: int = 6) -> Snapshots:
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, vocab_size=64),
        OptimizerConfig(lr=1e-2, weight_decay=0.1),
    )
    snapshots = Snapshots()
    callbacks: list[pl.Callback] = [snapshots] + ([FreezingCallback(config)] if config else [])
    trainer = quiet_trainer(max_epochs=1, callbacks=callbacks)
    trainer.fit(model, RandomTokenDataModule(batch_size=4, num_samples=4 * steps, seq_len=16, vocab_size=64))
    return snapshots


def test_frozen_layers_get_no_gradient_and_do_not_change() -> None:
    frozen = ("tok_emb.weight", "pos_emb.weight", "layers.0.attn.qkv.weight", "layers.1.mlp.fc_out.bias")
    run = train(FreezingConfig(criterion="schedule", schedule=((2, 2),)))
    for step in (2, 3, 4, 5):
        assert not set(frozen) & run.with_grad[step]
        assert "layers.2.attn.qkv.weight" in run.with_grad[step]
        assert all(torch.equal(run.params[1][n], run.params[step][n]) for n in frozen)  # not even decay
        assert not torch.equal(
            run.params[1]["layers.2.mlp.fc_in.weight"], run.params[step]["layers.2.mlp.fc_in.weight"]
        )
    # A frozen prefix runs no backward: autograd never enters it (its output needs no gradient).
    assert run.outputs_need_grad == [(True, True)] * 2 + [(False, True)] * 4
    # Negative control: without freezing the same parameters change.
    free = train(None)
    assert not any(torch.equal(free.params[1][n], free.params[5][n]) for n in frozen)


def test_a_tied_embedding_is_not_frozen_with_layer_zero() -> None:
    model = GPT(
        GPTConfig(num_layers=2, d_model=16, num_heads=2, seq_len=16, vocab_size=64, tie_embeddings=True)
    )
    from lightning_dynmo.dynamism_callbacks import freezing_scope

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    scope = freezing_scope(trainer, model)
    assert scope is not None and [type(m) for m in scope.first_parts] == [type(model.pos_emb)]


class UnfreezeAt(pl.Callback):
    """Asks the freezing callback to unfreeze from ``layer`` at the end of batch ``at``."""

    def __init__(self, freezing: FreezingCallback, at: int, layer: int) -> None:
        self.freezing, self.at, self.layer = freezing, at, layer

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        if i == self.at:
            self.freezing.unfreeze_from(self.layer)


def test_callback_unfreezes_only_when_asked_at_the_next_step() -> None:
    model = GPT(GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=16, vocab_size=64))
    freezing = FreezingCallback(FreezingConfig(criterion="schedule", schedule=((1, 3),)))
    trainer = quiet_trainer(max_epochs=1, callbacks=[freezing, UnfreezeAt(freezing, at=2, layer=1)])
    trainer.fit(model, RandomTokenDataModule(batch_size=4, num_samples=16, seq_len=16, vocab_size=64))
    assert [(r.step, r.num_frozen, r.reason) for r in freezing.history] == [
        (1, 3, "schedule"),
        (3, 1, "unfreeze"),
    ]
    assert freezing.num_frozen == 1 and freezing.state_dict()["num_frozen"] == 1
    assert not model.tok_emb.weight.requires_grad and model.layers["1"].attn.qkv.weight.requires_grad


def test_callback_needs_a_model_with_blocks() -> None:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    with pytest.raises(TypeError, match=r"FreezingCallback freezes the blocks .* Linear has no `layers`"):
        FreezingCallback().on_train_batch_start(trainer, nn.Linear(2, 2), None, 0)  # type: ignore[arg-type]
