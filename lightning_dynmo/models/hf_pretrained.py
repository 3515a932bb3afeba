"""Per-stage pretrained loading: a ``from_pretrained`` directory read tensor by tensor into a rank's units.

Read in this order: :func:`meta_model` (the model built on the meta device from the directory's
config) and :func:`real_rotary` (its rotary module made real), :class:`SafetensorsFiles` (which
``.safetensors`` file holds which tensor: one ``model.safetensors``, or the shards a
``model.safetensors.index.json`` lists), then :class:`PretrainedWeights` (fill one unit's tensors, under
the model's own names).

How it fits the strategy. :meth:`HuggingFaceCausalLM.from_pretrained
<lightning_dynmo.models.huggingface.HuggingFaceCausalLM.from_pretrained>` builds the adapter around a
meta-device model; ``DynMoStrategy`` cuts it and materialises only this rank's units
(:mod:`lightning_dynmo.pipeline.model.construction`), calling the adapter's ``pipeline_init_unit`` once per
unit, which reads that unit's tensors and nothing else (``safetensors.safe_open`` maps the file and
reads single tensors). So a rank allocates its stage's weights, not the model's.

Names. A unit key (``layers.3.layer.mlp.up_proj.weight``) becomes the model's own name with the adapter's
:class:`~lightning_dynmo.models.hf_architecture.NameMap`. A tensor the file does not hold under that name
is looked up under the names of the tensors it is tied to (``save_pretrained`` writes a tied head once,
under the embedding's name), then without the model's base prefix (checkpoints saved from the base
model, e.g. GPT-2's ``h.0.attn.c_attn.weight``). Model types whose tensors ``transformers`` converts while
loading (Mixtral: per-expert weights into fused ones) are refused up front.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "PretrainedWeights",
    "SafetensorsFiles",
    "meta_model",
    "real_rotary",
    "tied_names",
]

#: The weights file of an unsharded ``save_pretrained`` directory.
SINGLE_FILE = "model.safetensors"
#: The index of a sharded one (its ``weight_map``: tensor name -> shard file).
INDEX_FILE = "model.safetensors.index.json"


def meta_model(directory: Path, *, dtype: torch.dtype | None, attn_implementation: str | None) -> Any:
    """The directory's model, built from its config on the meta device in ``dtype``; nothing is read.

    Args:
        directory: A ``save_pretrained`` directory (its ``config.json``).
        dtype: The parameters' dtype; ``None`` takes the one the config records, else float32.
        attn_implementation: The attention implementation; ``None`` takes the library's default.

    Raises:
        ValueError: ``transformers`` converts this model type's tensors while loading (Mixtral's
            per-expert weights become fused ones), which per-stage loading does not do.
    """
    config = AutoConfig.from_pretrained(directory)
    if get_checkpoint_conversion_mapping(config.model_type):  # type: ignore[no-untyped-call]
        raise ValueError(
            f"per-stage loading cannot read the {config.model_type!r} checkpoint in {str(directory)!r}: "
            "transformers converts its tensors while loading (e.g. per-expert weights into fused ones), "
            "which HuggingFaceCausalLM.from_pretrained does not do. Load the whole model on each rank "
            "instead: HuggingFaceCausalLM(AutoModelForCausalLM.from_pretrained(directory))."
        )
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)  # type: ignore[no-untyped-call]


def real_rotary(model: nn.Module, path: str) -> None:
    """Rebuild the rotary module at ``path`` on the CPU, in place.

    Its buffers are computed from the config, not loaded, and it belongs to no unit: left on the meta
    device it would be the one meta tensor outside the units that the strategy refuses.
    """
    old = model.get_submodule(path)
    model.set_submodule(path, type(old)(config=model.config))


def tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter name of ``model`` -> the other names of the same tensor (empty when untied)."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return {name: tuple(n for n in names if n != name) for names in by_tensor.values() for name in names}


class SafetensorsFiles:
    """Which ``.safetensors`` file of a ``save_pretrained`` directory holds which tensor.

    Args:
        directory: The directory: ``model.safetensors``, or ``model.safetensors.index.json`` and its shards.

    Raises:
        FileNotFoundError: the directory has neither (the message says how to make them).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index, single = directory / INDEX_FILE, directory / SINGLE_FILE
        if index.is_file():
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            self._file_of = {key: directory / file for key, file in weight_map.items()}
            self.described = f"{index} (and the shards it lists)"
        elif single.is_file():
            with safe_open(single, framework="pt") as handle:
                self._file_of = dict.fromkeys(handle.keys(), single)
            self.described = str(single)
        else:
            found = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else "no such directory"
            raise FileNotFoundError(
                f"{str(directory)!r} holds no {SINGLE_FILE} nor {INDEX_FILE} (found: {found}); per-stage "
                "loading reads safetensors files. Write them with model.save_pretrained(directory) (a "
                "pytorch_model.bin checkpoint: load it once with from_pretrained and save_pretrained it "
                "again), or download the model's *.safetensors and *.json files with "
                "huggingface_hub.snapshot_download."
            )

    def file_of(self, key: str) -> Path | None:
        """The file holding ``key``, ``None`` if no file does."""
        return self._file_of.get(key)

    def read(self, key: str) -> Tensor:
        """The tensor ``key`` (held by some file), read on the CPU.

        The file is opened for this one tensor: ``safe_open`` maps it, and the mapped pages a read
        touches count as this process's resident memory until it is closed.
        """
        with safe_open(self._file_of[key], framework="pt", device="cpu") as handle:
            tensor: Tensor = handle.get_tensor(key)
        return tensor


