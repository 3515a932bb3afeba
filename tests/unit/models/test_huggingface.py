"""HuggingFaceCausalLM in one process: the model's own forward and loss, its names, and its errors.

The adapter's logits equal the Hugging Face model's own forward (GPT-2, Llama, Qwen2, Mistral with a
sliding window, Mixtral; eager and sdpa attention; left and right padding), its loss and gradients equal
the reference's (the model's forward with the library's loss formula and the per-layer router loss) with
micro-batches of unequal token counts, the reference formulas equal the library's own, and checkpoints
carry the model's own names. Pipelined training is in ``tests/distributed/test_huggingface_fit.py``.

A float64 quirk of the library shapes the parametrisation: with eager attention, Llama-family layers
turn a query row with no visible key (left padding, or a sliding window over padding) into NaN, which
then spreads through the row (``finfo(float64).min`` becomes ``-inf`` in their float32 softmax). So
eager runs use right padding there (none for Mistral's sliding window); sdpa runs use both.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dynmo.models.hf_architecture import HFArchitecture
from lightning_dynmo.models.hf_blocks import switch_load_balancing_loss
from lightning_dynmo.models.huggingface import HuggingFaceCausalLM
from lightning_dynmo.pipeline.checkpoint.renaming import rename_checkpoint_keys
from lightning_dynmo.pipeline.model.contract import check_model_contract, split_batch
from tests.distributed.hf_reference import (
    HFReference,
    PaddedBatches,
    causal_lm_loss,
    per_layer_router_loss,
    tiny_config,
    tiny_model,
    transformers,
)

KINDS = ("gpt2", "llama", "qwen2", "mistral", "mixtral")


def _batch(n: int = 8, padding: str = "both", seed: int = 0) -> dict[str, Tensor]:
    data = PaddedBatches(n, padding, seed)
    return {"input_ids": data.ids, "attention_mask": data.mask}


def _padding_for(kind: str, attn: str) -> str:
    if attn == "sdpa" or kind == "gpt2":
        return "both"
    return "none" if kind == "mistral" else "right"  # a sliding window over right padding sees only padding


def _hf_names(state: dict[str, Tensor], model: HuggingFaceCausalLM) -> dict[str, Tensor]:
    return {model.huggingface_name(k): v for k, v in state.items()}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_the_models_own_forward(kind: str, attn: str) -> None:
    hf = tiny_model(kind, attn=attn, num_layers=2)
    reference = copy.deepcopy(hf)
    adapter = HuggingFaceCausalLM(hf)
    batch = _batch(padding=_padding_for(kind, attn))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = adapter(ids, mask)
        unmasked = reference(input_ids=ids).logits
    real = mask.bool()
    assert (got - expected)[real].abs().max().item() < 1e-12
    if _padding_for(kind, attn) == "both":  # control: the padding mask and positions change real tokens
        assert (unmasked - expected)[real].abs().max().item() > 1e-3


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_loss_and_gradients_equal_the_reference_with_unequal_micro_batches(kind: str) -> None:
    # Four micro-batches of 2 rows with different token counts: each normalised by the batch's count.
    hf = tiny_model(kind, attn="sdpa", num_layers=2)
    reference = HFReference(copy.deepcopy(hf), microbatches=4)
    adapter = HuggingFaceCausalLM(hf, microbatches=4)
    batch = _batch()
    for module in (reference, adapter):
        module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    ref_loss = reference.training_step(batch, 0)
    loss = adapter.training_step(batch, 0)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    ref_loss.backward()
    loss.backward()
    ours = _hf_names({k: p.grad for k, p in adapter.named_parameters()}, adapter)
    theirs = {k.removeprefix("hf."): p.grad for k, p in reference.named_parameters()}
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if kind == "gpt2" else set())
    assert max((ours[k] - theirs[k]).abs().max().item() for k in ours) < 1e-12
    # Control: the mean of the micro-batches' own token means is not the batch's token mean.
    with torch.no_grad():
        logits = adapter(batch["input_ids"], batch["attention_mask"])
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    naive = torch.stack(
        [causal_lm_loss(lg, lb) for lg, lb in zip(logits.chunk(4), labels.chunk(4), strict=True)]
    ).mean()
    assert abs(naive.item() - causal_lm_loss(logits, labels).item()) > 1e-4


def test_the_reference_loss_is_the_librarys_own() -> None:
    # The library computes its loss in float32 (it casts logits); the formula is the same.
    hf = tiny_model("llama", attn="sdpa", num_layers=2)
    batch = _batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        out = hf(**batch, labels=labels)
    ours = causal_lm_loss(out.logits, labels)
    assert abs(out.loss.item() - ours.item()) < 1e-5 and abs(out.loss.item() - ours.item()) > 0


def test_router_loss_equals_the_librarys_for_one_layer_and_differs_across_layers() -> None:
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(0)
    mask = _batch(4)["attention_mask"]
    one = torch.randn(4 * 8, 4, generator=gen, dtype=torch.float64)
    other = torch.randn(4 * 8, 4, generator=gen, dtype=torch.float64)
    ours = switch_load_balancing_loss(one, top_k=2, attention_mask=mask)
    assert abs(ours.item() - load_balancing_loss_func((one,), 4, 2, mask).item()) < 1e-6
    written = per_layer_router_loss((one,), mask, top_k=2, coef=1.0, microbatches=1)
    assert abs(ours.item() - written.item()) < 1e-12
    # Layers that route alike: the per-layer mean is the library's cross-layer value; otherwise not.
    same = (ours + switch_load_balancing_loss(one, top_k=2, attention_mask=mask)) / 2
    assert abs(same.item() - load_balancing_loss_func((one, one), 4, 2, mask).item()) < 1e-6
    mean = (ours + switch_load_balancing_loss(other, top_k=2, attention_mask=mask)) / 2
    assert abs(mean.item() - load_balancing_loss_func((one, other), 4, 2, mask).item()) > 1e-3


def test_mixtral_declares_its_router_loss_only_when_the_model_trains_with_it() -> None:
    assert HuggingFaceCausalLM(tiny_model("mixtral", num_layers=2)).pipeline_aux_losses == (
        "router_load_balance",
    )
    quiet = HuggingFaceCausalLM(tiny_model("mixtral", num_layers=2, output_router_logits=False))
    assert quiet.pipeline_aux_losses == ()


@pytest.mark.parametrize("kind", KINDS)
def test_units_have_the_models_own_state_dict_names(kind: str) -> None:
    hf = tiny_model(kind, num_layers=2)
    names = list(hf.state_dict())
    adapter = HuggingFaceCausalLM(hf)
    check_model_contract(adapter)  # every parameter belongs to one unit; the rotary module is no unit
    assert sorted(adapter.huggingface_state_dict()) == sorted(names)
    internal = list(adapter.state_dict())
    assert [adapter._loaded_name(adapter.huggingface_name(k)) for k in internal] == internal


def test_to_huggingface_and_save_pretrained_round_trip(tmp_path: Path) -> None:
    adapter = HuggingFaceCausalLM(tiny_model("gpt2", num_layers=2))
    with torch.no_grad():
        adapter.layers["1"].layer.mlp.c_fc.weight.add_(1.0)  # trained weights, not the initial ones
    rebuilt = adapter.to_huggingface()
    assert rebuilt.lm_head.weight is rebuilt.transformer.wte.weight
    rebuilt.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="eager"
    )
    expected = adapter.huggingface_state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, expected[key]), key
    batch = _batch(4)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, rebuilt(**batch).logits)


def test_checkpoint_keys_are_renamed_both_ways() -> None:
    adapter = HuggingFaceCausalLM(tiny_model("llama", num_layers=2))
    key = "layers.1.layer.mlp.up_proj.weight"
    checkpoint: dict[str, Any] = {
        "state_dict": dict(adapter.state_dict()),
        "optimizer_states": [
            {"param_groups": [{}], "param_group_of": {key: 0}, "state": {key: {"step": torch.ones(())}}},
            {"state": {0: {}}, "param_groups": [{"params": [0]}]},  # torch's positional format: untouched
        ],
    }
    adapter.on_save_checkpoint(checkpoint)
    assert "model.layers.1.mlp.up_proj.weight" in checkpoint["state_dict"]
    assert list(checkpoint["optimizer_states"][0]["state"]) == ["model.layers.1.mlp.up_proj.weight"]
    transformers.LlamaForCausalLM(adapter.hf_config).load_state_dict(checkpoint["state_dict"], strict=True)
    adapter.on_load_checkpoint(checkpoint)
    assert list(checkpoint["state_dict"]) == list(adapter.state_dict())
    assert list(checkpoint["optimizer_states"][0]["param_group_of"]) == [key]
    assert checkpoint["optimizer_states"][1] == {"state": {0: {}}, "param_groups": [{"params": [0]}]}
    with pytest.raises(ValueError, match="maps two keys to 'same'"):
        rename_checkpoint_keys({"state_dict": {"a": 1, "b": 2}}, lambda key: "same")


def test_builds_from_a_config_with_the_same_weights_for_the_same_seed() -> None:
    config = tiny_config("llama", num_layers=2)
    one, two = (HuggingFaceCausalLM(config, attn_implementation="eager", seed=3) for _ in range(2))
    assert one.hf_config._attn_implementation == "eager"
    assert all(
        torch.equal(a, b) for a, b in zip(one.state_dict().values(), two.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize(("kind", "attn"), [("gpt2", "eager"), ("llama", "sdpa")])
def test_hparams_hold_the_config_and_load_from_checkpoint_restores_the_trained_weights(
    tmp_path: Path, kind: str, attn: str
) -> None:
    adapter = HuggingFaceCausalLM(tiny_model(kind, attn=attn, num_layers=2), lr=0.01)
    assert adapter.hparams["model"] == adapter.hf_config.to_dict()  # a plain dict, not the model
    assert adapter.hparams["attn_implementation"] == attn and adapter.hparams["lr"] == 0.01
    trainer = pl.Trainer(
        accelerator="cpu", precision="64-true", max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(adapter, DataLoader(PaddedBatches(8, "right"), batch_size=4))
    trainer.save_checkpoint(tmp_path / "hf.ckpt")  # one file, under the model's own names
    with trainer.init_module():  # float64, the trained precision
        loaded = HuggingFaceCausalLM.load_from_checkpoint(tmp_path / "hf.ckpt", weights_only=True)
    assert type(loaded.to_huggingface()) is type(adapter.to_huggingface())
    assert loaded.hf_config._attn_implementation == attn
    trained, state = adapter.state_dict(), loaded.state_dict()
    assert list(state) == list(trained)
    for key, value in trained.items():
        assert value.dtype == torch.float64 and torch.equal(state[key], value), key


# -- errors ----------------------------------------------------------------------------------------------


def test_an_unsupported_architecture_is_refused_naming_the_missing_pieces() -> None:
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64
    )
    with pytest.raises(TypeError, match=r"does not support the 'gpt_neox' model.*lacks .*decoder layer list"):
        HuggingFaceCausalLM(config)


def test_a_missing_piece_of_a_known_architecture_is_named() -> None:
    hf = tiny_model("llama", num_layers=2)
    del hf.model.rotary_emb
    with pytest.raises(TypeError, match=r"has no rotary module `model.rotary_emb`"):
        HuggingFaceCausalLM(hf)
    explicit = HFArchitecture(embedding="model.embed_tokens", layers="model.blocks", final_norm="model.norm")
    with pytest.raises(TypeError, match=r"no decoder layer list `model.blocks`"):
        HuggingFaceCausalLM(tiny_model("llama", num_layers=2), architecture=explicit)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(TypeError, match=r"takes a transformers causal-LM model, its config or the config's "):
        HuggingFaceCausalLM([])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="config dict with model_type=None, which transformers does not"):
        HuggingFaceCausalLM({})  # a dict is a config's to_dict() (hparams["model"])
    with pytest.raises(ValueError, match="set the attention implementation when building the model"):
        HuggingFaceCausalLM(tiny_model("gpt2", num_layers=1), attn_implementation="eager")
    with pytest.raises(ValueError, match=r"microbatches=0\) must be an integer >= 1"):
        HuggingFaceCausalLM(tiny_model("gpt2", num_layers=1), microbatches=0)


def test_bad_batches_are_named() -> None:
    adapter = HuggingFaceCausalLM(tiny_model("llama", num_layers=1))
    batch = _batch(2)
    with pytest.raises(TypeError, match="a dict with an `input_ids` tensor"):
        adapter.pipeline_batch(batch["input_ids"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"keys \['token_type_ids'\] that HuggingFaceCausalLM does not use"):
        adapter.pipeline_batch({**batch, "token_type_ids": batch["input_ids"]})
    with pytest.raises(ValueError, match=r"batch\['attention_mask'\] has shape \(2, 7\)"):
        adapter.pipeline_batch({**batch, "attention_mask": batch["attention_mask"][:, 1:]})


def test_a_side_input_the_blocks_need_that_the_batch_does_not_provide() -> None:
    class NoRotary(HuggingFaceCausalLM):
        def pipeline_batch(self, batch: Any) -> Any:
            inputs, target, side = super().pipeline_batch(batch)
            return inputs, target, {k: v for k, v in side.items() if not k.startswith("rotary")}

    adapter = NoRotary(tiny_model("llama", num_layers=1))
    spec = check_model_contract(adapter)
    with pytest.raises(TypeError, match=r"missing \['rotary_cos', 'rotary_sin'\] \(a block or part asks"):
        split_batch(adapter, spec, _batch(2))
    inputs, _, side = HuggingFaceCausalLM.pipeline_batch(adapter, _batch(2))
    del side["position_ids"]
    with pytest.raises(KeyError, match=r"layers\.0 asks for the side input 'position_ids'"):
        adapter._logits(inputs, side)
