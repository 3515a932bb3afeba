"""GlobalMagnitudePruner in one process: exact global top-k with ties in global order, no regrowth through
AdamW, events, kernel choice, bad settings."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_dynmo.dynamism import pruning as pruning_module
from lightning_dynmo.dynamism.magnitude_select import num_to_prune, select_global_pruning
from lightning_dynmo.dynamism.pruning import (
    GlobalMagnitudePruner,
    PruningConfig,
    PruningReport,
    PruningScope,
    prunable_linears,
    pruning_gpt_config,
)
from lightning_dynmo.dynamism.pruning_schedule import PruningSchedule
from lightning_dynmo.dynamism.sparse_linear import MaskedLinear
from lightning_dynmo.events import DynamismEvent, EventBus
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig

# Single-threaded (conftest.py): small matrices are much faster so on a shared 2-core machine.
pytestmark = pytest.mark.usefixtures("one_thread")


CONFIG = GPTConfig(num_layers=4, d_model=16, num_heads=2, seq_len=8, vocab_size=32)


def tiny_gpt(quantize: float | None = None) -> GPT:
    """A float64 GPT whose block weights are rounded to multiples of ``quantize`` (many exact ties)."""
    model = GPT(CONFIG, OptimizerConfig(lr=1e-2, weight_decay=0.1)).double()
    GlobalMagnitudePruner.prepare(blocks(model))
    if quantize is not None:
        with torch.no_grad():
            for _, _, m in prunable_linears(blocks(model)):
                m.weight.copy_(torch.round(m.weight / quantize) * quantize)
    return model


def blocks(model: GPT) -> dict[int, Any]:
    return {int(k): m for k, m in model.layers.items()}


def brute_force_masks(model: GPT, sparsity: float) -> list[torch.Tensor]:
    """The single-process global top-k: a stable sort of every magnitude in global order (pruned first)."""
    linears = prunable_linears(blocks(model))
    keys = torch.cat(
        [torch.where(m.weight_mask, m.weight.detach().abs(), -1.0).reshape(-1) for _, _, m in linears]
    )
    k = num_to_prune(sparsity, keys.numel())
    keep = torch.ones(keys.numel(), dtype=torch.bool)
    keep[torch.sort(keys, stable=True).indices[:k]] = False
    return list(keep.split([m.weight.numel() for _, _, m in linears]))


def masks_of(model: GPT) -> list[torch.Tensor]:
    return [m.weight_mask.reshape(-1).clone() for _, _, m in prunable_linears(blocks(model))]


@pytest.mark.parametrize("quantize", [None, 2e-3])
def test_one_process_keeps_exactly_the_global_top_k(quantize: float | None) -> None:
    model = tiny_gpt(quantize)
    pruner = GlobalMagnitudePruner(PruningConfig(kernel="dense"), event_bus=EventBus())
    for sparsity in (0.3, 0.55, 0.9):
        expected = brute_force_masks(model, sparsity)
        report = pruner.prune_to(sparsity, PruningScope(blocks(model), CONFIG.num_layers))
        for got, want in zip(masks_of(model), expected, strict=True):
            assert torch.equal(got, want)
        assert report.num_pruned == num_to_prune(sparsity, report.num_prunable)
        assert abs(report.sparsity - sparsity) <= 0.5 / report.num_prunable
    if quantize is not None:  # the ties were real: the threshold value is held by kept weights too
        threshold = pruner.history[-1].threshold
        kept = torch.cat([m.weight[m.weight_mask].abs() for _, _, m in prunable_linears(blocks(model))])
        assert threshold is not None and (kept == threshold).any()


def test_ties_are_broken_by_layer_then_module_then_position() -> None:
    model = tiny_gpt()
    with torch.no_grad():
        for _, _, m in prunable_linears(blocks(model)):
            m.weight.fill_(0.5)  # every weight ties
    k = num_to_prune(0.25, sum(m.weight.numel() for _, _, m in prunable_linears(blocks(model))))
    GlobalMagnitudePruner(PruningConfig(kernel="dense"), event_bus=EventBus()).prune_to(
        0.25, PruningScope(blocks(model), CONFIG.num_layers)
    )
    flat = torch.cat(masks_of(model))
    assert (~flat[:k]).all() and flat[k:].all()  # the first k entries in global order, nothing else


def test_a_local_top_k_is_not_the_global_one() -> None:
    # Negative control for the tests above: per-layer pruning (what each rank would do alone) differs.
    model = tiny_gpt()
    expected = brute_force_masks(model, 0.5)
    for index, block in blocks(model).items():
        GlobalMagnitudePruner(PruningConfig(kernel="dense"), event_bus=EventBus()).prune_to(
            0.5, PruningScope({index: block}, CONFIG.num_layers)
        )
    assert any(not torch.equal(a, b) for a, b in zip(masks_of(model), expected, strict=True))


def train_steps(model: GPT, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1), generator=gen)
        optimizer.zero_grad()
        model._loss(batch).backward()
        optimizer.step()


class KeepsMoments(GlobalMagnitudePruner):
    """Negative control: prunes but leaves AdamW's moments of the pruned entries alone."""

    def _zero_optimizer_state(self, module: MaskedLinear, optimizers: Any) -> None:
        pass