class PretrainedWeights:
    """Fills a unit's tensors from a ``save_pretrained`` directory (see the module docstring).

    Args:
        files: The directory's safetensors files.
        to_huggingface: A unit key (``layers.3.layer.mlp.up_proj.weight``) -> the model's own name.
        aliases: The model's own name -> the names of the tensors tied to it (:func:`tied_names`).
        base_prefix: The model's ``base_model_prefix`` (``"model"``, ``"transformer"``), tried removed.
    """

    def __init__(
        self,
        files: SafetensorsFiles,
        to_huggingface: Callable[[str], str],
        aliases: Mapping[str, tuple[str, ...]],
        base_prefix: str,
    ) -> None:
        self.files, self._to_hf, self._aliases, self._base = files, to_huggingface, aliases, base_prefix

    def load_unit(self, name: str, unit: nn.Module) -> None:
        """Copy the unit's every parameter and persistent buffer from the files, in place.

        Args:
            name: The unit's name (``"layers.3"``, ``"embedding"``).
            unit: The unit, materialised (uninitialised storage).

        Raises:
            KeyError: a tensor is in no file (the message names it and where it was looked for).
            ValueError: a tensor's shape differs from the file's.
        """
        targets = unit.state_dict()  # detached views of the unit's own storage
        stored = {key: self._stored_name(f"{name}.{key}") for key in targets}  # every name checked first
        with torch.no_grad():
            for key, target in targets.items():
                value = self.files.read(stored[key])  # one tensor at a time: a unit is never held twice
                if value.shape != target.shape:
                    raise ValueError(
                        f"{stored[key]!r} in {self.files.file_of(stored[key])} has shape "
                        f"{tuple(value.shape)}, but unit {name!r} expects {tuple(target.shape)} for {key!r}: "
                        "the directory's config.json does not describe its weights; save them together with "
                        "save_pretrained."
                    )
                target.copy_(value)

    def _stored_name(self, unit_key: str) -> str:
        name = self._to_hf(unit_key)
        candidates = [name, *self._aliases.get(name, ())]
        prefix = f"{self._base}." if self._base else ""
        candidates += [c.removeprefix(prefix) for c in candidates if prefix and c.startswith(prefix)]
        for candidate in candidates:
            if self.files.file_of(candidate) is not None:
                return candidate
        raise KeyError(
            f"the pretrained checkpoint has no tensor {name!r} (unit key {unit_key!r}; also tried "
            f"{candidates[1:] or 'no other name'}) in {self.files.described}. The model built from its "
            "config.json expects it: check that config and weights belong together, and that the "
            "architecture recipe maps the unit to the model's own name (HFArchitecture paths)."
        )
