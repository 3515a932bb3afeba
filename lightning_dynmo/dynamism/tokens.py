"""Running a transformer block on some of the tokens only: which, laid out how, attended how, counted how.

Read in this order: :func:`select_tokens` and :class:`TokenSelection` (a boolean ``[batch, seq]`` mask
becomes flat and per-row padded indices), :func:`attend_from_subset` and :func:`attend_within_subset`
(causal attention whose queries are the selected tokens), then :class:`TokenCounts` (how many tokens a
block processed: the per-layer work signal) and :func:`token_counts`.

Early exit and Mixture of Depths run a block on part of the tokens, and the block must really get
cheaper for it. So the work is done on the gathered tokens, never as a masked computation over all of
them: projections and the MLP run on a ``[n, d_model]`` matrix of the ``n`` selected tokens; attention
runs on a ``[batch, width, ...]`` layout where each row holds its selected tokens in sequence order,
padded to the busiest row (``width`` = its count). Rows of one micro-batch rarely differ much, so the
padding is small next to what is saved.

**Shape buckets.** On a GPU every new token count is a new matrix shape and a new allocation size (the
GPU check saw single steps of these blocks stall at 3-20x their steady cost as the counts moved; new
shapes and the allocator are the suspects). With a ``bucket``,
:func:`select_tokens` rounds both the number of gathered tokens and the row width up to a multiple of
it (capped at the grid), so a block sees at most ``batch * seq / bucket`` shapes. The extra gathered
rows repeat the first selected token and the extra row slots are marked invalid: their results are
dropped by :meth:`TokenSelection.scatter` and :meth:`TokenSelection.pad`, so they change no output and
no gradient (a dropped row's gradient is exactly zero), and :attr:`TokenSelection.count` stays the real
count, which is what the statistics record. A loss computed on gathered rows must ignore the padding
(:meth:`TokenSelection.fill_padding`).

Where the results go back (:meth:`TokenSelection.scatter`), the tokens not selected keep their input
values bit for bit: they are copied, not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.models.dense import CausalSelfAttention
from lightning_dynmo.pipeline.step.stage import in_shape_inference

__all__ = [
    "TokenCounts",
    "TokenSelection",
    "attend_from_subset",
    "attend_within_subset",
    "check_token_bucket",
    "select_tokens",
    "token_counts",
    "touch_parameters",
    "training_forward",
]


@dataclass(frozen=True)
class TokenSelection:
    """The selected tokens of a ``[batch, seq]`` grid, flat and per row (see :func:`select_tokens`).

    Gathered tensors have :attr:`padded_count` rows: the :attr:`count` selected tokens in :attr:`flat`
    order, then (with a bucket) copies of the first one, whose results are dropped.

    Attributes:
        flat: ``[n]`` index of each selected token in the row-major ``[batch * seq]`` grid, ascending.
        slots: ``[n]`` index of each selected token in the row-major ``[batch * width]`` padded layout.
        positions: ``[batch, width]`` sequence position of each slot (0 on padding).
        valid: ``[batch, width]`` whether the slot holds a selected token.
        batch: Rows of the grid.
        seq: Tokens per row.
        width: The most tokens selected in one row, rounded up to the bucket (capped at ``seq``).
        padded_count: Rows of a gathered tensor: the count rounded up to the bucket (capped at
            ``batch * seq``); the count itself without a bucket.
    """

    flat: Tensor
    slots: Tensor
    positions: Tensor
    valid: Tensor
    batch: int
    seq: int
    width: int
    padded_count: int

    @property
    def count(self) -> int:
        """How many tokens are selected (padding excluded)."""
        return int(self.flat.numel())

    def gather(self, x: Tensor) -> Tensor:
        """``[batch, seq, ...] -> [padded_count, ...]``: the selected tokens' entries, then the padding."""
        return x.reshape(self.batch * self.seq, *x.shape[2:]).index_select(0, self._padded(self.flat))

    def scatter(self, base: Tensor, values: Tensor) -> Tensor:
        """A copy of ``base`` (``[batch, seq, ...]``) whose selected tokens hold ``values``' first rows.

        ``values`` is ``[padded_count, ...]`` (or ``[count, ...]``); padding rows are dropped.
        """
        flat = base.reshape(self.batch * self.seq, *base.shape[2:])
        return flat.index_copy(0, self.flat, values[: self.count]).view_as(base)

    def pad(self, values: Tensor) -> Tensor:
        """``[padded_count, ...] -> [batch, width, ...]`` with zeros on padding (padding rows dropped)."""
        padded = values.new_zeros((self.batch * self.width, *values.shape[1:]))
        rows = values[: self.count]
        return padded.index_copy(0, self.slots, rows).view(self.batch, self.width, *values.shape[1:])

    def unpad(self, padded: Tensor) -> Tensor:
        """``[batch, width, ...] -> [padded_count, ...]``: the inverse of :meth:`pad`."""
        flat = padded.reshape(self.batch * self.width, *padded.shape[2:])
        return flat.index_select(0, self._padded(self.slots))

    def fill_padding(self, gathered: Tensor, value: float) -> Tensor:
        """A copy of ``gathered`` (``[padded_count, ...]``) whose padding rows hold ``value``.

        E.g. ``fill_padding(selection.gather(labels), -100)``: cross-entropy then ignores the padding.
        """
        if self.padded_count == self.count:
            return gathered
        filled = gathered.clone()
        filled[self.count :] = value
        return filled

    def _padded(self, index: Tensor) -> Tensor:
        extra = self.padded_count - self.count
        return index if extra == 0 else torch.cat([index, index[:1].expand(extra)])