@pytest.mark.parametrize("kernel", ["dense", "csr"])
def test_pruned_weights_stay_exactly_zero_through_adamw_steps(kernel: str) -> None:
    def pruned_after(pruner_cls: type[GlobalMagnitudePruner]) -> list[torch.Tensor]:
        model = tiny_gpt()
        optimizer = model.configure_optimizers()
        train_steps(model, optimizer, 3)  # Adam moments are non-zero everywhere now
        pruner = pruner_cls(PruningConfig(kernel=kernel), event_bus=EventBus())
        pruner.prune_to(0.6, PruningScope(blocks(model), CONFIG.num_layers, optimizers=[optimizer]))
        train_steps(model, optimizer, 20)
        return [m.weight[~m.weight_mask] for _, _, m in prunable_linears(blocks(model))]

    assert all((values == 0).all() for values in pruned_after(GlobalMagnitudePruner))
    # Negative control: the moments left from before pruning move "pruned" weights away from zero.
    regrown = max(values.abs().max().item() for values in pruned_after(KeepsMoments))
    assert regrown > 1e-4


def test_the_optimizer_state_of_pruned_entries_is_zeroed() -> None:
    model = tiny_gpt()
    optimizer = model.configure_optimizers()
    train_steps(model, optimizer, 2)
    GlobalMagnitudePruner(PruningConfig(kernel="dense"), event_bus=EventBus()).prune_to(
        0.5, PruningScope(blocks(model), CONFIG.num_layers, optimizers=[optimizer])
    )
    for _, _, m in prunable_linears(blocks(model)):
        state = optimizer.state[m.weight]
        for name in ("exp_avg", "exp_avg_sq"):
            assert (state[name][~m.weight_mask] == 0).all() and (state[name][m.weight_mask] != 0).any()


def test_each_pruning_step_publishes_an_event_with_the_changed_layers() -> None:
    bus, seen = EventBus(), []
    bus.subscribe(seen.append)
    model = tiny_gpt()
    schedule = PruningSchedule(final_sparsity=0.5, start_step=2, frequency=3, num_steps=2)
    pruner = GlobalMagnitudePruner(PruningConfig(schedule=schedule, kernel="dense"), event_bus=bus)
    scope = PruningScope(blocks(model), CONFIG.num_layers)
    reports = {step: pruner.step(step, scope) for step in range(10)}
    assert [s for s, r in reports.items() if r is not None] == [2, 5, 8]
    assert reports[2] is not None and reports[2].num_pruned == 0  # s_i = 0: nothing to prune, no event
    assert [(e.kind, e.layers, e.step) for e in seen] == [
        ("pruned", (0, 1, 2, 3), 5),
        ("pruned", (0, 1, 2, 3), 8),
    ]
    assert isinstance(seen[0], DynamismEvent) and "global sparsity 0.4375" in seen[0].detail
    assert pruner.history[-1].sparsity == pytest.approx(0.5, abs=1e-4)
    # Lower targets never revive weights: nothing changes, no event.
    before = masks_of(model)
    report = pruner.prune_to(0.2, scope)
    assert report.changed_layers == () and len(seen) == 2
    assert all(torch.equal(a, b) for a, b in zip(masks_of(model), before, strict=True))
    restored = GlobalMagnitudePruner()
    restored.load_state_dict(pruner.state_dict())
    assert restored.history == pruner.history
    assert PruningReport.from_dict(pruner.history[1].to_dict()) == pruner.history[1]


