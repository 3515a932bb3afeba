"""The GPT declares what its blocks need from the stage interface, and runs them as a stage does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.models import GPT, DenseBlock, GPTConfig, register_block, unregister_block
from lightning_dynmo.models.gpt import block_interface
from lightning_dynmo.pipeline.model.contract import check_model_contract
from lightning_dynmo.pipeline.step.aux_loss import add_aux_loss, collect_aux_losses
from lightning_dynmo.pipeline.step.stage import StageModule


class ProbeBlock(nn.Module):
    """A dense block with an exit mask (side state), a per-layer loss on the labels and an aux loss."""

    pipeline_inputs = ("labels", "exited")
    side_state_init = {"exited": lambda h: torch.zeros(h.shape[:2], dtype=torch.bool, device=h.device)}
    pipeline_aux_losses = ("probe_exit",)

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.inner = DenseBlock(config)
        self.exit_head = nn.Linear(config.d_model, config.vocab_size)

    def forward(self, x: Tensor, labels: Tensor, exited: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        h = self.inner(x)
        logits = self.exit_head(h)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        h = add_aux_loss("probe_exit", 0.1 * loss, h)
        confident = logits.softmax(-1).amax(-1) > 0.02
        return torch.where(exited.unsqueeze(-1), x, h), {"exited": exited | confident}


@pytest.fixture
def probe_kind() -> Iterator[None]:
    register_block("probe", lambda config, index, options: ProbeBlock(config))
    yield
    unregister_block("probe")


def _model(blocks: Any, microbatches: int = 1) -> GPT:
    config = GPTConfig(vocab_size=32, seq_len=8, num_layers=3, d_model=16, num_heads=2, blocks=blocks)
    return GPT(config, microbatches=microbatches).double()


def _batch() -> Tensor:
    return torch.randint(0, 32, (4, 9), generator=torch.Generator().manual_seed(0))


def test_a_dense_gpt_keeps_the_plain_contract() -> None:
    model = _model("dense")
    assert (model.pipeline_side_inputs, model.pipeline_side_state, model.pipeline_aux_losses) == ((), (), ())
    assert len(model.pipeline_batch(_batch())) == 2
    assert isinstance(model.pipeline_first(_batch()[:, :-1]), Tensor)


def test_blocks_declare_labels_side_state_and_aux_losses(probe_kind: None) -> None:
    model = _model(["dense", "probe", "probe"])
    spec = check_model_contract(model)
    assert (spec.side_inputs, spec.side_state, spec.aux_losses) == (("labels",), ("exited",), ("probe_exit",))
    inputs, target, side = model.pipeline_batch(_batch())
    assert torch.equal(side["labels"], target)
    stage = StageModule(model, spec, range(3), first=True, last=True)
    assert torch.equal(stage(inputs, **side), model(inputs, target))


def test_the_single_process_step_adds_each_micro_batch_aux_loss(probe_kind: None) -> None:
    model = _model(["probe", "dense", "probe"], microbatches=2)
    model.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    batch = _batch()
    loss = model.training_step(batch, 0)
    mains, auxes = [], []
    for piece in batch.chunk(2):
        with collect_aux_losses(attach=False) as aux:
            mains.append(model.pipeline_loss(model(piece[:, :-1], piece[:, 1:]), piece[:, 1:]))
        auxes.append(aux.total())
    expected = torch.stack(mains).mean() + torch.stack([torch.as_tensor(a) for a in auxes]).mean()
    assert torch.allclose(loss, expected, atol=1e-15, rtol=0)
    whole = model.pipeline_loss(model(batch[:, :-1], batch[:, 1:]), batch[:, 1:])
    assert not torch.allclose(loss, whole), "negative control: the micro-batch split must matter here"


def test_a_block_reading_an_unknown_name_is_refused() -> None:
    class Reads(nn.Linear):
        pipeline_inputs = ("attention_mask",)

    with pytest.raises(TypeError, match=r"reads 'attention_mask', which is neither a GPT side input"):
        block_interface([Reads(2, 2)])


def test_microbatches_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"GPT\(microbatches=0\) must be an integer >= 1"):
        GPT(GPTConfig(num_layers=1, d_model=8, num_heads=2, seq_len=4), microbatches=0)
