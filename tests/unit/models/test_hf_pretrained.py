"""HuggingFaceCausalLM.from_pretrained in one process: unit by unit, the weights ``from_pretrained`` loads.

A tiny model is saved with ``save_pretrained`` (one file, or shards with their index) and loaded two ways:
the library's ``AutoModelForCausalLM.from_pretrained`` and the adapter's meta-device build, materialised
unit by unit. Every tensor must be equal; materialising some units reads only theirs; each failure names
what is wrong. Per rank under ``DynMoStrategy``: ``tests/distributed/test_huggingface_pretrained.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from lightning_dynmo.models.hf_pretrained import SafetensorsFiles
from lightning_dynmo.models.huggingface import HuggingFaceCausalLM
from lightning_dynmo.pipeline.model.construction import keep_local_units, materialize_model
from lightning_dynmo.pipeline.model.contract import check_model_contract
from tests.distributed.hf_reference import tiny_model, transformers


def _save(tmp_path: Path, kind: str, shard: str | None = None, dtype: torch.dtype = torch.float64) -> Path:
    directory = tmp_path / kind
    tiny_model(kind).to(dtype).save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return directory


def _reference(directory: Path, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    return dict(model.state_dict())


@pytest.mark.parametrize(
    ("kind", "shard", "dtype"),
    [
        ("llama", None, torch.float64),
        ("llama", None, torch.float32),
        ("gpt2", "20KB", torch.float64),  # a tied head, sharded over several files with their index
        ("qwen2", "20KB", torch.float32),
    ],
)
def test_every_unit_loads_the_weights_from_pretrained_loads(
    tmp_path: Path, kind: str, shard: str | None, dtype: torch.dtype
) -> None:
    directory = _save(tmp_path, kind, shard, dtype)
    assert (directory / "model.safetensors.index.json").is_file() == (shard is not None)
    model = HuggingFaceCausalLM.from_pretrained(directory)
    assert all(p.is_meta for p in model.parameters())  # nothing read before materialisation
    materialize_model(model)
    loaded, expected = model.huggingface_state_dict(), _reference(directory, dtype)
    assert set(loaded) == set(expected)
    for key, value in loaded.items():
        assert value.dtype == dtype and torch.equal(value, expected[key]), key
    if kind == "gpt2":
        assert model.head.weight is model.embedding.weight  # the tie survives materialisation
    batch = torch.randint(1, 64, (2, 8))
    with torch.no_grad():
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        assert torch.equal(model(batch), reference(batch).logits)


def test_a_rank_reads_and_holds_only_its_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = _save(tmp_path, "llama", "20KB")
    read: list[str] = []
    original = SafetensorsFiles.read

    def spy(self: SafetensorsFiles, key: str) -> torch.Tensor:
        read.append(key)
        return original(self, key)

    monkeypatch.setattr(SafetensorsFiles, "read", spy)
    model = HuggingFaceCausalLM.from_pretrained(directory, dtype=torch.float64)
    owned = ["layers.2", "layers.3", "final_norm", "head"]
    keep_local_units(model, check_model_contract(model), owned, device=torch.device("cpu"))
    expected = {k: v for k, v in _reference(directory).items() if k.startswith(("model.layers.2.",
                "model.layers.3.", "model.norm.", "lm_head."))}  # fmt: skip
    assert sorted(read) == sorted(expected)
    held = model.huggingface_state_dict()
    assert set(held) == set(expected) and all(torch.equal(held[k], expected[k]) for k in held)
    assert model.embedding is None and sorted(model.layers) == ["2", "3"]


def test_a_missing_tensor_names_the_key_and_the_file(tmp_path: Path) -> None:
    directory = _save(tmp_path, "llama")
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    model = HuggingFaceCausalLM.from_pretrained(directory)
    with pytest.raises(
        KeyError, match=r"no tensor 'model\.layers\.1\.mlp\.up_proj\.weight'.*model\.safetensors"
    ):
        materialize_model(model)


def test_a_wrong_architecture_map_fails_naming_the_key(tmp_path: Path) -> None:
    # Negative control of the renaming: a recipe that maps the units to other names finds nothing.
    directory = _save(tmp_path, "gpt2")
    model = HuggingFaceCausalLM.from_pretrained(directory)
    model._names._to_hf["final_norm."] = "transformer.ln_x."
    with pytest.raises(KeyError, match=r"no tensor 'transformer\.ln_x\.weight'.*HFArchitecture"):
        materialize_model(model)


def test_a_shape_that_differs_from_the_config_is_refused(tmp_path: Path) -> None:
    directory = _save(tmp_path, "llama")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    model = HuggingFaceCausalLM.from_pretrained(directory)
    with pytest.raises(ValueError, match=r"'model\.layers\.\d\.mlp\.\w+_proj\.weight' in .* has shape"):
        materialize_model(model)


def test_a_directory_without_safetensors_says_how_to_make_them(tmp_path: Path) -> None:
    directory = _save(tmp_path, "llama")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors nor .*save_pretrained"):
        HuggingFaceCausalLM.from_pretrained(directory)


def test_a_checkpoint_that_transformers_converts_while_loading_is_refused(tmp_path: Path) -> None:
    directory = _save(tmp_path, "mixtral")
    with pytest.raises(ValueError, match=r"cannot read the 'mixtral' checkpoint.*converts its tensors"):
        HuggingFaceCausalLM.from_pretrained(directory)


def test_a_meta_model_without_a_directory_is_refused() -> None:
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(tiny_model("gpt2").config)
    model = HuggingFaceCausalLM(meta)
    with pytest.raises(TypeError, match=r"no weights to load.*HuggingFaceCausalLM\.from_pretrained"):
        materialize_model(model)
