"""Per-stage pretrained loading under DynMoStrategy: each rank reads and holds its stage's weights only.

A Llama of 6 layers (53 MiB in float64) is saved with ``save_pretrained`` in shards; on 2 forked gloo
ranks ``HuggingFaceCausalLM.from_pretrained`` builds it on the meta device and the strategy materialises
each rank's units (``0-2|3-5``) from the files. Asserted per rank, outside the code under test (see
:mod:`tests.distributed.memory`): the bytes of model tensors it holds are exactly its stage's (and the
rotary module's buffers), its peak resident growth while it builds and sets up the model stays under a
budget that the whole model exceeds, and its weights equal ``AutoModelForCausalLM.from_pretrained``'s
(``torch.equal``), before it trains two steps. The negative control loads the whole model on each rank
(with ``from_pretrained``, as before per-stage loading) and exceeds the budget.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynmo.models.hf_pretrained import PretrainedWeights
from lightning_dynmo.models.huggingface import HuggingFaceCausalLM
from lightning_dynmo.strategy import DynMoStrategy
from tests.distributed.case_fit import set_rank_env, trainer_kwargs
from tests.distributed.harness import run_distributed
from tests.distributed.hf_reference import PaddedBatches, tiny_config, transformers
from tests.distributed.memory import MIB, Watch
from tests.distributed.meta_model import model_bytes

pytestmark = pytest.mark.distributed

PLACEMENT = "0-2|3-5"
# Per rank: its stage (26.5 MiB) and the file pages of the unit it reads; the whole model is 53 MiB.
BUDGET = 40 * MIB
STAGE_PREFIXES = (
    ("model.embed_tokens.", "model.layers.0.", "model.layers.1.", "model.layers.2."),
    ("model.layers.3.", "model.layers.4.", "model.layers.5.", "model.norm.", "lm_head."),
)


def save_pretrained(directory: Path) -> None:
    config = tiny_config(
        "llama", num_layers=6, hidden_size=256, intermediate_size=1024, vocab_size=2048,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").double()
    model.save_pretrained(directory, max_shard_size="16MB")


@dataclass(frozen=True)
class PretrainedRun:
    directory: Path
    load_whole_model: bool = False  # the negative control

    def worker(self, rank: int, world_size: int) -> dict[str, Any]:
        set_rank_env(rank)
        if self.load_whole_model:
            own_units_only = PretrainedWeights.load_unit
            whole: list[Any] = []

            def load_from_the_whole_model(weights: PretrainedWeights, name: str, unit: Any) -> None:
                if not whole:  # as before per-stage loading: every rank loads the whole model
                    model = transformers.AutoModelForCausalLM.from_pretrained(self.directory)
                    # Its tensors may map the file lazily; a model moved to its device holds them all.
                    whole.append({k: v.clone() for k, v in model.state_dict().items()})
                own_units_only(weights, name, unit)

            PretrainedWeights.load_unit = load_from_the_whole_model  # type: ignore[method-assign]
        watch = Watch()
        strategy = DynMoStrategy(num_microbatches=2, placement=PLACEMENT)
        trainer = pl.Trainer(
            devices=world_size,
            strategy=strategy,
            use_distributed_sampler=False,
            callbacks=[watch],
            **trainer_kwargs(max_steps=2),
        )
        model = HuggingFaceCausalLM.from_pretrained(
            self.directory, dtype=torch.float64, attn_implementation="eager"
        )
        trainer.fit(model, DataLoader(PaddedBatches(8, "right"), batch_size=4))
        return {
            "initial": {model.huggingface_name(k): v for k, v in watch.initial.items()},
            "setup_growth": watch.setup_growth,
            "held": watch.held,
            "rotary_bytes": model_bytes(model.rotary),
            "steps": trainer.global_step,
        }


def fit(run: PretrainedRun, tmp_path: Path) -> list[dict[str, Any]]:
    gc.collect()  # the ranks inherit this process's memory: leave them no garbage to free
    return run_distributed(_worker, 2, tmp_path, timeout_s=300, args=(run,))


def _worker(rank: int, world_size: int, run: PretrainedRun) -> dict[str, Any]:
    return run.worker(rank, world_size)


def assert_within_budget(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        assert res["setup_growth"] <= BUDGET, (
            f"rank {rank}: resident memory grew by {res['setup_growth'] / MIB:.1f} MiB while building and "
            f"setting up the model, over the budget of {BUDGET / MIB:.0f} MiB"
        )


def test_each_rank_loads_and_holds_only_its_stage_of_the_pretrained_weights(tmp_path: Path) -> None:
    directory = tmp_path / "pretrained"
    save_pretrained(directory)
    assert len(list(directory.glob("*.safetensors"))) > 2  # sharded, read through the index
    expected = dict(
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).state_dict()
    )
    whole = sum(t.numel() * t.element_size() for t in expected.values())
    assert whole > BUDGET * 1.25, f"the model ({whole / MIB:.1f} MiB) must not fit the budget"
    results = fit(PretrainedRun(directory), tmp_path)
    for rank, res in enumerate(results):
        stage = {k: v for k, v in expected.items() if k.startswith(STAGE_PREFIXES[rank])}
        stage_bytes = sum(t.numel() * t.element_size() for t in stage.values())
        # Besides its stage, each rank holds only the rotary module's few buffers (inv_freq: 32 numbers).
        assert res["rotary_bytes"] <= 1024
        assert res["held"][0] == stage_bytes + res["rotary_bytes"], f"rank {rank} holds more than its stage"
        assert stage_bytes < whole / 1.5
        assert set(res["initial"]) == set(stage)
        for key, value in res["initial"].items():
            assert torch.equal(value, stage[key]), f"rank {rank}: {key} differs from from_pretrained's"
        assert res["steps"] == 2
    assert_within_budget(results)


def test_negative_control_loading_the_whole_model_on_each_rank_exceeds_the_budget(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "pretrained"
    save_pretrained(directory)
    results = fit(PretrainedRun(directory, load_whole_model=True), tmp_path)
    with pytest.raises(AssertionError, match=r"resident memory grew by .* over the budget"):
        assert_within_budget(results)
