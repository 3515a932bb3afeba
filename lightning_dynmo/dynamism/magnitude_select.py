"""One global magnitude threshold over a model split across ranks, found without gathering its weights.

Read in this order: :func:`select_global_pruning` (the contract), :func:`_radix_select` (how the exact
k-th smallest magnitude is found from histograms), :func:`_prune_ties` (who is pruned among equal
magnitudes), then :class:`Selection`.

What is selected. The prunable weights of the whole model are spread over the ranks of ``group`` (a
pipeline: each rank holds some layers; data-parallel replicas each run their own pipeline group and,
holding the same weights, select the same entries). For a target sparsity ``s`` over the ``M`` prunable
entries, ``k = floor(s * M + 1/2)`` entries must be zero afterwards (the nearest integer, halves up). Entries
pruned before stay pruned and count towards ``k`` (pruning never revives a weight); the other
``k - already`` are the smallest magnitudes ``|w|`` among the kept entries, ties broken by **global
order**: lower layer index first, then the order of the layer's weights as given (module order), then
row-major position inside the weight. The result is exactly what one process holding the whole model
gets by a stable sort of all magnitudes in that order (``tests/distributed/test_pruning_threshold.py``).

How, without gathering. A non-negative IEEE float orders like its bit pattern read as an integer, so the
k-th smallest magnitude (as float64, exact for every float format torch trains in) is found digit by
digit, most significant byte first (a radix select): each rank counts its candidates per value of the
next byte (256 counters), the counters are summed over ``group`` (one all-reduce), the byte whose
cumulative count reaches ``k`` is fixed, and only candidates with that prefix stay. After 8 rounds the
full 64-bit pattern, i.e. the exact k-th magnitude ``T``, is known everywhere. Everything below ``T`` is
pruned; of the entries equal to ``T`` exactly as many as still needed are pruned, in global order (one
all-reduce of per-layer tie counts). Traffic per pruning step: 11 all-reduces of at most
``max(256, 2 * num_layers)`` integers, independent of the model size; the paper's reference code sends
every rank's local top-k to one rank instead.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PrunableWeight", "Selection", "magnitude_keys", "num_to_prune", "select_global_pruning"]

_DIGIT_BITS = 8
_KEY_BITS = 64


@dataclass(frozen=True)
class PrunableWeight:
    """One prunable weight held by this rank.

    Attributes:
        layer: The global index of the layer it belongs to (its place in the global order).
        name: Its name for logs and errors (e.g. ``"layers.3.attn.qkv.weight"``).
        weight: The weight (any float dtype, any device).
        mask: Boolean, same shape: ``True`` where the entry is kept, ``False`` where already pruned.
    """

    layer: int
    name: str
    weight: Tensor
    mask: Tensor


@dataclass(frozen=True)
class Selection:
    """What :func:`select_global_pruning` decided; identical on every rank of the group but ``masks``.

    Attributes:
        masks: The new mask of each of this rank's weights, in the order given (``True`` = kept).
        sparsity: The fraction of all prunable entries that are pruned now (``num_pruned / num_prunable``).
        num_prunable: ``M``, the prunable entries of the whole model.
        num_pruned: The pruned entries of the whole model now (``k``, or more if more were pruned before).
        threshold: The largest magnitude pruned by this selection (the k-th smallest), ``None`` when it
            pruned nothing new.
        layer_kept: Per global layer, its kept entries (0 for a layer without prunable weights).
        layer_total: Per global layer, its prunable entries.
    """

    masks: list[Tensor]
    sparsity: float
    num_prunable: int
    num_pruned: int
    threshold: float | None
    layer_kept: tuple[int, ...]
    layer_total: tuple[int, ...]

    def layer_sparsity(self, layer: int) -> float:
        """The fraction of ``layer``'s prunable entries that are pruned (0 without prunable weights)."""
        total = self.layer_total[layer]
        return 1.0 - self.layer_kept[layer] / total if total else 0.0


def num_to_prune(sparsity: float, num_prunable: int) -> int:
    """``k``: the nearest integer to ``sparsity * num_prunable`` (halves round up)."""
    return min(num_prunable, math.floor(sparsity * num_prunable + 0.5))


def magnitude_keys(weight: Tensor) -> Tensor:
    """``|w|`` as float64 read as int64, flattened: integers that order exactly like the magnitudes."""
    return weight.detach().abs().to(torch.float64).reshape(-1).contiguous().view(torch.int64)


