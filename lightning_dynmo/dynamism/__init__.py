"""Dynamic blocks for the GPT, one module per case; importing a module registers its block kind.

``moe`` (Mixture of Experts, kind ``"moe"``), ``early_exit`` (CALM-style token exit, kind
``"early_exit"``), ``mod`` (Mixture of Depths, kind ``"mod"``), ``sparse_attention`` (hash-based
block-sparse attention, kind ``"sparse_attention"``); ``tokens`` holds what the token-routing cases share;
``pruning`` is the gradual global magnitude pruner and ``freezing`` the layer freezer (no block kinds).
"""

from lightning_dynmo.dynamism import early_exit as early_exit
from lightning_dynmo.dynamism import freezing as freezing
from lightning_dynmo.dynamism import mod as mod
from lightning_dynmo.dynamism import moe as moe
from lightning_dynmo.dynamism import pruning as pruning
from lightning_dynmo.dynamism import sparse_attention as sparse_attention