def select_tokens(mask: Tensor, bucket: int | None = None) -> TokenSelection:
    """Index the ``True`` entries of ``mask`` (``[batch, seq]``, bool), flat and padded per row.

    Args:
        mask: Which tokens to select.
        bucket: Round the gathered row count and the row width up to a multiple of this (capped at
            ``batch * seq`` and ``seq``; see the module docstring); ``None``: exact sizes.
    """
    if mask.dim() != 2 or mask.dtype != torch.bool:
        raise ValueError(
            f"select_tokens needs a [batch, seq] bool mask, got {mask.dtype} of shape {tuple(mask.shape)}."
        )
    check_token_bucket("select_tokens(bucket)", bucket)
    batch, seq = mask.shape
    flat = mask.reshape(-1).nonzero().squeeze(1)
    counts = mask.sum(dim=1)
    width = _round_up(int(counts.max().item()) if batch else 0, bucket, seq)
    slot_in_row = (mask.cumsum(dim=1) - 1).reshape(-1).index_select(0, flat)
    slots = torch.div(flat, seq, rounding_mode="floor") * width + slot_in_row
    positions = torch.zeros(batch * width, dtype=torch.long, device=mask.device)
    positions = positions.index_copy(0, slots, flat % seq).view(batch, width)
    valid = torch.arange(width, device=mask.device).unsqueeze(0) < counts.unsqueeze(1)
    padded_count = _round_up(int(flat.numel()), bucket, batch * seq)
    return TokenSelection(flat, slots, positions, valid, batch, seq, width, padded_count)


