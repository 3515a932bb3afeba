"""Hash-sparse attention on torch's FlexAttention: the active tiles of a :class:`TilePlan` as a BlockMask.

Read in this order: :data:`ATTENTION_KERNELS` and :func:`resolve_attention_kernel` (which kernel a
forward runs, and why a CPU training forward cannot run FlexAttention), :func:`plan_block_mask` (the
plan's active tile pairs become FlexAttention's block lists, with a ``mask_mod`` that masks inside the
tiles), then :func:`flex_bucket_attention` (the computation).

How the hash scheme maps onto FlexAttention. Queries and keys are permuted into the plan's
``(bucket, position)`` order, so the sorted attention matrix is block sparse: tile pair ``(i, j)`` is in
the block lists when the plan marks it active, and inside a listed tile the ``mask_mod`` keeps the
same-bucket causal pairs (it compares the sorted rows' buckets and original positions). The output
comes back in sorted query order and is permuted back. A query with no visible key gets 0, as the
gather kernel and the dense reference give.

Why the ``mask_mod`` is always passed: the eager (unfused) path, the one CPUs run, evaluates the
``mask_mod`` on every element and ignores the block lists, so a BlockMask with a no-op ``mask_mod``
computes unmasked attention there (the test suite shows it).

Kernels on each device (torch 2.13):

* CUDA: ``torch.compile(flex_attention)`` lowers to Triton forward and backward kernels that visit
  the listed tiles only. This is the kernel that should make a sparse block cheaper than fused dense
  attention; whether it does at the paper's shape is measured by ``lightning_dynmo.gpu_check.kernels``,
  not assumed.
* CPU: FlexAttention runs eagerly (the whole score matrix, masked) and has **no backward**. So a CPU
  training forward runs the gather kernel
  (:func:`~lightning_dynmo.dynamism.sparse_attention.block_sparse_attention`), which the CPU tests
  prove equal to FlexAttention's forward in float64.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

if TYPE_CHECKING:
    from lightning_dynmo.dynamism.sparse_attention import TilePlan

__all__ = [
    "ATTENTION_KERNELS",
    "flex_bucket_attention",
    "plan_block_mask",
    "resolve_attention_kernel",
]

log = logging.getLogger(__name__)

#: The kernels a sparse-attention block can run: ``"auto"`` picks per forward (see
#: :func:`resolve_attention_kernel`).
ATTENTION_KERNELS = ("auto", "flex", "gather")

_logged: set[tuple[str, str]] = set()
_MIN_TILE = 16
_compiled_flex: Callable[..., Tensor] | None = None


def resolve_attention_kernel(
    kernel: str, device: torch.device, *, block_size: int, needs_grad: bool, dropout_p: float
) -> str:
    """The kernel a forward runs: ``"flex"`` or ``"gather"``.

    ``"auto"`` picks FlexAttention on CUDA (compiled, forward and backward) unless attention dropout is
    on (FlexAttention has none) or the tiles are not a multiple of 16 rows (the smallest Triton tile),
    and the gather kernel elsewhere; the choice is logged once per device type and reason.

    Args:
        kernel: One of :data:`ATTENTION_KERNELS` (``SparseAttentionOptions.kernel``).
        device: Where the queries are.
        block_size: Rows per tile (``SparseAttentionOptions.block_size``).
        needs_grad: Whether the forward records a graph for backward.
        dropout_p: The attention dropout this forward applies.

    Raises:
        RuntimeError: ``kernel="flex"`` where it cannot run: a CPU forward that needs a backward, a
            forward with attention dropout, or CUDA tiles that are not a multiple of 16 rows.
    """
    if kernel == "gather" or device.type == "meta":  # meta: torch's shape inference, shapes only
        return "gather"
    cuda = device.type == "cuda"
    if kernel == "auto":
        chosen, why = "gather", "FlexAttention has no CPU backward; the gather kernel is exact against it"
        if cuda:
            chosen, why = "flex", "compiled FlexAttention on CUDA"
            if dropout_p > 0:
                chosen, why = "gather", "attention dropout is on and FlexAttention has none"
            elif block_size % _MIN_TILE:
                chosen, why = "gather", f"block_size={block_size} is not a multiple of {_MIN_TILE}"
        if (device.type, why) not in _logged:
            _logged.add((device.type, why))
            log.info("sparse attention kernel='auto' on %s runs %r: %s.", device.type, chosen, why)
        return chosen
    if cuda and block_size % _MIN_TILE:
        raise RuntimeError(
            f"SparseAttentionOptions.kernel='flex' with block_size={block_size} on CUDA: FlexAttention's "
            f"Triton tiles are at least {_MIN_TILE} rows and must divide the mask's tiles. Use a block_size "
            f"that is a multiple of {_MIN_TILE} (64 or 128 at long sequences), or kernel='gather'."
        )
    if dropout_p > 0:
        raise RuntimeError(
            f"SparseAttentionOptions.kernel='flex' with attention dropout {dropout_p}: FlexAttention has no "
            "dropout. Set GPTConfig.dropout=0, or use kernel='gather' (or 'auto', which picks it here)."
        )
    if device.type != "cuda" and needs_grad:
        raise RuntimeError(
            f"SparseAttentionOptions.kernel='flex' cannot train on {device.type}: torch's FlexAttention has "
            "no backward there (torch 2.13). Use kernel='auto' (FlexAttention on CUDA, the gather kernel "
            "elsewhere) or 'gather', or run the forward under torch.no_grad() / in eval mode."
        )
    return "flex"


def plan_block_mask(plan: TilePlan) -> BlockMask:
    """FlexAttention's BlockMask for ``plan``, in the plan's sorted query and key order.

    The block lists hold the plan's active tile pairs (built directly from them, no per-element pass),
    and the ``mask_mod`` keeps, inside a tile, the pairs whose sorted query and key share a bucket and
    whose key position is not after the query's.
    """
    b, h, n, size = plan.q_bucket.shape
    t = n * size
    q_bucket, k_bucket = plan.q_bucket.reshape(b, h, t), plan.k_bucket.reshape(b, h, t)
    q_position, k_position = plan.q_order, plan.k_order

    def visible(batch: Tensor, head: Tensor, q_index: Tensor, kv_index: Tensor) -> Tensor:
        same = q_bucket[batch, head, q_index] == k_bucket[batch, head, kv_index]
        return same & (k_position[batch, head, kv_index] <= q_position[batch, head, q_index])

    active = plan.active.to(torch.int32)
    kv_num_blocks = active.sum(dim=-1, dtype=torch.int32)
    kv_indices = active.argsort(dim=-1, descending=True, stable=True).to(torch.int32)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=size, mask_mod=visible, seq_lengths=(t, t)
    )


def flex_bucket_attention(q: Tensor, k: Tensor, v: Tensor, plan: TilePlan) -> Tensor:
    """Causal attention within buckets on FlexAttention: what the gather kernel computes, on ``plan``.

    Args:
        q: ``[B, H, T, D]`` queries.
        k: ``[B, H, T, D]`` keys.
        v: ``[B, H, T, D]`` values.
        plan: From :func:`~lightning_dynmo.dynamism.sparse_attention.plan_tiles` on the same ``B, H, T``.

    Returns:
        ``[B, H, T, D]`` in the original query order; 0 for a query with no visible key.
    """
    d = q.shape[-1]

    def sort(x: Tensor, order: Tensor) -> Tensor:
        return x.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, d))

    block_mask = plan_block_mask(plan)
    attend = _compiled() if q.is_cuda else cast(Callable[..., Tensor], flex_attention)
    out = attend(
        sort(q, plan.q_order),
        sort(k, plan.k_order),
        sort(v, plan.k_order),
        block_mask=block_mask,
        kernel_options=_kernel_options(plan.block_size) if q.is_cuda else None,
    )
    return sort(out, plan.q_order.argsort(dim=-1))


def _compiled() -> Callable[..., Tensor]:
    """One compiled FlexAttention for the process (torchtitan keeps one too: compiling is per callable)."""
    global _compiled_flex
    if _compiled_flex is None:
        _compiled_flex = cast(Callable[..., Tensor], torch.compile(flex_attention, dynamic=False))
    return _compiled_flex


def _kernel_options(block_size: int) -> dict[str, Any] | None:
    # The Triton template needs its tiles to divide the mask's tiles; below 64 rows the default
    # candidates may not, so name the largest power of two that does (unmeasured on a GPU: the
    # check uses 128-row tiles, where the autotuner's own candidates divide).
    if block_size % 64 == 0:
        return None
    tile = block_size & -block_size  # the largest power of two dividing block_size (>= 16 here)
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")
    return dict.fromkeys(keys, tile)
