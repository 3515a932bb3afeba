"""Which weights global magnitude pruning may remove together: entries, 2:4 groups or square blocks.

Read in this order: :data:`PATTERNS`, :func:`check_pattern_shape`, :func:`pattern_scores` (what the
global selection ranks for each pattern), :func:`expand_unit_mask` (a selection back to one boolean
per weight), then :func:`is_two_four` and :func:`compress_two_four` (the 2:4 contract, checked on CPU).

Every pattern reuses the same exact, distributed selection
(:func:`~lightning_dynmo.dynamism.magnitude_select.select_global_pruning`) on the same cubic schedule:
only the units it ranks change, so the threshold stays global, exact and equal on every rank.

* ``"unstructured"``: the units are the entries, ranked by ``|w|`` (today's pruning). No GPU kernel
  makes this pay at the paper's sizes (the GPU checks of 2026-11-27/28 saw a 90% pruned block cost what
  a dense block costs), so on a GPU it is mask-only in effect; the CSR kernel exists for CPUs.
* ``"2:4"``: the units are entries, but in each group of 4 consecutive inputs of a row only the 2
  smallest magnitudes are candidates (the others rank above every candidate). The global threshold
  then picks among candidates, so a pruned entry always lies where a 2:4 pattern has its zeros, and at
  50% global sparsity, the most it can reach (``final_sparsity <= 0.5``), every layer is exactly 2:4.
  That is the layout torch's semi-structured kernels (cuSPARSELt, CUTLASS; CUDA only) multiply; on the
  way there some groups still keep 3 or 4 entries, and a layer runs the semi-structured kernel only
  once its mask is 2:4 (:func:`is_two_four`).
* ``"block"``: the units are ``block_size x block_size`` blocks, ranked by their L2 norm; a block is
  pruned whole. Every block holds as many entries, so a sparsity over blocks is the same sparsity
  over entries. That is the layout the BSR kernels multiply (``Tensor.to_sparse_bsr``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "PATTERNS",
    "check_pattern_shape",
    "compress_two_four",
    "expand_unit_mask",
    "is_two_four",
    "pattern_scores",
]

#: ``PruningConfig.pattern`` values.
PATTERNS = ("unstructured", "2:4", "block")

# A non-candidate's score: above every float magnitude, and finite (the selection refuses non-finite).
_NEVER = torch.finfo(torch.float64).max


def check_pattern_shape(name: str, shape: tuple[int, ...], pattern: str, block_size: int) -> None:
    """Raise ``ValueError`` naming the weight ``name`` if ``pattern`` cannot tile its ``[out, in]`` shape."""
    out_features, in_features = shape
    if pattern == "2:4" and in_features % 4:
        raise ValueError(
            f"PruningConfig.pattern='2:4' needs each weight's input size to be a multiple of 4; {name} is "
            f"{out_features}x{in_features}. Use pattern='unstructured' or a model whose widths divide by 4."
        )
    if pattern == "block" and (out_features % block_size or in_features % block_size):
        raise ValueError(
            f"PruningConfig.block_size={block_size} does not tile {name} ({out_features}x{in_features}): "
            "both sizes must be multiples of it. Pick a block_size dividing every prunable weight's sizes."
        )


def pattern_scores(weight: Tensor, mask: Tensor, pattern: str, block_size: int) -> tuple[Tensor, Tensor]:
    """What the global selection ranks for one weight, and which of those units are still kept.

    Args:
        weight: ``[out, in]``.
        mask: ``[out, in]`` boolean, ``True`` where kept.
        pattern: One of :data:`PATTERNS`.
        block_size: The block side for ``"block"``.

    Returns:
        ``(scores, kept)``: float64 scores (lower is pruned first) and the boolean kept mask, both of the
        unit shape: ``[out, in]`` for ``"unstructured"`` and ``"2:4"``, ``[out / b, in / b]`` for
        ``"block"``.
    """
    magnitude = weight.detach().abs().to(torch.float64)
    if pattern == "unstructured":
        return magnitude, mask
    out_features, in_features = weight.shape
    if pattern == "2:4":
        groups = magnitude.reshape(out_features, in_features // 4, 4)
        rank = groups.argsort(dim=-1, stable=True).argsort(dim=-1)  # 0 = smallest in its group
        scores = groups.masked_fill(rank >= 2, _NEVER).reshape(out_features, in_features)
        return scores, mask
    b = block_size
    blocks = magnitude.reshape(out_features // b, b, in_features // b, b)
    kept = mask.reshape(out_features // b, b, in_features // b, b).all(dim=3).all(dim=1)
    return blocks.square().sum(dim=(1, 3)).sqrt(), kept


def expand_unit_mask(unit_mask: Tensor, pattern: str, block_size: int) -> Tensor:
    """A selection's unit mask as one boolean per weight entry."""
    if pattern != "block":
        return unit_mask
    expanded: Tensor = unit_mask.repeat_interleave(block_size, dim=0).repeat_interleave(block_size, dim=1)
    return expanded


def is_two_four(mask: Tensor) -> bool:
    """Whether every group of 4 consecutive entries of each row of ``mask`` keeps at most 2."""
    out_features, in_features = mask.shape
    if in_features % 4:
        return False
    return bool((mask.reshape(out_features, in_features // 4, 4).sum(dim=-1) <= 2).all())


def compress_two_four(weight: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """The 2:4 compressed form of a masked weight: what semi-structured kernels store, on any device.

    Each group of 4 keeps 2 values and their positions in the group (kept entries first, in order; a
    group with fewer kept entries stores zeros at pruned positions). Multiplying with it is the masked
    dense product; ``tests/unit/dynamism/test_pruning_patterns.py`` checks that on CPU, where torch's
    ``to_sparse_semi_structured`` does not run.

    Returns:
        ``(values, positions)``, each ``[out, in / 2]``; ``positions`` in ``0..3``.

    Raises:
        ValueError: ``mask`` is not a 2:4 sub-pattern.
    """
    if not is_two_four(mask):
        raise ValueError("compress_two_four: the mask keeps more than 2 of some group of 4 entries.")
    out_features, in_features = weight.shape
    groups = mask.reshape(out_features, in_features // 4, 4)
    order = (~groups).to(torch.int8).argsort(dim=-1, stable=True)[..., :2]  # kept first, in position order
    values = (weight * mask).reshape(out_features, in_features // 4, 4).gather(-1, order)
    return values.reshape(out_features, in_features // 2), order.reshape(out_features, in_features // 2)
