"""Hash-based sparse attention on the trained queries and keys; per layer and step, the active-tile share.

Each block's attention input is captured in a real forward of the pretrained model; its queries and
keys are projected and rotated (RoPE) as the model does, the grouped key heads expanded to the query
heads, then hashed with random rotations redrawn every step (Pagliardini et al. 2023, hash-sparse) and
tiled by :func:`plan_tiles`. The statistic is active tile pairs / causal tile pairs (1.0: as dense as
causal attention). Nothing is trained: the hash has no parameters, and it is the trained q/k that
decide how tokens spread over buckets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from benchmarks._lib.trained.common import CaseRun
from benchmarks._lib.trained.text import token_batches
from benchmarks._lib.trained.traces import Trace, TraceRow
from benchmarks._lib.trained.training import decoder_layers
from lightning_dynmo.dynamism.sparse_attention import (
    hash_buckets,
    plan_tiles,
    random_rotations,
    rotation_seed,
)

__all__ = ["active_tile_share", "record", "rotated_qk"]

NUM_BUCKETS = 8


def rotated_qk(
    attention: Any, hidden: Tensor, position_embeddings: tuple[Tensor, Tensor]
) -> tuple[Tensor, Tensor]:
    """``(q, k)`` as ``[B, heads, T, head_dim]`` after RoPE, keys repeated to the query heads (GQA)."""
    b, t, _ = hidden.shape
    head_dim = int(attention.head_dim)
    q = attention.q_proj(hidden).view(b, t, -1, head_dim).transpose(1, 2)
    k = attention.k_proj(hidden).view(b, t, -1, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def active_tile_share(q: Tensor, k: Tensor, rotations: Tensor | None, block_size: int) -> float:
    """Active tile pairs over causal tile pairs for one layer's hashed ``q`` and ``k``."""
    plan = plan_tiles(hash_buckets(q, rotations), hash_buckets(k, rotations), block_size)
    return plan.active_blocks() / plan.causal_blocks()


def record(run: CaseRun) -> Trace:
    """Forward corpus blocks through the model; per step and layer, the share of causal tiles active."""
    seq, block, steps = (128, 8, 2) if run.quick else (1024, 64, 8)
    model = run.pretrained.model
    model.eval()
    layers = decoder_layers(model)
    trace = run.trace(
        "sparse_attention",
        "active tile pairs of hash-sparse attention / causal tile pairs",
        "fraction of causal tiles",
        f"pretrained weights, no training; batch 1 x seq {seq}, tiles of {block} ({seq // block} per row), "
        f"{NUM_BUCKETS} buckets per head, rotations redrawn each step (rotation_seed(0, 0, layer, step))",
    )
    captured: dict[int, tuple[Tensor, tuple[Tensor, Tensor]]] = {}

    def capture(index: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[index] = (hidden.detach(), kwargs["position_embeddings"])

        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        for step, tokens in enumerate(
            token_batches(run.encode, batch_size=1, seq_len=seq, num_batches=steps)
        ):
            with torch.no_grad():
                model(input_ids=tokens)
                shares = []
                for i, layer in enumerate(layers):
                    q, k = rotated_qk(layer.self_attn, *captured[i])
                    rotations = random_rotations(
                        rotation_seed(0, 0, i, step), q.shape[1], q.shape[-1], NUM_BUCKETS
                    )
                    shares.append(active_tile_share(q, k, rotations, block))
            trace.add(TraceRow(step, shares))
    finally:
        for handle in handles:
            handle.remove()
    return trace
