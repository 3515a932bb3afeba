"""Dynamic blocks for the GPT, one module per case; importing a module registers its block kind.

``moe`` registers "moe" (MoEOptions), ``sparse_attention`` registers "sparse_attention"; ``pruning`` is the
gradual global magnitude pruner (no block kind).
"""

from lightning_dynmo.dynamism import moe as moe
from lightning_dynmo.dynamism import pruning as pruning
from lightning_dynmo.dynamism import sparse_attention as sparse_attention