def test_auto_kernels_follow_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[int, int]] = []

    def fake_time(layer: MaskedLinear, rows: int, **kwargs: Any) -> dict[str, float]:
        timed.append((layer.out_features, rows))
        faster = layer.out_features == 4 * CONFIG.d_model  # only fc_in's CSR is 2x faster
        return {"dense": 2.0 if faster else 1.0, "csr": 1.0}

    monkeypatch.setattr(pruning_module, "time_kernels", fake_time)
    model = tiny_gpt()
    model(torch.zeros(3, CONFIG.seq_len, dtype=torch.long))  # rows seen: 3 * seq_len
    config = PruningConfig(kernel="auto", csr_min_sparsity=0.3, csr_min_speedup=1.5)
    pruner = GlobalMagnitudePruner(config, event_bus=EventBus())
    report = pruner.prune_to(0.5, PruningScope(blocks(model), CONFIG.num_layers))
    for k in report.kernels:
        if k.sparsity < 0.3:
            assert k.kernel == "dense" and k.dense_s is None
        else:
            assert k.kernel == ("csr" if k.name.endswith("fc_in") else "dense") and k.dense_s is not None
    assert {rows for _, rows in timed} == {3 * CONFIG.seq_len}
    for _, name, module in prunable_linears(blocks(model)):
        assert module.kernel == next(k.kernel for k in report.kernels if k.name == name)


def test_forced_kernels() -> None:
    model = tiny_gpt()
    report = GlobalMagnitudePruner(PruningConfig(kernel="csr"), event_bus=EventBus()).prune_to(
        0.5, PruningScope(blocks(model), CONFIG.num_layers)
    )
    assert {k.kernel for k in report.kernels} == {"csr"} and len(report.kernels) == 16


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"kernel": "triton"},
            r"kernel='triton' must be one of \('auto', 'dense', 'csr', 'bsr', 'semi_structured'\)",
        ),
        (
            {"pattern": "1:4"},
            r"PruningConfig.pattern='1:4' must be one of \('unstructured', '2:4', 'block'\)",
        ),
        (
            {"kernel": "bsr"},
            r"PruningConfig.kernel='bsr' multiplies 'block' masks only, but pattern='unstructured'",
        ),
        (
            {"kernel": "semi_structured", "pattern": "block"},
            r"kernel='semi_structured' multiplies '2:4' masks only, but pattern='block'",
        ),
        ({"pattern": "2:4"}, r"pattern='2:4' prunes at most 2 of every 4 weights, but .* final_sparsity=0.9"),
        ({"block_size": 0}, r"block_size=0 must be an integer >= 1"),
        ({"schedule": 0.9}, r"PruningConfig.schedule=0.9 must be a PruningSchedule"),
        ({"csr_min_sparsity": 1.5}, r"csr_min_sparsity=1.5 must be in \[0, 1\]"),
        ({"csr_min_speedup": 0}, r"csr_min_speedup=0 must be > 0"),
        ({"timing_repeats": 0}, r"timing_repeats=0 must be an integer >= 1"),
        ({"timing_rows": 0}, r"timing_rows=0 must be an integer >= 1"),
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        PruningConfig(**kwargs)


@pytest.mark.parametrize("sparsity", [1.0, -0.5, 1.2])
def test_a_sparsity_outside_0_1_is_refused(sparsity: float) -> None:
    model = tiny_gpt()
    pruner = GlobalMagnitudePruner(event_bus=EventBus())
    with pytest.raises(ValueError, match=rf"sparsity={sparsity} must be a fraction in \[0, 1\)"):
        pruner.prune_to(sparsity, PruningScope(blocks(model), CONFIG.num_layers))


def test_selection_refuses_bad_weights() -> None:
    model = tiny_gpt()
    linears = prunable_linears(blocks(model))
    from lightning_dynmo.dynamism.magnitude_select import PrunableWeight

    weights = [PrunableWeight(i, n, m.weight, m.weight_mask) for i, n, m in linears]
    with pytest.raises(ValueError, match=r"layer indices \[3, 3, 3, 3\] are outside the model's 3 layers"):
        select_global_pruning(weights, 0.5, num_layers=3, group=None)
    with pytest.raises(ValueError, match=r"give them by increasing layer index"):
        select_global_pruning(weights[::-1], 0.5, num_layers=4, group=None)
    with torch.no_grad():
        linears[5][2].weight[0, 0] = float("nan")
    with pytest.raises(
        ValueError, match=r"1 prunable weight entries are NaN or infinite \(here: \['layers.1"
    ):
        select_global_pruning(weights, 0.5, num_layers=4, group=None)


def test_the_ready_configuration_builds_a_dense_gpt() -> None:
    config = pruning_gpt_config(num_layers=2, d_model=32)
    assert config.num_layers == 2 and config.blocks == "dense" and config.mlp_width == 128
    defaults = PruningConfig()
    assert defaults.schedule.steps == (30, 40, 50, 60, 70) and defaults.schedule.final_sparsity == 0.9