def select_global_pruning(
    weights: Sequence[PrunableWeight],
    sparsity: float,
    *,
    num_layers: int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> Selection:
    """Masks that prune the model's smallest magnitudes up to ``sparsity``, over every rank of ``group``.

    Collective over ``group`` (every rank calls it, with its own weights, in the same order of calls);
    ``group=None`` means this process holds the whole model (no communication).

    Args:
        weights: This rank's prunable weights, ordered by layer and, within a layer, in module order.
        sparsity: The target fraction of pruned entries over the whole model, in ``[0, 1)``.
        num_layers: The model's number of layers (global indices are ``0 .. num_layers - 1``).
        group: The ranks that together hold every layer exactly once (a pipeline group), or ``None``.
        device: Where the counters travel (``cuda`` for NCCL); ``None``: CPU.

    Raises:
        ValueError: ``sparsity`` outside ``[0, 1)``, a layer index outside the model, weights out of
            global order, or a non-finite prunable weight on any rank (raised on every rank).
    """
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(
            f"select_global_pruning: sparsity={sparsity!r} must be a fraction in [0, 1), e.g. 0.9."
        )
    _check_order(weights, num_layers)
    device = device or torch.device("cpu")
    total, pruned, nonfinite = _all_reduce(
        [
            sum(w.mask.numel() for w in weights),
            sum(int((~w.mask).sum()) for w in weights),
            sum(int((~torch.isfinite(w.weight.detach())).sum()) for w in weights),
        ],
        group,
        device,
    )
    if nonfinite:
        mine = [w.name for w in weights if not bool(torch.isfinite(w.weight.detach()).all())]
        raise ValueError(
            f"select_global_pruning: {nonfinite} prunable weight entries are NaN or infinite (here: "
            f"{mine or 'none'}); magnitudes cannot be ranked. Fix the divergence (lower the learning rate, "
            "clip gradients) before pruning."
        )
    need = num_to_prune(sparsity, total) - pruned
    keys = [magnitude_keys(w.weight) for w in weights]
    masks = [w.mask.clone() for w in weights]
    threshold: float | None = None
    if need > 0:
        candidates = [k[m.reshape(-1)] for k, m in zip(keys, masks, strict=True)]
        key, ties_to_prune = _radix_select(candidates, need, group, device)
        threshold = float(torch.tensor(key, dtype=torch.int64).view(torch.float64))
        for k, m in zip(keys, masks, strict=True):
            m.view(-1).logical_and_(k >= key)  # everything below the threshold goes
        _prune_ties(weights, keys, masks, key, ties_to_prune, num_layers, group, device)
    per_layer = [0] * (2 * num_layers)
    for w, m in zip(weights, masks, strict=True):
        per_layer[2 * w.layer] += int(m.sum())
        per_layer[2 * w.layer + 1] += m.numel()
    per_layer = _all_reduce(per_layer, group, device)
    kept = sum(per_layer[0::2])
    return Selection(
        masks=masks,
        sparsity=(total - kept) / total if total else 0.0,
        num_prunable=total,
        num_pruned=total - kept,
        threshold=threshold,
        layer_kept=tuple(per_layer[0::2]),
        layer_total=tuple(per_layer[1::2]),
    )


def _radix_select(
    candidates: list[Tensor], rank_k: int, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[int, int]:
    """The ``rank_k``-th smallest key (1-based) over every rank's candidates, and how many keys equal to it
    are among the ``rank_k`` smallest."""
    prefix = 0
    for shift in range(_KEY_BITS - _DIGIT_BITS, -1, -_DIGIT_BITS):
        digits = [(c >> shift) & ((1 << _DIGIT_BITS) - 1) for c in candidates]
        counts = torch.zeros(1 << _DIGIT_BITS, dtype=torch.int64)
        for d in digits:
            counts += torch.bincount(d, minlength=1 << _DIGIT_BITS).cpu()
        cumulative = list(_accumulate(_all_reduce(counts.tolist(), group, device)))
        digit = bisect.bisect_left(cumulative, rank_k)
        rank_k -= cumulative[digit - 1] if digit else 0
        prefix = (prefix << _DIGIT_BITS) | digit
        candidates = [c[d == digit] for c, d in zip(candidates, digits, strict=True)]
    return prefix, rank_k


def _prune_ties(
    weights: Sequence[PrunableWeight],
    keys: list[Tensor],
    masks: list[Tensor],
    key: int,
    ties_to_prune: int,
    num_layers: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Prune ``ties_to_prune`` of the kept entries whose key is ``key``, first in global order."""
    ties = [(k == key) & m.view(-1) for k, m in zip(keys, masks, strict=True)]
    per_layer = [0] * num_layers
    for w, t in zip(weights, ties, strict=True):
        per_layer[w.layer] += int(t.sum())
    per_layer = _all_reduce(per_layer, group, device)
    before = [0, *_accumulate(per_layer)]  # ties in the layers before each layer
    quota = {
        layer: max(0, min(per_layer[layer], ties_to_prune - before[layer])) for layer in range(num_layers)
    }
    for w, t, m in zip(weights, ties, masks, strict=True):
        take = min(quota[w.layer], int(t.sum()))
        if take:
            m.view(-1)[t.nonzero().reshape(-1)[:take]] = False
            quota[w.layer] -= take


def _check_order(weights: Sequence[PrunableWeight], num_layers: int) -> None:
    layers = [w.layer for w in weights]
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"select_global_pruning: layer indices {bad} are outside the model's {num_layers} layers; give "
            "each weight the global index of its layer."
        )
    if layers != sorted(layers):
        raise ValueError(
            f"select_global_pruning: weights come in layer order {layers}; give them by increasing layer "
            "index (ties are broken in global order)."
        )
    for w in weights:
        if w.mask.dtype != torch.bool or w.mask.shape != w.weight.shape:
            raise ValueError(
                f"select_global_pruning: the mask of {w.name} must be a bool tensor of the weight's shape "
                f"{tuple(w.weight.shape)}, got {w.mask.dtype} {tuple(w.mask.shape)}."
            )


def _accumulate(values: Sequence[int]) -> list[int]:
    out, running = [], 0
    for v in values:
        running += v
        out.append(running)
    return out


def _all_reduce(values: Sequence[int], group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """The element-wise sum of ``values`` over ``group`` (``None``: this process only)."""
    if group is None:
        return list(values)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=device)
    dist.all_reduce(tensor, group=group)
    return [int(v) for v in tensor.tolist()]
