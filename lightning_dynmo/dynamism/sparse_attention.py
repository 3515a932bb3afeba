"""Hash-based dynamic sparse attention: a GPT block (kind ``"sparse_attention"``) whose causal attention
only looks inside hash buckets, and whose attention cost follows the tiles those buckets occupy.

Read in this order: :class:`SparseAttentionOptions` (every knob), :func:`rotation_seed` and
:func:`random_rotations` (which rotations a forward draws), :func:`hash_buckets`, :func:`plan_tiles`
(sorting and which tiles are active), :func:`block_sparse_attention` (the computation, on active tiles
only) and its dense reference :func:`bucket_masked_attention`, then :class:`SparseAttentionBlock` and
:func:`sparse_attention_gpt_config` (the ready configuration).

The scheme (Pagliardini et al., "Fast attention over long sequences with dynamic sparse flash
attention", NeurIPS 2023, hash-sparse variant). Per head, a random matrix ``R`` of shape
``[head_dim, num_buckets / 2]`` with unit columns is drawn at every forward; a query or key ``x`` falls
in bucket ``argmax([x R, -x R])`` (one of ``num_buckets``). Query ``t`` attends to key ``s`` only if
``s <= t`` (causal) and both are in the same bucket; a query with no such key outputs 0. Queries and
keys are sorted by ``(bucket, position)``; cut into tiles of ``block_size`` rows, the sorted attention
matrix is block sparse: a tile pair can hold a visible pair only if its query and key bucket ranges
overlap and its first key position is not after its last query position. Those tiles are *active*;
only they are computed (scores, softmax statistics, values), so the attention work is
``active tiles x block_size^2 x head_dim`` instead of the dense causal triangle. Two kernels compute
them (``SparseAttentionOptions.kernel``): the gather kernel here, and FlexAttention with the active
tiles as its block mask (:mod:`~lightning_dynmo.dynamism.sparse_attention_flex`). With
``num_buckets=1`` every key is in the query's bucket: it is exactly dense causal attention.

Seeding. The rotations of a forward come from a generator seeded by :func:`rotation_seed` of the
model's seed, ``hash_seed``, the layer's global index and the block's count of training forwards so far
(the persistent buffer ``hash_forwards``). They are drawn on the CPU in float64 and then moved, so every
device and every rank draws the same ones. The count advances once per training forward (module in
training mode, gradients enabled) and never in torch's shape-inference pass
(:func:`~lightning_dynmo.pipeline.in_shape_inference`) or in evaluation forwards (which use the
current count without advancing it). A pipeline stage runs a block once per micro-batch in micro-batch
order, as ``GPT(microbatches=n)`` does in one process, so both draw the same rotations for the same
micro-batch; the count is a buffer, so it migrates with the block and is saved in checkpoints. Under
data parallelism every replica draws the same rotations for its ``m``-th micro-batch (equal across
ranks), which a single-process reference with ``n x replicas`` micro-batches does not reproduce.

What a block exposes (every forward except torch's shape-inference pass): ``active_blocks`` and
``causal_blocks`` (active tiles and the dense causal tiles of the same input, summed over batch rows
and heads, last forward); over the training forwards of the current optimizer step
``step_active_blocks`` and ``step_causal_blocks``. The per-layer **work signal** is
:attr:`SparseAttentionBlock.active_fraction`: active / dense causal tiles over the last completed step
(1.0 for one bucket or before any step, lower the sparser the layer). The GPT calls
:meth:`SparseAttentionBlock.after_optimizer_step` after each optimizer step (no hooks: they do not
migrate).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dynmo.dynamism.sparse_attention_flex import (
    ATTENTION_KERNELS,
    flex_bucket_attention,
    resolve_attention_kernel,
)
from lightning_dynmo.models.config import GPTConfig, check_positive_int, split_block_options
from lightning_dynmo.models.dense import MLP, AttentionProjections
from lightning_dynmo.models.registry import register_block
from lightning_dynmo.pipeline.step.stage import in_shape_inference

__all__ = [
    "HashedCausalSelfAttention",
    "SparseAttentionBlock",
    "SparseAttentionOptions",
    "TilePlan",
    "block_sparse_attention",
    "bucket_masked_attention",
    "build_sparse_attention_block",
    "hash_buckets",
    "plan_tiles",
    "random_rotations",
    "rotation_seed",
    "sparse_attention_gpt_config",
]


@dataclass(frozen=True, kw_only=True)
class SparseAttentionOptions:
    """Settings of a ``"sparse_attention"`` block (see the module docstring for the scheme).

    Attributes:
        num_buckets: Hash buckets per head: 1 (dense causal attention) or an even number (``R`` has
            ``num_buckets / 2`` columns).
        block_size: Rows of a tile of the sorted queries and keys; it must divide the sequence length.
        hash_seed: Mixed into every rotation seed with the model's seed (two models that differ only in
            it draw different rotations).
        kernel: Which kernel computes the active tiles. ``"gather"``: :func:`block_sparse_attention`
            (gathers the active tiles and runs batched matmuls; any device, forward and backward).
            ``"flex"``: torch's FlexAttention with the active tiles as its block mask
            (:mod:`~lightning_dynmo.dynamism.sparse_attention_flex`); compiled on CUDA, and on a CPU
            only for forwards without a backward (torch has no CPU backward for it: a CPU training
            forward raises). ``"auto"`` (default): FlexAttention on CUDA (unless attention dropout is
            on or ``block_size`` is not a multiple of 16), the gather kernel elsewhere, logged once.
            Every kernel computes the same attention on the same tiles (float64 tests), so the choice
            changes time, not results or statistics.
    """

    num_buckets: int = 8
    block_size: int = 16
    hash_seed: int = 0
    kernel: str = "auto"

    def __post_init__(self) -> None:
        for name in ("num_buckets", "block_size"):
            check_positive_int(name, getattr(self, name), owner="SparseAttentionOptions")
        if self.num_buckets > 1 and self.num_buckets % 2:
            raise ValueError(
                f"SparseAttentionOptions.num_buckets={self.num_buckets} must be 1 or even: the buckets are "
                f"the argmax over [xR, -xR] with R of num_buckets / 2 columns; use {self.num_buckets + 1}."
            )
        seed = self.hash_seed
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"SparseAttentionOptions.hash_seed={seed!r} must be an integer >= 0.")
        if self.kernel not in ATTENTION_KERNELS:
            raise ValueError(
                f"SparseAttentionOptions.kernel={self.kernel!r} is not one of {ATTENTION_KERNELS}; use "
                "'auto' (FlexAttention on CUDA, the gather kernel elsewhere), 'flex' or 'gather'."
            )

    def check_sequence(self, seq_len: int, where: str) -> None:
        """Raise if ``block_size`` does not divide ``seq_len`` (``where`` names the length in the error)."""
        if seq_len % self.block_size:
            raise ValueError(
                f"SparseAttentionOptions.block_size={self.block_size} does not divide {where}={seq_len}: "
                "the sorted queries and keys are cut into tiles of block_size rows. Pick a block_size "
                f"that divides it (e.g. {math.gcd(seq_len, self.block_size)}) or a multiple sequence length."
            )


# -- rotations and buckets -----------------------------------------------------------------------------


def rotation_seed(model_seed: int, hash_seed: int, layer_index: int, forward_index: int) -> int:
    """The 63-bit seed of the rotations of one forward (stable across runs, processes and devices)."""
    text = f"sparse_attention/{model_seed}/{hash_seed}/{layer_index}/{forward_index}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def random_rotations(seed: int, num_heads: int, head_dim: int, num_buckets: int) -> Tensor | None:
    """``[num_heads, head_dim, num_buckets / 2]`` float64 CPU matrices, unit columns; ``None``: 1 bucket."""
    if num_buckets == 1:
        return None
    generator = torch.Generator().manual_seed(seed)
    rotations = torch.randn(num_heads, head_dim, num_buckets // 2, generator=generator, dtype=torch.float64)
    unit: Tensor = rotations / rotations.norm(dim=1, keepdim=True)
    return unit


def hash_buckets(x: Tensor, rotations: Tensor | None) -> Tensor:
    """Bucket of each row of ``x`` (``[batch, heads, seq, head_dim]``): ``argmax([x R, -x R])``, int64.

    ``rotations`` is ``[heads, head_dim, num_buckets / 2]`` (cast to ``x``'s dtype and device), or
    ``None``: every row in bucket 0.
    """
    if rotations is None:
        return torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
    with torch.no_grad():
        projected = torch.einsum("bhtd,hdr->bhtr", x, rotations.to(x.device, x.dtype))
        return torch.cat([projected, -projected], dim=-1).argmax(dim=-1)


# -- tiles -----------------------------------------------------------------------------------------------


class TilePlan(NamedTuple):
    """Sorted queries and keys cut into tiles, and which tile pairs hold a visible pair.

    Shapes: ``B`` batch rows, ``H`` heads, ``T`` positions, ``n = T / block_size`` tiles.

    Attributes:
        q_order: ``[B, H, T]`` query positions sorted by ``(bucket, position)``.
        k_order: ``[B, H, T]`` key positions sorted the same way.
        q_bucket: ``[B, H, n, block_size]`` bucket of each sorted query.
        k_bucket: ``[B, H, n, block_size]`` bucket of each sorted key.
        active: ``[B, H, n, n]`` whether query tile ``i`` and key tile ``j`` are computed.
    """

    q_order: Tensor
    k_order: Tensor
    q_bucket: Tensor
    k_bucket: Tensor
    active: Tensor

    @property
    def block_size(self) -> int:
        """Rows per tile."""
        return int(self.q_bucket.shape[-1])

    def active_blocks(self) -> int:
        """Active tile pairs, over batch rows and heads."""
        return int(self.active.sum())

    def causal_blocks(self) -> int:
        """Tile pairs dense causal attention computes on this input: ``n (n + 1) / 2`` per row and head."""
        b, h, n, _ = self.active.shape
        return b * h * n * (n + 1) // 2


def _sort_by_bucket(buckets: Tensor) -> Tensor:
    positions = torch.arange(buckets.shape[-1], device=buckets.device)
    return (buckets * buckets.shape[-1] + positions).argsort(dim=-1)


def plan_tiles(q_bucket: Tensor, k_bucket: Tensor, block_size: int) -> TilePlan:
    """Sort queries and keys by ``(bucket, position)`` and find the active tile pairs.

    A pair ``(i, j)`` is active when the bucket ranges of query tile ``i`` and key tile ``j`` overlap and
    the first key position of ``j`` is not after the last query position of ``i`` (the test a
    block-sparse kernel makes: every visible pair lies in an active tile; an active tile may hold none).

    Args:
        q_bucket: ``[B, H, T]`` bucket of every query.
        k_bucket: ``[B, H, T]`` bucket of every key.
        block_size: Rows per tile; must divide ``T``.
    """
    b, h, t = q_bucket.shape
    n = t // block_size
    assert n * block_size == t, f"block_size={block_size} must divide the sequence length {t}"
    q_order, k_order = _sort_by_bucket(q_bucket), _sort_by_bucket(k_bucket)
    qb = q_bucket.gather(-1, q_order).view(b, h, n, block_size)
    kb = k_bucket.gather(-1, k_order).view(b, h, n, block_size)
    q_last = q_order.view(b, h, n, block_size).amax(-1)
    k_first = k_order.view(b, h, n, block_size).amin(-1)
    overlap = (kb[..., 0].unsqueeze(-2) <= qb[..., -1].unsqueeze(-1)) & (
        kb[..., -1].unsqueeze(-2) >= qb[..., 0].unsqueeze(-1)
    )
    causal = k_first.unsqueeze(-2) <= q_last.unsqueeze(-1)
    return TilePlan(q_order, k_order, qb, kb, overlap & causal)


# -- attention -------------------------------------------------------------------------------------------


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, plan: TilePlan, dropout_p: float = 0.0) -> Tensor:
    """Causal attention within buckets, computed on the active tiles of ``plan`` only.

    Every active tile pair is gathered (``[N, block_size, head_dim]`` queries, keys and values), its
    scores masked to same-bucket causal pairs; a query row's softmax spans all its active key tiles
    (per-row maxima and sums are reduced across tiles, indexed by the row's original position, so the
    output needs no unsorting). Differentiable in ``q``, ``k``, ``v``.

    Args:
        q: ``[B, H, T, D]`` queries.
        k: ``[B, H, T, D]`` keys.
        v: ``[B, H, T, D]`` values.
        plan: From :func:`plan_tiles` on the same ``B, H, T``.
        dropout_p: Dropout on the attention weights.

    Returns:
        ``[B, H, T, D]``; 0 for a query with no visible key.
    """
    b, h, t, d = q.shape
    size = plan.block_size
    n = t // size
    bi, hi, qi, ki = plan.active.nonzero(as_tuple=True)
    # Row indices into the flattened [B * H * T] positions of every query / key row of every active pair.
    base = ((bi * h + hi) * t).unsqueeze(-1)
    q_rows = base + plan.q_order.view(b, h, n, size)[bi, hi, qi]
    k_rows = base + plan.k_order.view(b, h, n, size)[bi, hi, ki]
    q_tiles = q.reshape(-1, d).index_select(0, q_rows.reshape(-1)).view(-1, size, d)
    k_tiles = k.reshape(-1, d).index_select(0, k_rows.reshape(-1)).view(-1, size, d)
    v_tiles = v.reshape(-1, d).index_select(0, k_rows.reshape(-1)).view(-1, size, d)
    same_bucket = plan.q_bucket[bi, hi, qi].unsqueeze(-1) == plan.k_bucket[bi, hi, ki].unsqueeze(-2)
    visible = same_bucket & (k_rows.unsqueeze(-2) <= q_rows.unsqueeze(-1))  # same (b, h): positions compare
    # Softmax statistics in at least float32 (as fused attention keeps them), whatever autocast makes of
    # the matmuls: CUDA autocast returns bf16 scores but float32 from exp, and every accumulator below is
    # made from the tensor it accumulates, so the dtypes agree in float64, float32 and under autocast.
    stats = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q_tiles * (1.0 / math.sqrt(d)), k_tiles.transpose(-1, -2)).to(stats)
    scores = scores.masked_fill(~visible, float("-inf"))
    # A query row's softmax spans all its active tiles: reduce maxima and sums over its original row.
    flat_rows = q_rows.reshape(-1)
    with torch.no_grad():  # softmax is shift invariant: the shift needs no gradient
        row_max = scores.new_full((b * h * t,), float("-inf"))
        row_max.scatter_reduce_(0, flat_rows, scores.amax(-1).reshape(-1), reduce="amax")
        shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))[q_rows]
    weights = torch.exp(scores - shift.unsqueeze(-1))
    row_sums = weights.sum(-1).reshape(-1)
    denominator = row_sums.new_zeros(b * h * t).index_add(0, flat_rows, row_sums)
    if dropout_p > 0:
        weights = F.dropout(weights, dropout_p)
    products = torch.matmul(weights, v_tiles.to(weights.dtype)).reshape(-1, d)
    numerator = products.new_zeros(b * h * t, d).index_add(0, flat_rows, products)
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return (numerator / safe.unsqueeze(-1)).to(v.dtype).view(b, h, t, d)


def bucket_masked_attention(q: Tensor, k: Tensor, v: Tensor, q_bucket: Tensor, k_bucket: Tensor) -> Tensor:
    """The dense reference: full ``[T, T]`` scores masked to same-bucket causal pairs (no sort, no tiles).

    Args:
        q: ``[B, H, T, D]`` queries.
        k: ``[B, H, T, D]`` keys.
        v: ``[B, H, T, D]`` values.
        q_bucket: ``[B, H, T]`` bucket of every query.
        k_bucket: ``[B, H, T]`` bucket of every key.

    Returns:
        ``[B, H, T, D]``; 0 for a query with no visible key.
    """
    t = q.shape[-2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = (q_bucket.unsqueeze(-1) == k_bucket.unsqueeze(-2)) & causal
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, float("-inf"))
    shift = scores.detach().amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)))
    total = weights.sum(-1, keepdim=True)
    return torch.matmul(weights, v) / torch.where(total > 0, total, torch.ones_like(total))


class HashedCausalSelfAttention(AttentionProjections):
    """Multi-head hash-sparse causal self-attention.

    Its parameters are those of :class:`~lightning_dynmo.models.CausalSelfAttention` (fused ``qkv``,
    output ``proj``), so a dense block's weights load into it.

    Args:
        config: The GPT's shape.
        options: Buckets and tile size.
    """

    def __init__(self, config: GPTConfig, options: SparseAttentionOptions) -> None:
        super().__init__(config)
        self.options = options

    def forward(self, x: Tensor, rotations: Tensor | None) -> tuple[Tensor, TilePlan]:
        """``[batch, seq, d_model] -> [batch, seq, d_model]`` and the tile plan it computed on.

        Raises:
            ValueError: ``seq`` is not a multiple of ``block_size``.
        """
        b, t, d = x.shape
        self.options.check_sequence(t, "the input's sequence length")
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        plan = plan_tiles(hash_buckets(q, rotations), hash_buckets(k, rotations), self.options.block_size)
        p = self.dropout if self.training else 0.0
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        kernel = resolve_attention_kernel(
            self.options.kernel,
            q.device,
            block_size=self.options.block_size,
            needs_grad=needs_grad,
            dropout_p=p,
        )
        if kernel == "flex":
            out = flex_bucket_attention(q, k, v, plan)
        else:
            out = block_sparse_attention(q, k, v, plan, dropout_p=p)
        result: Tensor = self.resid_drop(self.proj(out.transpose(1, 2).reshape(b, t, d)))
        return result, plan


class SparseAttentionBlock(nn.Module):
    """Pre-norm GPT-2 block whose attention is hash-sparse (see the module docstring).

    Same sub-modules and parameter names as :class:`~lightning_dynmo.models.DenseBlock` (``ln_1``,
    ``attn.qkv``, ``attn.proj``, ``ln_2``, ``mlp``), plus the persistent buffer ``hash_forwards``.

    Args:
        config: The GPT's shape (its ``seed`` enters the rotation seeds).
        options: The sparse-attention settings.
        layer_index: The block's global index (enters the rotation seeds).

    Raises:
        ValueError: ``options.block_size`` does not divide ``config.seq_len``.
    """

    hash_forwards: Tensor

    def __init__(self, config: GPTConfig, options: SparseAttentionOptions, layer_index: int = 0) -> None:
        super().__init__()
        options.check_sequence(config.seq_len, "GPTConfig.seq_len")
        self.options = options
        self.layer_index = layer_index
        self.model_seed = config.seed
        self.head_dim = config.d_model // config.num_heads
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = HashedCausalSelfAttention(config, options)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)
        self.register_buffer("hash_forwards", torch.zeros((), dtype=torch.long))
        # Observations (plain attributes: they travel with the block, not into checkpoints).
        self.active_blocks = 0
        self.causal_blocks = 0
        self.step_active_blocks = 0
        self.step_causal_blocks = 0
        self.active_fraction = 1.0

    def rotations(self) -> Tensor | None:
        """The rotations the next forward uses (from the current ``hash_forwards``)."""
        count = int(self.hash_forwards)
        seed = rotation_seed(self.model_seed, self.options.hash_seed, self.layer_index, count)
        return random_rotations(seed, self.attn.num_heads, self.head_dim, self.options.num_buckets)

    def forward(self, hidden: Tensor) -> Tensor:
        """``[batch, seq, d_model] -> [batch, seq, d_model]``."""
        attn_out, plan = self.attn(self.ln_1(hidden), self.rotations())
        hidden = hidden + attn_out
        result: Tensor = hidden + self.mlp(self.ln_2(hidden))
        self._observe(plan)
        return result

    def _observe(self, plan: TilePlan) -> None:
        if in_shape_inference():
            return  # torch's metadata pass on zeroed inputs: not a real micro-batch
        self.active_blocks = plan.active_blocks()
        self.causal_blocks = plan.causal_blocks()
        if self.training and torch.is_grad_enabled():
            self.hash_forwards += 1
            self.step_active_blocks += self.active_blocks
            self.step_causal_blocks += self.causal_blocks

    def after_optimizer_step(
        self, *, group: dist.ProcessGroup | None = None, step: int | None = None
    ) -> None:
        """Close the optimizer step: the step's active fraction becomes the work signal; counts reset.

        Called by the GPT after each optimizer step on the rank holding the block. ``group`` and ``step``
        are the GPT's calling convention; the signal is this rank's own (replicas compute the same
        tiles only on the same data).
        """
        if self.step_causal_blocks > 0:
            self.active_fraction = self.step_active_blocks / self.step_causal_blocks
        self.step_active_blocks = self.step_causal_blocks = 0


def build_sparse_attention_block(
    config: GPTConfig, layer_index: int, options: SparseAttentionOptions
) -> SparseAttentionBlock:
    """The ``"sparse_attention"`` kind's factory."""
    return SparseAttentionBlock(config, options, layer_index)


register_block(
    "sparse_attention", build_sparse_attention_block, options_type=SparseAttentionOptions, replace=True
)


def sparse_attention_gpt_config(*, num_layers: int = 8, seq_len: int = 512, **fields: Any) -> GPTConfig:
    """The ready sparse-attention GPT: byte vocabulary, every block a :class:`SparseAttentionBlock`.

    Args:
        num_layers: Blocks in all.
        seq_len: Longest input sequence; a multiple of ``block_size``.
        **fields: Any :class:`SparseAttentionOptions` field (``num_buckets``, ``block_size``, ...) and any
            other :class:`~lightning_dynmo.models.GPTConfig` field (``d_model``, ``num_heads``, ...).

    Raises:
        ValueError: a bad option (from :class:`SparseAttentionOptions` and
            :class:`~lightning_dynmo.models.GPTConfig`), or a ``block_size`` that does not divide ``seq_len``.
        TypeError: a keyword that is neither.
    """
    sparse, gpt = split_block_options("sparse_attention_gpt_config", SparseAttentionOptions, fields)
    sparse.check_sequence(seq_len, "seq_len")
    return GPTConfig(num_layers=num_layers, seq_len=seq_len, blocks=sparse, **gpt)
