"""Rename a Lightning checkpoint's parameter keys: its model state and DynMo's name-keyed optimizer state.

A model whose checkpoint should carry other names than its units' (an adapter that keeps a Hugging Face
model's own state-dict names, ``model.layers.3.mlp.up_proj.weight`` instead of
``layers.3.layer.mlp.up_proj.weight``) renames the keys in its ``on_save_checkpoint`` hook and renames
them back in ``on_load_checkpoint``. Lightning calls both hooks on every rank, after the strategy
gathered the state when saving and before it loads the units when loading, so the strategy sees its own
names and the file holds the model's. Optimizer states in torch's positional format (a single-process
checkpoint) have no names and are left as they are.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

__all__ = ["rename_checkpoint_keys"]


def rename_checkpoint_keys(checkpoint: MutableMapping[str, Any], rename: Callable[[str], str]) -> None:
    """Rename, in place, every key of ``checkpoint["state_dict"]`` and of its name-keyed optimizer states.

    Args:
        checkpoint: A Lightning checkpoint dict (``"state_dict"``, optionally ``"optimizer_states"``).
        rename: Maps an old key to its new name (return the key itself to keep it).

    Raises:
        ValueError: two keys would get the same new name.
    """
    state = checkpoint.get("state_dict")
    if isinstance(state, MutableMapping):
        checkpoint["state_dict"] = _renamed(state, rename, "state_dict")
    for k, optimizer in enumerate(checkpoint.get("optimizer_states") or ()):
        if isinstance(optimizer, MutableMapping) and "param_group_of" in optimizer and "state" in optimizer:
            where = f"optimizer_states[{k}]"
            optimizer["param_group_of"] = _renamed(optimizer["param_group_of"], rename, where)
            optimizer["state"] = _renamed(optimizer["state"], rename, where)


def _renamed(entries: MutableMapping[str, Any], rename: Callable[[str], str], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in entries.items():
        new = rename(key)
        if new in out:
            raise ValueError(
                f"renaming checkpoint['{where}'] maps two keys to {new!r} (one of them {key!r}); the "
                "renaming "
                "must be one-to-one."
            )
        out[new] = value
    return out
