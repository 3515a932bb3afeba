"""The GPT: contract pieces, per-unit seeding, weight-decay groups, config errors; it learns the corpus."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_dynmo.data import StdlibCorpus, TextDataModule
from lightning_dynmo.models import GPT, GPTConfig, OptimizerConfig, build_unit, unit_names, unit_seed
from lightning_dynmo.models.optim import WarmupCosine
from lightning_dynmo.pipeline.model.contract import check_model_contract
from tests.quiet_trainer import quiet_trainer

TINY: dict[str, Any] = {"num_layers": 3, "d_model": 16, "num_heads": 2, "seq_len": 8}


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_follows_the_contract_and_forward_is_the_pipeline_in_order() -> None:
    model = GPT(GPTConfig(**TINY))
    spec = check_model_contract(model)
    assert (spec.num_layers, spec.first_parts, spec.last_parts) == (
        3,
        ("tok_emb", "pos_emb"),
        ("ln_f", "head"),
    )
    batch = torch.randint(0, 256, (4, 9))
    inputs, target = model.pipeline_batch(batch)
    assert inputs.shape == target.shape == (4, 8) and torch.equal(inputs[:, 1:], target[:, :-1])
    hidden = model.pipeline_first(inputs)
    for i in range(3):
        hidden = model.layers[str(i)](hidden)
    logits = model.pipeline_last(hidden)
    assert logits.shape == (4, 8, 256)
    torch.testing.assert_close(logits, model(inputs), rtol=0, atol=0)
    # At initialisation the prediction is close to uniform over the 256 bytes.
    assert abs(model.pipeline_loss(logits, target).item() - math.log(256)) < 0.1
    assert model(inputs[:, :5]).shape == (4, 5, 256), "shorter sequences are fine"


def test_an_input_longer_than_seq_len_is_refused() -> None:
    with pytest.raises(ValueError, match=r"9 tokens per sequence but GPTConfig.seq_len=8"):
        GPT(GPTConfig(**TINY))(torch.zeros(1, 9, dtype=torch.long))


def test_gpt2_init_scales_residual_projections() -> None:
    model = GPT(GPTConfig(num_layers=8, d_model=64, num_heads=4, seq_len=8))
    block = model.layers["3"]
    assert abs(block.attn.qkv.weight.std().item() - 0.02) < 0.002
    for proj in (block.attn.proj, block.mlp.fc_out):
        assert abs(proj.weight.std().item() - 0.02 / math.sqrt(16)) < 0.001
    assert torch.count_nonzero(block.attn.qkv.bias) == 0 and torch.all(block.ln_1.weight == 1)


def test_units_are_seeded_by_name_not_by_build_order() -> None:
    config = GPTConfig(**TINY)
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    model = GPT(config)
    assert torch.equal(torch.rand(1), expected_draw), "building a model must not move the global RNG"
    reversed_units = {name: build_unit(config, name) for name in reversed(unit_names(config))}
    for name, unit in reversed_units.items():
        assert _same(unit, model.get_submodule(name)), f"{name} differs when built in reverse order"
    # Only a subset, as a rank that builds its own stage would.
    assert _same(build_unit(config, "layers.2"), model.layers["2"])
    # A different base seed changes every randomly initialised unit.
    other = GPT(GPTConfig(**TINY, seed=1))
    for name in ("tok_emb", "pos_emb", "layers.0", "layers.2", "head"):
        assert not _same(other.get_submodule(name), model.get_submodule(name)), name
    assert len({unit_seed(0, name) for name in unit_names(config)}) == len(unit_names(config))
    with pytest.raises(ValueError, match=r"'layers.3' is not a unit of this GPT"):
        build_unit(config, "layers.3")


def test_tied_head_is_the_embedding_wherever_it_is_built() -> None:
    config = GPTConfig(**TINY, tie_embeddings=True)
    model = GPT(config)
    assert model.head.weight is model.tok_emb.weight
    assert torch.equal(build_unit(config, "head").weight, model.tok_emb.weight)


def _group_names(model: GPT, optimizer: torch.optim.Optimizer) -> list[set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [{names[id(p)] for p in group["params"]} for group in optimizer.param_groups]


def test_weight_decay_groups_are_matrices_vs_the_rest() -> None:
    model = GPT(GPTConfig(**TINY), OptimizerConfig(weight_decay=0.05))
    optimizer = model.configure_optimizers()
    decay, keep = _group_names(model, optimizer)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert decay == {"head.weight"} | {
        f"layers.{i}.{m}.weight"
        for i in range(3)
        for m in ("attn.qkv", "attn.proj", "mlp.fc_in", "mlp.fc_out")
    }
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "layers.0.ln_1.bias"} <= keep
    assert decay | keep == {n for n, _ in model.named_parameters()} and not decay & keep


def test_a_tied_head_on_the_last_stage_joins_the_embeddings_group() -> None:
    model = GPT(GPTConfig(**TINY, tie_embeddings=True))
    assert "tok_emb.weight" in _group_names(model, model.configure_optimizers())[1]
    # What the strategy leaves on a last-stage rank: the head holds its own copy of the tied weight.
    model.tok_emb = None  # type: ignore[assignment]
    model.pos_emb = None  # type: ignore[assignment]
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())
    assert "head.weight" in _group_names(model, model.configure_optimizers())[1]


@pytest.mark.parametrize("foreach", [False, True])
def test_an_empty_group_keeps_its_index_and_adamw_steps(foreach: bool) -> None:
    model = GPT(GPTConfig(**TINY))
    for name in ("layers", "ln_f", "head"):  # a rank holding only the embeddings: no matrix to decay
        setattr(model, name, None)
    optimizer = model.configure_optimizers()
    assert [len(g["params"]) for g in optimizer.param_groups] == [0, 2]
    for group in optimizer.param_groups:
        group["foreach"] = foreach
    model.tok_emb(torch.tensor([1, 2])).sum().backward()
    before = model.tok_emb.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.tok_emb.weight)
    # A parameter migrated in later joins group 0 and trains there.
    arriving = nn.Parameter(torch.ones(2, 2))
    optimizer.param_groups[0]["params"].append(arriving)
    arriving.grad = torch.ones(2, 2)
    optimizer.step()
    assert torch.all(arriving < 1)


def test_warmup_then_cosine() -> None:
    schedule = WarmupCosine(OptimizerConfig(warmup_steps=4, decay_steps=10, min_lr_ratio=0.1))
    assert [schedule(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule(4) == 1.0 and schedule(9) == pytest.approx(0.55) and schedule(14) == pytest.approx(0.1)
    assert schedule(100) == pytest.approx(0.1)
    model = GPT(GPTConfig(**TINY), OptimizerConfig(warmup_steps=2))
    assert model.configure_optimizers()["lr_scheduler"]["interval"] == "step"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"d_model": 30, "num_heads": 4}, r"d_model=30 is not divisible by num_heads=4.*\(e.g. 28\)"),
        ({"num_layers": 0}, r"GPTConfig.num_layers=0 must be an integer >= 1"),
        ({"seq_len": 2.0}, r"GPTConfig.seq_len=2.0 must be an integer >= 1"),
        ({"vocab_size": 1}, r"vocab_size=1 must be >= 2"),
        ({"d_ff": 0}, r"GPTConfig.d_ff=0 must be an integer >= 1"),
        ({"dropout": 1.0}, r"GPTConfig.dropout=1.0 must be in \[0, 1\)"),
        ({"init_std": 0.0}, r"init_std=0.0 must be > 0"),
    ],
)
def test_bad_model_config(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**TINY, **overrides})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"lr": 0.0}, r"OptimizerConfig.lr=0.0 must be > 0"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\) must be two numbers in \[0, 1\)"),
        ({"weight_decay": -1.0}, r"weight_decay=-1.0 >= 0"),
        ({"warmup_steps": -1}, r"warmup_steps=-1 must be an integer >= 0"),
        ({"decay_steps": 0}, r"OptimizerConfig.decay_steps=0 must be an integer >= 1"),
        ({"min_lr_ratio": 2.0}, r"min_lr_ratio=2.0 must be in \[0, 1\]"),
    ],
)
def test_bad_optimizer_config(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**overrides)


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def test_single_process_training_learns_the_embedded_corpus(tmp_path: Path) -> None:
    data = TextDataModule(
        corpus=StdlibCorpus(max_bytes=200_000), seq_len=32, batch_size=8, cache_dir=tmp_path
    )
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, seq_len=32), OptimizerConfig(lr=1e-2))
    recorder = _Losses()
    trainer = quiet_trainer(
        max_epochs=1,
        limit_train_batches=25,
        limit_val_batches=3,
        num_sanity_val_steps=0,
        callbacks=[recorder],
    )
    trainer.fit(model, data)
    first, last = recorder.losses[0], sum(recorder.losses[-5:]) / 5
    assert first > 5.3 and last < first - 1.5, (
        f"loss went from {first:.2f} to {last:.2f} (mean of the last 5)"
    )
    metrics = trainer.callback_metrics
    assert float(metrics["val_ppl"]) == pytest.approx(math.exp(float(metrics["val_loss"])), rel=1e-5)
    trainer.test(model, dataloaders=data.val_dataloader(), verbose=False)
    metrics = trainer.callback_metrics
    assert float(metrics["test_ppl"]) == pytest.approx(math.exp(float(metrics["test_loss"])), rel=1e-5)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"vocab_size": 128}, r"vocab_size=256 but GPTConfig.vocab_size=128; .*GPTConfig\(vocab_size=256\)"),
        ({"seq_len": 8}, r"serves seq_len=16 tokens but GPTConfig.seq_len=8"),
    ],
)
def test_a_datamodule_that_does_not_fit_the_model_is_refused(
    overrides: dict[str, Any], match: str, tmp_path: Path
) -> None:
    data = TextDataModule(corpus=StdlibCorpus(max_bytes=50_000), seq_len=16, cache_dir=tmp_path)
    model = GPT(GPTConfig(**{**TINY, "seq_len": 16, **overrides}))
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, data)


def test_declared_on_the_meta_device_its_metric_states_stay_real() -> None:
    # Local construction materialises only the pipeline units, then moves the model with ``.to(device)``:
    # a metric state left on meta could never move.
    with torch.device("meta"):
        model = GPT(GPTConfig(**TINY))
    assert model.layers["0"].attn.qkv.weight.is_meta
    states = [t for m in model.eval_loss_means.values() for t in m.metric_state.values()]
    assert states and not any(t.is_meta for t in states)
