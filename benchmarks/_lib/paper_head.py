"""The paper's GPT-2 head + loss against one of its blocks, timed on this CPU (forward and backward).

The paper's shape (its appendix): hidden 1024, 32 heads, MLP 4096, sequence 2048, a GPT-2 vocabulary
(50,257). One micro-batch of ``batch`` sequences; the ratio head + loss / block is what
:mod:`benchmarks.paper_setup` multiplies the GPU block by. Rounds alternate the two (one torch thread);
the median per-round ratio is kept and every round is returned.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadShape:
    """The widths timed: hidden, heads, MLP, sequence, vocabulary, sequences per micro-batch."""

    d_model: int = 1024
    num_heads: int = 32
    d_ff: int = 4096
    seq_len: int = 2048
    vocab_size: int = 50257
    batch: int = 1


class _Block(nn.Module):
    """A pre-norm GPT block: causal attention (torch's SDPA) and a GELU MLP."""

    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.heads = s.num_heads
        self.ln1, self.ln2 = nn.LayerNorm(s.d_model), nn.LayerNorm(s.d_model)
        self.qkv, self.proj = nn.Linear(s.d_model, 3 * s.d_model), nn.Linear(s.d_model, s.d_model)
        self.up, self.down = nn.Linear(s.d_model, s.d_ff), nn.Linear(s.d_ff, s.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.ln2(x))))
        return out


class _Head(nn.Module):
    """Final norm, the untied vocabulary projection and the cross-entropy loss."""

    def __init__(self, s: HeadShape) -> None:
        super().__init__()
        self.ln, self.out = nn.LayerNorm(s.d_model), nn.Linear(s.d_model, s.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _time(fn: nn.Module, x: torch.Tensor, *extra: torch.Tensor) -> tuple[float, float]:
    x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    y = fn(x, *extra)
    t1 = time.perf_counter()
    (y if y.dim() == 0 else y.float().sum()).backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(shape: HeadShape, rounds: int) -> dict[str, object]:
    """Per round the block's and the head + loss's forward and backward seconds; median ratios."""
    torch.manual_seed(0)
    block, head = _Block(shape), _Head(shape)
    x = torch.randn(shape.batch, shape.seq_len, shape.d_model)
    target = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len))
    _time(block, x), _time(head, x, target)  # warm-up
    per_round: list[dict[str, list[float]]] = []
    for r in range(rounds):
        got: dict[str, tuple[float, float]] = {}
        for name in ("block", "head") if r % 2 == 0 else ("head", "block"):  # order alternates by round
            got[name] = _time(block, x) if name == "block" else _time(head, x, target)
        (bf, bb), (hf, hb) = got["block"], got["head"]
        per_round.append({"block_s": [bf, bb], "head_s": [hf, hb], "ratio": [hf / bf, hb / bb]})
    return {
        "shape": shape.__dict__,
        "torch_threads": torch.get_num_threads(),
        "rounds": per_round,
        "ratio_fwd": statistics.median(r["ratio"][0] for r in per_round),
        "ratio_bwd": statistics.median(r["ratio"][1] for r in per_round),
    }