def check_token_bucket(key: str, bucket: int | None) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``bucket`` is ``None`` or an integer >= 1."""
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise ValueError(
            f"{key}={bucket!r} must be None (exact token counts) or an integer >= 1 (round token counts up "
            "to a multiple of it, e.g. 64)."
        )


def _round_up(count: int, bucket: int | None, cap: int) -> int:
    if bucket is None or count == 0:
        return count
    return min(cap, -(-count // bucket) * bucket)


def attend_from_subset(attn: CausalSelfAttention, normed: Tensor, selection: TokenSelection) -> Tensor:
    """Causal attention for the selected tokens' queries over every token's keys and values.

    What an early-exit block runs: tokens that left still provide keys and values (from their carried
    hidden state, as CALM's state propagation does), only the still-active tokens get queries, the
    output projection and what follows.

    Args:
        attn: The block's attention (its fused ``qkv`` and ``proj`` weights are used).
        normed: ``[batch, seq, d_model]``: the attention input (after the block's LayerNorm) of all tokens.
        selection: The query tokens.

    Returns:
        ``[padded_count, d_model]``: the attention output of the selected tokens (then padding rows),
        after ``proj`` and its dropout.
    """
    d = normed.shape[-1]
    weight, bias = attn.qkv.weight, attn.qkv.bias
    q = F.linear(selection.gather(normed), weight[:d], None if bias is None else bias[:d])
    kv = F.linear(normed, weight[d:], None if bias is None else bias[d:])
    k, v = kv[..., :d], kv[..., d:]
    key_positions = torch.arange(selection.seq, device=normed.device).expand(selection.batch, -1)
    out = _attend(attn, selection.pad(q), k, v, selection, key_positions, None)
    return _project(attn, selection.unpad(out))


def attend_within_subset(attn: CausalSelfAttention, normed: Tensor, selection: TokenSelection) -> Tensor:
    """Causal attention among the selected tokens only (what a Mixture-of-Depths block runs).

    Args:
        attn: The block's attention.
        normed: ``[padded_count, d_model]``: the selected tokens' attention inputs (after the block's
            LayerNorm), as :meth:`TokenSelection.gather` returns them.
        selection: Which tokens they are.

    Returns:
        ``[padded_count, d_model]``: their attention output, after ``proj`` and its dropout.
    """
    q, k, v = selection.pad(attn.qkv(normed)).chunk(3, dim=-1)
    out = _attend(attn, q, k, v, selection, selection.positions, selection.valid)
    return _project(attn, selection.unpad(out))


def _attend(
    attn: CausalSelfAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    queries: TokenSelection,
    key_positions: Tensor,
    key_valid: Tensor | None,
) -> Tensor:
    """``q`` ``[batch, width, d]``, ``k``/``v`` ``[batch, keys, d]`` -> ``[batch, width, d]``."""
    batch, width, d = q.shape
    heads = attn.num_heads

    def split(x: Tensor) -> Tensor:
        return x.reshape(batch, x.shape[1], heads, d // heads).transpose(1, 2)

    allowed = key_positions.unsqueeze(1) <= queries.positions.unsqueeze(2)  # [batch, width, keys]
    if key_valid is not None:
        allowed = allowed & key_valid.unsqueeze(1)
    allowed = allowed | ~queries.valid.unsqueeze(2)  # padding queries see everything: finite, then dropped
    p = attn.dropout if attn.training else 0.0
    out = F.scaled_dot_product_attention(
        split(q), split(k), split(v), attn_mask=allowed.unsqueeze(1), dropout_p=p
    )
    return out.transpose(1, 2).reshape(batch, width, d)


def _project(attn: CausalSelfAttention, out: Tensor) -> Tensor:
    result: Tensor = attn.resid_drop(attn.proj(out))
    return result


def touch_parameters(module: nn.Module, like: Tensor) -> Tensor:
    """A zero that depends on every parameter of ``module``: add it when a block skipped all its work.

    Every parameter then gets a gradient (of zeros) rather than none, so data-parallel replicas whose
    micro-batches processed different tokens still all-reduce the same set of gradients.
    """
    zero = like.new_zeros(())
    for param in module.parameters():
        if param.requires_grad:
            zero = zero + param.reshape(-1)[:1].sum().to(like.dtype) * 0.0
    return zero


def training_forward(module: nn.Module) -> bool:
    """Whether ``module``'s forward now counts: training, outside torch's shape-inference pass."""
    return module.training and not in_shape_inference()


@dataclass
class TokenCounts:
    """How many tokens a block was given and processed in training forwards: its work signal.

    Shape-inference passes and evaluation are not counted. A plain object in the block, so migration
    carries it; checkpoints do not (it is a statistic, not model state).

    Attributes:
        seen: Tokens given to the block, summed over calls.
        processed: Tokens it ran its queries and MLP for, summed over calls.
        calls: Forward calls counted (one per micro-batch).
        last_seen: Tokens given in the latest call.
        last_processed: Tokens processed in the latest call.
    """

    seen: int = 0
    processed: int = 0
    calls: int = 0
    last_seen: int = 0
    last_processed: int = 0

    def record(self, processed: int, seen: int) -> None:
        """Count one call."""
        self.seen += seen
        self.processed += processed
        self.calls += 1
        self.last_seen, self.last_processed = seen, processed

    @property
    def fraction(self) -> float:
        """Processed tokens over tokens given, over every counted call (1.0 before any)."""
        return self.processed / self.seen if self.seen else 1.0

    def reset(self) -> None:
        """Start counting afresh."""
        self.seen = self.processed = self.calls = self.last_seen = self.last_processed = 0


def token_counts(model: nn.Module) -> dict[int, TokenCounts]:
    """Per global layer index, the :class:`TokenCounts` of ``model``'s blocks that keep them.

    Under :class:`~lightning_dynmo.DynMoStrategy` a rank holds only its own blocks, so this is that
    rank's share; a single process sees every layer.

    Raises:
        TypeError: ``model`` has no ``layers`` ``ModuleDict`` (the pipeline contract's blocks).
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(
            f"token_counts needs a model with `layers: nn.ModuleDict` (the pipeline contract), got "
            f"{type(model).__name__} whose `layers` is {type(layers).__name__}."
        )
    return {
        int(key): counts
        for key, block in layers.items()
        if isinstance(counts := getattr(block, "token_counts", None), TokenCounts)
    }
