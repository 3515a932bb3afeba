"""Where a Hugging Face causal LM keeps the pieces DynMo pipelines, and their state-dict names.

Read in this order: :class:`HFArchitecture` (one recipe: the paths of the embedding, the decoder layers,
the final norm, the head, and the optional position embedding, embedding dropout, rotary module and
MoE router), :data:`ARCHITECTURES` (the recipes for the model types we test), :func:`find_pieces` (resolve
a recipe on a model, with an error naming every missing piece), then :class:`NameMap` (the adapter's unit
names <-> the model's own state-dict names).

A recipe only names where the model's own modules live; the adapter calls them as the model's own
``forward`` does (embedding [+ positions, dropout] -> decoder layers, each with the causal mask and the
rotary cos/sin -> final norm -> head). A model type whose ``forward`` does more between those pieces (an
embedding scale, a per-layer residual trick) needs its own code, which is why unknown model types are
refused instead of guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import nn

__all__ = ["ARCHITECTURES", "ROLES", "HFArchitecture", "NameMap", "Pieces", "find_pieces"]

#: The adapter's attribute name for each part, in pipeline order (first-stage parts, then last-stage).
ROLES = ("embedding", "position_embedding", "embedding_dropout", "final_norm", "head")
FIRST_ROLES = ("embedding", "position_embedding", "embedding_dropout")
LAST_ROLES = ("final_norm", "head")


@dataclass(frozen=True, kw_only=True)
class HFArchitecture:
    """Where one family of Hugging Face causal LMs keeps its pieces (dotted paths from the CausalLM root).

    Attributes:
        embedding: The token embedding (``"model.embed_tokens"``).
        layers: The ``nn.ModuleList`` of decoder layers (``"model.layers"``).
        final_norm: The norm after the last layer (``"model.norm"``).
        head: The vocabulary projection (``"lm_head"``).
        position_embedding: Learned absolute positions added to the token embedding (GPT-2's ``wpe``).
        embedding_dropout: Dropout applied to the embedded tokens (GPT-2's ``drop``).
        rotary: The rotary module computing ``(cos, sin)`` from position ids (``"model.rotary_emb"``);
            it holds only non-persistent buffers, so every rank keeps its own.
        router: Path inside each decoder layer of the MoE router, a module whose output (or output's
            first element) is the router logits ``[tokens, experts]`` (Mixtral: ``"mlp.gate"``).
    """

    embedding: str
    layers: str
    final_norm: str
    head: str = "lm_head"
    position_embedding: str | None = None
    embedding_dropout: str | None = None
    rotary: str | None = None
    router: str | None = None

    def part_paths(self) -> dict[str, str]:
        """The adapter's part attribute name -> the model's path, for the parts this family has."""
        paths = {role: getattr(self, role) for role in ROLES}
        return {role: path for role, path in paths.items() if path is not None}


_LLAMA_LIKE = HFArchitecture(
    embedding="model.embed_tokens", layers="model.layers", final_norm="model.norm", rotary="model.rotary_emb"
)

#: Recipes of the model types the adapter is tested on (``config.model_type`` -> recipe).
ARCHITECTURES: Mapping[str, HFArchitecture] = {
    "gpt2": HFArchitecture(
        embedding="transformer.wte",
        position_embedding="transformer.wpe",
        embedding_dropout="transformer.drop",
        layers="transformer.h",
        final_norm="transformer.ln_f",
    ),
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "mixtral": replace(_LLAMA_LIKE, router="mlp.gate"),
}

_WHAT = {
    "embedding": "token embedding",
    "layers": "decoder layer list",
    "final_norm": "final norm",
    "head": "output head",
    "position_embedding": "position embedding",
    "embedding_dropout": "embedding dropout",
    "rotary": "rotary module",
    "router": "MoE router (inside each decoder layer)",
}


@dataclass(frozen=True)
class Pieces:
    """The model's own modules found by a recipe.

    Attributes:
        parts: The adapter's part name -> module (first-stage parts first, then last-stage ones).
        layers: The decoder layers in order.
        rotary: The rotary module, if the family has one.
    """

    parts: dict[str, nn.Module]
    layers: list[nn.Module]
    rotary: nn.Module | None


def find_pieces(model: nn.Module, architecture: HFArchitecture | None = None) -> Pieces:
    """Resolve ``architecture`` (default: the recipe of the model's ``config.model_type``) on ``model``.

    Raises:
        TypeError: the model type has no recipe and none was given, or a piece the recipe names is
            missing; the message lists every missing piece by path and says how to fix it.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = f"{model_type!r} model ({type(model).__name__})"
    if architecture is None:
        if model_type not in ARCHITECTURES:
            found, missing = _survey(model, _LLAMA_LIKE)
            raise TypeError(
                f"HuggingFaceCausalLM does not support the {name}: it knows the model types "
                f"{sorted(ARCHITECTURES)}. Looked up with the Llama layout, it has {found or 'none of them'} "
                f"and "
                f"lacks {missing or 'nothing'}. If its forward is embedding -> decoder layers (causal mask, "
                "rotary cos/sin) -> final norm -> head and nothing else, pass "
                "architecture=HFArchitecture(embedding=..., layers=..., final_norm=..., rotary=...) with its "
                "paths; otherwise it needs an adapter of its own."
            )
        architecture = ARCHITECTURES[str(model_type)]
    found, missing = _survey(model, architecture)
    if missing:
        raise TypeError(
            f"HuggingFaceCausalLM cannot pipeline the {name}: it has no {'; no '.join(missing)} (found "
            f"{found or 'none of the pieces'}). Pass architecture=HFArchitecture(...) with the paths where "
            "this model keeps these pieces."
        )
    layers = list(_get(model, architecture.layers))
    parts = {role: _get(model, path) for role, path in architecture.part_paths().items()}
    rotary = _get(model, architecture.rotary) if architecture.rotary else None
    return Pieces(
        parts={k: v for k, v in parts.items() if isinstance(v, nn.Module)},
        layers=layers,
        rotary=rotary,
    )


def _survey(model: nn.Module, architecture: HFArchitecture) -> tuple[list[str], list[str]]:
    found: list[str] = []
    missing: list[str] = []
    for field in fields(architecture):
        path = getattr(architecture, field.name)
        if path is None or field.name == "router":
            continue
        module = _get(model, path)
        if field.name == "layers":
            ok = isinstance(module, nn.ModuleList) and len(module) > 0
        else:
            ok = module is not None
        (found if ok else missing).append(f"{_WHAT[field.name]} `{path}`")
    layers = _get(model, architecture.layers)
    if architecture.router is not None and isinstance(layers, nn.ModuleList):
        lacking = [i for i, layer in enumerate(layers) if _get(layer, architecture.router) is None]
        target = f"{_WHAT['router']} `{architecture.layers}.<i>.{architecture.router}`"
        (missing if lacking else found).append(target + (f" in layers {lacking}" if lacking else ""))
    return found, missing


def _get(root: nn.Module, path: str) -> Any:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


class NameMap:
    """The adapter's state-dict names <-> the Hugging Face model's own.

    The adapter holds each decoder layer as ``layers.<i>.layer`` and each part under its role name
    (``embedding``, ``head``, ...); the model holds them as ``<architecture.layers>.<i>`` and at the
    part's path (``model.embed_tokens``, ``lm_head``).

    Args:
        architecture: The recipe the adapter was built with.
        block_child: The attribute under which a block holds the decoder layer.
    """

    def __init__(self, architecture: HFArchitecture, block_child: str) -> None:
        self._to_hf = {f"{role}.": f"{path}." for role, path in architecture.part_paths().items()}
        self._layers = architecture.layers
        self._child = block_child

    def to_huggingface(self, key: str) -> str:
        """``"layers.3.layer.mlp.up_proj.weight"`` -> ``"model.layers.3.mlp.up_proj.weight"``.

        Raises:
            KeyError: ``key`` belongs to no unit of the adapter.
        """
        if key.startswith("layers."):
            index, _, rest = key.removeprefix("layers.").partition(".")
            child, _, leaf = rest.partition(".")
            if child == self._child and index.isdigit() and leaf:
                return f"{self._layers}.{index}.{leaf}"
        for ours, theirs in self._to_hf.items():
            if key.startswith(ours):
                return theirs + key.removeprefix(ours)
        raise KeyError(
            f"{key!r} is not a key of HuggingFaceCausalLM's units (layers.<i>.{self._child}.*, "
            f"{', '.join(k + '*' for k in self._to_hf)}); only unit state can be given Hugging Face names."
        )

    def from_huggingface(self, key: str) -> str | None:
        """The inverse of :meth:`to_huggingface`; ``None`` for a key that is not a Hugging Face name."""
        prefix = self._layers + "."
        if key.startswith(prefix):
            index, _, leaf = key.removeprefix(prefix).partition(".")
            if index.isdigit() and leaf:
                return f"layers.{index}.{self._child}.{leaf}"
        for ours, theirs in self._to_hf.items():
            if key.startswith(theirs):
                return ours + key.removeprefix(theirs)
        return None
