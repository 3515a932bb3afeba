"""Hugging Face models trained under DynMoStrategy equal the plain model trained by its own forward.

Each test fits ``HuggingFaceCausalLM`` (GPT-2 with its tied embedding and head, Llama, Mixtral with its
router loss) on 2 forked gloo ranks with padded batches, through a forced migration and a re-pack onto
one rank (the other is released), and compares the logged losses (and router loss) and every parameter,
under the model's own names, with ``HFReference``: the plain Hugging Face model trained in one process by
its own forward on whole batches, in float64. Negative controls train the reference without the
attention mask, with the model's default positions, or with another router loss, and must differ by far
more than the tolerance; Mixtral also trains with activation checkpointing. One test trains with HF
Trainer's weight-decay groups and an LR schedule (the reference builds its groups with
``Trainer.get_decay_parameter_names``). A last test saves a checkpoint under the strategy, validates
from it at another placement, loads it strictly into the plain model (one file as saved, a sharded
directory once exported), through ``HuggingFaceCausalLM.load_from_checkpoint`` (both), and round-trips
it through ``save_pretrained``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynmo.models.huggingface import HuggingFaceCausalLM
from lightning_dynmo.pipeline.checkpoint.sharded import export_full_checkpoint
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.case_fit import Fit, MetricsRecorder, fit_case, fit_reference, trainer_kwargs
from tests.distributed.equivalence import assert_differs, assert_equivalent
from tests.distributed.fitting import TOL, ForcePlacement
from tests.distributed.hf_reference import HFReference, PaddedBatches, tiny_model, transformers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

AUX = "train_aux/router_load_balance"


@dataclass(frozen=True)
class Setup:
    kind: str
    attn: str = "sdpa"
    padding: str = "both"
    num_layers: int = 4
    num_microbatches: int = 4
    batch_size: int = 8
    steps: int = 5
    lr: float = 0.01
    sharded_checkpoint: bool = False
    weight_decay: float = 0.0
    lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None
    activation_checkpointing: bool = False
    # A migration, then a re-pack onto rank 0 (rank 1 is released).
    migrations: tuple[tuple[int, str], ...] = ((1, "0-0|1-3"), (3, "0-3"))
    # Where the ranks save a checkpoint after the fit, then validate from it at another placement.
    checkpoint: Path | None = None

    def hf_model(self) -> Any:
        return tiny_model(self.kind, attn=self.attn, num_layers=self.num_layers)

    def loader(self) -> DataLoader[Any]:
        data = PaddedBatches(self.batch_size * self.steps, self.padding)
        return DataLoader(data, batch_size=self.batch_size, drop_last=True)

    def recorder(self) -> MetricsRecorder:
        return MetricsRecorder("train_loss", AUX, optional=True)  # only Mixtral logs a router loss

    def rank_fit(self, rank: int, world_size: int, resume: bool) -> Fit:
        strategy = DynMoStrategy(
            num_microbatches=self.num_microbatches,
            placement="0-1|2-3",
            save_distributed_checkpoint=self.sharded_checkpoint,
            activation_checkpointing=self.activation_checkpointing,
        )
        model = HuggingFaceCausalLM(
            self.hf_model(), lr=self.lr, weight_decay=self.weight_decay, lr_scheduler=self.lr_scheduler
        )

        def report(trainer: pl.Trainer) -> dict[str, Any]:
            state = {model.huggingface_name(k): v.detach().clone() for k, v in model.state_dict().items()}
            return {"state": state, **self._save_and_validate(trainer, world_size)}

        mover = [ForcePlacement(dict(self.migrations))]
        return Fit(
            model, (self.loader(),), self.recorder(), trainer_kwargs(), mover, strategy, outcome=report
        )

    def _save_and_validate(self, trainer: pl.Trainer, world_size: int) -> dict[str, Any]:
        if self.checkpoint is None:
            return {}
        trainer.save_checkpoint(self.checkpoint)
        # Validate from the checkpoint at another placement on fresh ranks' models (weights by HF name).
        fresh = DynMoStrategy(
            num_microbatches=2, placement="0-0|1-3", save_distributed_checkpoint=self.sharded_checkpoint
        )
        validator = pl.Trainer(devices=world_size, strategy=fresh, use_distributed_sampler=False,
                               **trainer_kwargs())  # fmt: skip
        metrics = validator.validate(
            HuggingFaceCausalLM(self.hf_model()), self.loader(), ckpt_path=self.checkpoint
        )
        return {"val_loss": metrics[0]["val_loss"]}

    def reference(self, **switches: Any) -> dict[str, Any]:
        """The plain model trained by its own forward in one process (``switches``: negative controls)."""
        optim = {"weight_decay": self.weight_decay, "lr_scheduler": self.lr_scheduler}
        model = HFReference(
            self.hf_model(), lr=self.lr, microbatches=self.num_microbatches, **{**optim, **switches}
        )
        ref = fit_reference(Fit(model, (self.loader(),), self.recorder(), trainer_kwargs()))
        return {**ref, "state": {k.removeprefix("hf."): v for k, v in ref["state"].items()}}


def _fit_and_compare(setup: Setup, tmp_path: Path, controls: dict[str, dict[str, Any]]) -> None:
    results = fit_case(setup, tmp_path)
    kept, released = results
    assert released["released"] and not kept["released"] and kept["placement"] == "0-3"
    assert len(kept["losses"]) == setup.steps and len(released["losses"]) == setup.migrations[-1][0]
    assert_equivalent(results, setup.reference())  # the released rank: the steps before the re-pack
    for what, switches in controls.items():
        assert_differs([kept], setup.reference(**switches), what)


def test_gpt2_with_a_tied_head_eager_attention_and_left_and_right_padding(tmp_path: Path) -> None:
    setup = Setup(kind="gpt2", attn="eager")
    model = setup.hf_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    controls = {
        "dropping the attention mask": {"use_mask": False},
        "the model's default positions (0..seq-1 under left padding)": {"positions": "arange"},
    }
    _fit_and_compare(setup, tmp_path, controls)


@pytest.mark.parametrize(("attn", "padding"), [("sdpa", "both"), ("eager", "right")])
def test_llama_with_rotary_embeddings_and_causal_masks(tmp_path: Path, attn: str, padding: str) -> None:
    # Rotary attention depends on position differences only, so left padding's shift of a row's positions
    # changes nothing (only GPT-2's learned positions tell); eager attention in float64 needs right padding
    # (see test_huggingface.py), where the padding mask does not change real tokens: the causal mask does.
    setup = Setup(kind="llama", attn=attn, padding=padding)
    controls: dict[str, dict[str, Any]] = {"attention without the causal mask": {"causal": False}}
    if padding == "both":
        controls["dropping the attention mask"] = {"use_mask": False}
    _fit_and_compare(setup, tmp_path, controls)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "activation-checkpointing"])
def test_mixtral_with_its_router_loss_on_every_stage(tmp_path: Path, checkpointing: bool) -> None:
    # Checkpointed blocks run again in backward: the router loss is still added and logged once.
    setup = Setup(kind="mixtral", activation_checkpointing=checkpointing)
    controls = {
        "dropping the router loss": {"router": "none"},
        "the library's cross-layer router loss": {"router": "huggingface"},
    }
    _fit_and_compare(setup, tmp_path, controls)


def shrinking_lr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.7**step)


def test_hf_trainer_weight_decay_groups_and_a_scheduler_survive_a_migration(tmp_path: Path) -> None:
    # The decay group (HF Trainer's rule: not biases, LayerNorms) and the schedule follow migrated layers.
    setup = Setup(kind="gpt2", attn="eager", weight_decay=0.5, lr_scheduler=shrinking_lr)
    controls: dict[str, dict[str, Any]] = {
        "weight decay on every parameter": {"decay": "all"},
        "no LR schedule": {"lr_scheduler": None},
    }
    _fit_and_compare(setup, tmp_path, controls)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_checkpoint_loads_into_the_plain_model_and_round_trips_save_pretrained(
    tmp_path: Path, sharded: bool
) -> None:
    # One file carries the model's own names; a sharded directory keeps the units' names (each rank reads
    # its units back by them) and gets the model's names when exported to one file.
    setup = Setup(
        kind="gpt2", attn="eager", steps=3, migrations=((1, "0-2|3-3"),), sharded_checkpoint=sharded
    )
    path = tmp_path / "hf.ckpt"
    kept, other = fit_case(replace(setup, checkpoint=path), tmp_path)
    trained = {**other["state"], **kept["state"]}
    # Lightning's way: the adapter rebuilt from the checkpoint's hyper-parameters (the directory read in
    # place, or the file) holds exactly the trained weights, in the trained precision.
    with pl.Trainer(accelerator="cpu", precision="64-true", logger=False).init_module():
        loaded = HuggingFaceCausalLM.load_from_checkpoint(path, weights_only=True)
    loaded_state = loaded.huggingface_state_dict()
    assert set(loaded_state) == set(trained)
    for key, value in loaded_state.items():
        assert value.dtype == torch.float64 and torch.equal(value, trained[key]), key
    if sharded:
        checkpoint = torch.load(export_full_checkpoint(path, tmp_path / "full.ckpt"), weights_only=False)
        assert "layers.3.layer.attn.c_attn.weight" in checkpoint["state_dict"]
        HuggingFaceCausalLM(setup.hf_model()).rename_for_huggingface(checkpoint)
    else:
        checkpoint = torch.load(path, weights_only=False)
    plain = setup.hf_model()
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    assert plain.lm_head.weight is plain.transformer.wte.weight
    for key, value in plain.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert "transformer.h.3.attn.c_attn.weight" in checkpoint["optimizer_states"][0]["state"]
    # The strategy loaded it by name at another placement: its validation loss is the plain model's.
    reference = HFReference(plain)
    reference.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    with torch.no_grad():
        losses = [reference.training_step(b, 0) for b in setup.loader()]
    expected = torch.stack(losses).mean().item()
    assert abs(kept["val_loss"] - expected) < TOL and abs(other["val_loss"] - expected) < TOL
    if sharded:
        return
    plain.save_pretrained(tmp_path / "pretrained")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "pretrained", dtype=torch.float64, attn_implementation="eager"
    )
    assert loaded.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in loaded.state_dict().items())
    batch = next(iter(setup.loader()))
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, plain(**batch).logits)
