"""Initial weights, seeded per unit: a unit's weights depend on ``(seed, unit name)`` only.

Every unit (``"tok_emb"``, ``"layers.7"``, ``"head"``, ...) is built and initialised inside
:func:`unit_rng`, which seeds torch's default generator from :func:`unit_seed` and restores the outer
state afterwards. So a rank that builds only its own units, or builds them in another order, gets the
same weights as a single process that builds the whole model; whatever random initialisation a block
does in its constructor is covered too.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["gpt2_init_", "unit_rng", "unit_seed"]


def unit_seed(seed: int, unit: str) -> int:
    """A 63-bit seed derived from the base ``seed`` and the unit's global name (stable across runs)."""
    digest = hashlib.sha256(f"{seed}/{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@contextmanager
def unit_rng(seed: int, unit: str) -> Iterator[None]:
    """Run the body with torch's CPU generator seeded for ``unit``; the previous state is restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(seed, unit))
        yield


def gpt2_init_(module: nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2 initialisation of ``module``'s Linear, Embedding and LayerNorm sub-modules, in place.

    Linear and Embedding weights ~ N(0, std); a Linear with ``residual_projection = True`` (its output is
    added to the residual stream) gets ``std / sqrt(2 * num_layers)`` so the residual sum does not grow
    with depth; biases 0; LayerNorm weight 1, bias 0. Other parameters are left as they are.
    """
    residual_std = std / math.sqrt(2 * num_layers)
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(
                sub.weight, 0.0, residual_std if getattr(sub, "residual_projection", False) else std
            )
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.Embedding):
            nn.init.normal_(sub.weight, 0.0, std)
        elif isinstance(sub, nn.LayerNorm):
            sub.reset_parameters()
